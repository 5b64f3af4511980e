"""Writing files so that a crash, a kill or a full disk never leaves a half-written one under
the final name, and checking an output path before any long work is done.

One helper, :func:`write_atomic`, writes every output of the package (JSON, text, PNG): the
data goes into a temp file in the same folder, is flushed to disk, and is renamed over the
final name (``os.replace`` is atomic on POSIX file systems).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from aiayn.errors import UserError


def fsync_dir(folder: str | Path) -> None:
    """Make a rename inside ``folder`` durable (best effort: some file systems refuse)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temp_beside(path: Path, suffix: str) -> tuple[int, str]:
    """A temp file in ``path``'s folder, with the permissions a plain ``open`` would give it
    (mkstemp's 0600 would hide every output from other users)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temp file beside ``path``; on success it replaces ``path``, on any error (or
    KeyboardInterrupt) it is removed and ``path`` keeps its old content."""
    path = Path(path)
    fd, tmp = _temp_beside(path, ".tmp")
    try:
        encoding = None if "b" in mode else "utf-8"
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically."""
    with atomic_file(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """``data`` as indented, key-sorted JSON, written atomically."""
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_with(path: str | Path, writer: Callable[[Path], None]) -> Path:
    """Atomically write a file made by ``writer(tmp_path)`` (e.g. matplotlib's ``savefig``)."""
    path = Path(path)
    fd, tmp = _temp_beside(path, path.suffix)
    os.close(fd)
    try:
        writer(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def check_output_file(path: str | Path, option: str = "-o") -> Path:
    """Check, before any long work, that ``path`` can be written as a file.

    Raises:
        UserError: ``path`` is a folder, its folder does not exist, or nothing can be written
            there (read-only, no permission); the message names ``path``.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory; give a file name")
    if not path.parent.is_dir():
        raise UserError(f"{option} {path}: the folder {path.parent} does not exist")
    _probe_write(path.parent, option, path)
    return path


def check_output_dir(path: str | Path, option: str) -> Path:
    """Check that ``path`` is a folder or can become one, and can be written in.

    Raises:
        UserError: ``path`` is an existing file, or the folder cannot be created or written.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{option} {path}: is an existing file, not a folder")
    probe_in = path if path.is_dir() else next(
        (p for p in path.parents if p.exists()), Path("."))
    if not probe_in.is_dir():
        raise UserError(f"{option} {path}: {probe_in} is a file, not a folder")
    _probe_write(probe_in, option, path)
    return path


def _probe_write(folder: Path, option: str, path: Path) -> None:
    """Create and remove an empty file in ``folder``.

    Raises:
        UserError: ``folder`` cannot be written in (naming ``option`` and ``path``).
    """
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".aiayn-probe-")
    except OSError as err:
        raise UserError(f"{option} {path}: cannot write in {folder} ({err.strerror})") \
            from None
    os.close(fd)
    os.unlink(tmp)
