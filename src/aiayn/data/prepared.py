"""A prepared corpus: the training pairs binarized once (``aiayn prepare``), memory-mapped by
every process that trains on them.

Aligned text files are read in bounded chunks of pairs; each chunk is stripped, cleared of pairs
with an empty side, preprocessed (``data.preprocess``), encoded with the vocabulary (the
encoder's own threads) and filtered, and its token ids are appended to flat arrays. Memory is
bounded by the chunk, not by the corpus. The folder holds, per side (``src``, ``tgt``):

    SIDE.ids.bin       the kept sentences' token ids, end to end, without EOS
                       (``uint16`` when the vocabulary fits, else ``uint32``)
    SIDE.offsets.bin   int64, n + 1: sentence k is ``ids[offsets[k]:offsets[k+1]]``
    SIDE.lengths.bin   ``uint16`` (``uint32`` for ``max_len`` >= 65535), n: tokens per sentence

and ``index.bin`` (uint32, n: each kept pair's position among the non-empty pairs of the
files, :attr:`EncodedCorpus.index`'s meaning), ``tokenizer.json`` (the vocabulary) and
``manifest.json``: the inputs' bytes and sha256, the vocabulary's fingerprint, the settings,
what each filter dropped, the arrays' sizes and a :attr:`Manifest.fingerprint` of it all. The
layout follows fairseq's ``MMapIndexedDataset`` (a data file and an index), in plain numpy.

The folder is built under a temporary name beside its final one (``.NAME.partial-*``); the
manifest is written last and the folder renamed into place, so an interrupted or failed prepare
(a kill, a full disk) never leaves a folder that :meth:`PreparedCorpus.open` takes as complete.
Every prepare holds :func:`output_lock` (an ``flock`` on the output's parent folder, so no lock
file is left beside the output) from its first check to the rename, and sweeps the temporary
folders a killed prepare left under that name. The manifest records the machine's byte order;
a folder is refused where the order differs.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aiayn.config import DataConfig
from aiayn.data.corpus import decode_line
from aiayn.data.vocab import EOS_ID, PAD_ID
from aiayn.errors import DataError, UserError
from aiayn.fileio import fsync_dir, write_json_atomic
from aiayn.rundir import RunDir

FORMAT = "aiayn-prepared"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
VOCAB_FILE = "tokenizer.json"
SIDES = ("src", "tgt")
CHUNK_PAIRS = 50_000  # pairs encoded at once: bounds the memory of a prepare


def array_files(side: str) -> tuple[str, str, str]:
    """The (ids, offsets, lengths) file names of ``side``."""
    return f"{side}.ids.bin", f"{side}.offsets.bin", f"{side}.lengths.bin"


INDEX_FILE = "index.bin"


# --- the manifest -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """What shapes a prepared corpus besides its inputs and vocabulary.

    Attributes:
        src_lang, tgt_lang: the languages (``data.preprocess`` tokenizes by language).
        preprocess: ``data.preprocess`` (``none`` or ``lc-norm-tok``).
        max_len: pairs whose source + EOS or target + EOS exceed this many tokens are dropped.
        max_ratio: > 0: pairs whose longer side has more than this times the shorter side's
            tokens are dropped (fairseq's WMT14 recipe: 1.5); 0: no ratio filter.
        limit: > 0: only the first ``limit`` non-empty pairs (``data.train_limit``).
    """

    src_lang: str = DataConfig.src_lang
    tgt_lang: str = DataConfig.tgt_lang
    preprocess: str = DataConfig.preprocess
    max_len: int = DataConfig.max_len
    max_ratio: float = 0.0
    limit: int = 0

    def __post_init__(self) -> None:
        if self.max_len < 2:
            raise ValueError(f"max_len must be at least 2 (a token and EOS), got {self.max_len}")
        if self.max_ratio < 0 or self.limit < 0:
            raise ValueError(f"max_ratio ({self.max_ratio}) and limit ({self.limit}) must be "
                             ">= 0")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _identity(m: dict[str, Any]) -> dict[str, Any]:
    """The part of a manifest that decides its content: inputs by bytes and sha256 (not path
    or time), the vocabulary's fingerprint, the settings."""
    return {"inputs": {s: {k: m["inputs"][s][k] for k in ("bytes", "sha256")} for s in SIDES},
            "vocabulary": m["vocabulary"]["fingerprint"], "settings": m["settings"],
            "format_version": m["format_version"]}


def fingerprint_of(manifest: dict[str, Any]) -> str:
    """sha256 of a manifest's identity (see :func:`_identity`)."""
    text = json.dumps(_identity(manifest), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two manifests' identities, one phrase each (empty: the same data).

    E.g. ``["the source file (train.en) changed: sha256 3a1f… -> 9c0d…", "max_len 100 -> 128"]``.
    """
    out = []
    for side, what in zip(SIDES, ("source", "target"), strict=True):
        a, b = old["inputs"][side], new["inputs"][side]
        if (a["bytes"], a["sha256"]) != (b["bytes"], b["sha256"]):
            out.append(f"the {what} file ({Path(b.get('path', '?')).name}) changed: "
                       f"{a['bytes']} bytes sha256 {a['sha256'][:12]} -> {b['bytes']} bytes "
                       f"sha256 {b['sha256'][:12]}")
    if old["vocabulary"]["fingerprint"] != new["vocabulary"]["fingerprint"]:
        out.append(f"the vocabulary changed: fingerprint {old['vocabulary']['fingerprint'][:12]}"
                   f" -> {new['vocabulary']['fingerprint'][:12]}")
    for key in sorted(set(old["settings"]) | set(new["settings"])):
        a, b = old["settings"].get(key), new["settings"].get(key)
        if a != b:
            out.append(f"{key} {a!r} -> {b!r}")
    if old.get("format_version") != new.get("format_version"):
        out.append(f"format version {old.get('format_version')} -> {new.get('format_version')}")
    return out


# --- reading the inputs -----------------------------------------------------------------------
class _HashingReader(io.RawIOBase):
    """A raw file whose bytes feed a sha256 as they are read (one pass for hash and text)."""

    def __init__(self, path: Path) -> None:
        self._f = open(path, "rb")  # noqa: SIM115 (closed by close())
        self.digest = hashlib.sha256()
        self.nbytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        if n:
            self.digest.update(memoryview(buffer)[:n])
            self.nbytes += n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def _open_text(raw: _HashingReader, path: Path) -> Any:
    buffered = io.BufferedReader(raw, 1 << 20)
    return gzip.GzipFile(fileobj=buffered) if path.suffix == ".gz" else buffered


@dataclass
class _Chunk:
    src: list[str]
    tgt: list[str]
    first: int  # position of the chunk's first pair among the non-empty pairs


class _PairReader:
    """Aligned, stripped, non-empty pairs of two files, a chunk at a time; hashes the files,
    counts lines and empty pairs, and checks alignment at the end."""

    def __init__(self, src: Path, tgt: Path, limit: int) -> None:
        self.paths = (src, tgt)
        for p in self.paths:
            if p.is_dir():
                raise DataError(f"{p}: is a directory, not a text file")
            if not p.is_file():
                raise FileNotFoundError(f"file not found: {p}")
        self.raws = [_HashingReader(p) for p in self.paths]
        self.files = [_open_text(r, p) for r, p in zip(self.raws, self.paths, strict=True)]
        self.limit = limit
        self.lines = 0  # line pairs read
        self.empty = 0  # pairs with an empty side
        self.pairs = 0  # non-empty pairs handed out
        self.beyond_limit = 0  # non-empty pairs after the first `limit`

    def next_chunk(self, size: int) -> _Chunk | None:
        src: list[str] = []
        tgt: list[str] = []
        first = self.pairs
        a, b = self.files
        try:
            while len(src) < size:
                la, lb = a.readline(), b.readline()
                if not la or not lb:
                    if la or lb:
                        self._misaligned(bool(la))
                    break
                self.lines += 1
                s = decode_line(la, self.paths[0], self.lines).strip()
                t = decode_line(lb, self.paths[1], self.lines).strip()
                if not s or not t:
                    self.empty += 1
                    continue
                if self.limit and self.pairs >= self.limit:
                    self.beyond_limit += 1
                    continue
                self.pairs += 1
                src.append(s)
                tgt.append(t)
        except (OSError, EOFError) as err:
            hint = " (is it a complete gzip file?)" if any(
                p.suffix == ".gz" for p in self.paths) else ""
            raise DataError(f"{self.paths[0]} / {self.paths[1]}: read failed after line "
                            f"{self.lines} ({err}){hint}") from None
        return _Chunk(src, tgt, first) if src else None

    def _misaligned(self, src_longer: bool) -> None:
        longer, shorter = (0, 1) if src_longer else (1, 0)
        extra = sum(1 for _ in self.files[longer]) + 1
        raise DataError(f"{self.paths[shorter]} has {self.lines} lines but "
                        f"{self.paths[longer]} has {self.lines + extra}: source and target "
                        "files must be line-aligned")

    def drain(self) -> None:
        """Read what is left (for the hashes; only pairs beyond ``limit`` can remain)."""
        while self.next_chunk(1 << 16) is not None:
            pass

    def close(self) -> None:
        for f in self.files:
            f.close()


def _encode(vocab: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of ``texts`` without BOS/EOS; HF tokenizers' batch encoder without the char
    offsets when it has one (same ids, less work)."""
    tok = getattr(vocab, "tokenizer", None)
    fast = getattr(tok, "encode_batch_fast", None)
    if fast is not None and type(vocab).encode_batch.__qualname__ == "Vocabulary.encode_batch":
        return [e.ids for e in fast(texts, add_special_tokens=False)]
    return vocab.encode_batch(texts)


def ids_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def lengths_dtype(max_len: int) -> np.dtype:
    return np.dtype(np.uint16) if max_len < (1 << 16) else np.dtype(np.uint32)


def _write(f: Any, array: np.ndarray) -> None:
    """Append ``array``'s bytes to ``f`` (one place, so a test can make the disk fill)."""
    f.write(memoryview(np.ascontiguousarray(array)).cast("B"))


# --- preparing --------------------------------------------------------------------------------
def _stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a prepared folder.

    Raises:
        DataError: no manifest (not a prepared corpus, or a prepare that did not finish), or
            one that is not this format; the message names the folder.
    """
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise DataError(f"{directory}: no such prepared corpus (not a folder)")
    if not path.is_file():
        raise DataError(f"{directory}: not a prepared corpus (no {MANIFEST_FILE}; a prepare "
                        "that did not finish leaves none): run `aiayn prepare` again")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a valid manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not an aiayn prepared corpus (format "
                        f"{manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                        f"expected {FORMAT!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: prepared with format version "
                        f"{manifest.get('format_version')}, this aiayn reads {FORMAT_VERSION}: "
                        "run `aiayn prepare` again")
    # folders from before the order was recorded were all written on little-endian machines
    order = manifest.get("byteorder", "little")
    if order != sys.byteorder:
        raise DataError(f"{path}: the arrays are {order}-endian, this machine is "
                        f"{sys.byteorder}-endian: run `aiayn prepare` again on this machine")
    return manifest


def _inputs_unchanged(manifest: dict[str, Any], paths: tuple[Path, Path]) -> bool:
    """Whether the files still hold the bytes the manifest names: their size and mtime, or
    when only the mtime moved, their sha256."""
    for side, path in zip(SIDES, paths, strict=True):
        rec = manifest["inputs"][side]
        now = _stat(path)
        if now["bytes"] != rec["bytes"]:
            return False
        if now["mtime_ns"] != rec.get("mtime_ns"):
            from aiayn.data.corpus import sha256_file

            if sha256_file(path) != rec["sha256"]:
                return False
    return True


@contextlib.contextmanager
def output_lock(out_dir: str | Path) -> Iterator[None]:
    """The one lock of a prepared folder, taken by :func:`prepare` (the CLI's and the training
    cache's): an exclusive ``flock`` on ``out_dir``'s parent folder, held from the first look
    at ``out_dir`` to its rename into place.

    On the parent, not on a file: a lock file would be left beside the output (and cannot be
    removed safely while another process waits on it), and ``out_dir`` itself is replaced by a
    rename. The kernel drops the lock when its process dies, SIGKILL included, so nothing stale
    is ever left. The price: prepares into different folders of one parent run one after
    another. Where the file system refuses a lock on a folder (some network file systems), a
    ``.NAME.lock`` file beside the output is locked instead and removed on release. Not
    reentrant: a process must not take it twice.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    parent = Path(out_dir).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        fd = -1
    if fd < 0:
        with _lock_file(parent / f".{Path(out_dir).name}.lock"):
            yield
        return
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _lock_file(path: Path) -> Iterator[None]:
    """``flock`` on ``path``, removed on release; a file removed while this process waited for
    it is opened again (its lock would exclude nobody)."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


def sweep(out_dir: Path) -> list[str]:
    """Remove what killed prepares left beside ``out_dir`` (``.NAME.partial-*``, ``.NAME.old-*``);
    only under :func:`output_lock`, where no live prepare is writing them. Their names."""
    swept = []
    if out_dir.parent.is_dir():
        for p in out_dir.parent.iterdir():
            if p.name.startswith((f".{out_dir.name}.partial-", f".{out_dir.name}.old-")):
                shutil.rmtree(p, ignore_errors=True)
                swept.append(p.name)
    return swept


def no_pair_kept(src: Path, tgt: Path, counts: dict[str, Any], max_len: int,
                 option: str) -> UserError:
    """The error of a prepare that keeps no pair, naming the files and the setting to change
    (``option``: ``--max-len`` for the CLI, ``data.max_len`` for training)."""
    pairs = counts["lines"] - counts["empty"]
    where = f"{src} and {tgt}"
    if pairs == 0:
        return UserError(f"{where}: no training pairs (every line pair is empty: "
                         f"{counts['empty']} dropped)")
    ratio = (f" ({counts['over_ratio']} over the length ratio)" if counts["over_ratio"]
             else "")
    sep = " " if option.startswith("--") else "="
    return UserError(f"{where}: none of the {pairs} training pairs fits {option}{sep}{max_len} "
                     f"tokens (source or target + EOS){ratio}; raise {option}")


def prepare(src: str | Path, tgt: str | Path, vocab: Any, out_dir: str | Path,
            settings: Settings = Settings(), *, chunk_pairs: int = CHUNK_PAIRS,
            log: Callable[[str], None] | None = None,
            max_len_option: str = "--max-len") -> PreparedCorpus:
    """Binarize the aligned files ``src``, ``tgt`` into ``out_dir`` (see the module doc), or
    reuse ``out_dir`` when it already holds them: same inputs, vocabulary and settings (a
    cache hit costs a stat of each input; a sha256 when only a file's time changed). Holds
    :func:`output_lock` throughout: two prepares of one ``out_dir`` run one after the other
    (the second reuses the first's folder).

    Args:
        src, tgt: line-aligned UTF-8 text files, plain or ``.gz``.
        vocab: the :class:`~aiayn.data.vocab.Vocabulary` the ids are of.
        out_dir: the folder to write (replaced when it holds another prepared corpus).
        settings: languages, preprocessing, filters (:class:`Settings`).
        chunk_pairs: pairs read and encoded at once (memory scales with it).
        log: called with a line of progress and the final counts.
        max_len_option: the setting named when no pair fits (``data.max_len`` in training).

    Returns:
        The prepared corpus, opened.

    Raises:
        FileNotFoundError: an input does not exist.
        DataError: misaligned inputs, invalid UTF-8 (file and line named), a broken gzip.
        UserError: ``out_dir`` exists and is neither a prepared corpus nor an empty folder;
            no pair kept (every pair empty or over ``max_len``): nothing is written.
        OSError: a write failed (a full disk): nothing is left under ``out_dir``'s name but
            what was there before.
    """
    out_dir = Path(out_dir)
    with output_lock(out_dir):
        return _prepare_locked(Path(src), Path(tgt), vocab, out_dir, settings, chunk_pairs,
                               log or (lambda _msg: None), max_len_option)


def _prepare_locked(src: Path, tgt: Path, vocab: Any, out_dir: Path, settings: Settings,
                    chunk_pairs: int, log: Callable[[str], None],
                    max_len_option: str) -> PreparedCorpus:
    """:func:`prepare`, under :func:`output_lock`."""
    for p in (src, tgt):
        if not p.is_file():
            raise FileNotFoundError(f"file not found: {p}")
    swept = sweep(out_dir)
    if swept:
        log(f"aiayn prepare: removed {len(swept)} unfinished folder(s) of an interrupted "
            f"prepare beside {out_dir}: {', '.join(sorted(swept))}")
    fingerprint = vocab.fingerprint
    if (out_dir / MANIFEST_FILE).is_file():
        with contextlib.suppress(DataError, KeyError, TypeError):
            old = read_manifest(out_dir)
            same = (old["settings"] == settings.to_dict()
                    and old["vocabulary"]["fingerprint"] == fingerprint
                    and _inputs_unchanged(old, (src, tgt)))
            if same:
                corpus = PreparedCorpus.open(out_dir)
                log(f"aiayn prepare: {out_dir} already holds {src.name} / {tgt.name} with this "
                    f"vocabulary and settings (fingerprint {corpus.fingerprint[:12]}): reused")
                return corpus
    elif out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir}: exists and is not a prepared corpus; not overwriting it "
                        "(give an empty or new folder)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # as mkdir would make it (mkdtemp's 0700 hides it from others)
    try:
        manifest = _build(src, tgt, vocab, tmp, settings, chunk_pairs, log)
        if manifest["counts"]["kept"] == 0:
            raise no_pair_kept(src, tgt, manifest["counts"], settings.max_len, max_len_option)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counts = manifest["counts"]
    log(f"aiayn prepare: {out_dir}: {counts['kept']} of {counts['lines']} pairs kept "
        f"({counts['empty']} with an empty side, {counts['over_max_len']} over max_len "
        f"{settings.max_len}, {counts['over_ratio']} over the length ratio"
        + (f", {counts['beyond_limit']} beyond the limit {settings.limit}" if settings.limit
           else "") + f"); {counts['src_tokens'] + counts['tgt_tokens']:,} tokens, "
        f"{manifest['seconds']:.1f} s")
    return PreparedCorpus.open(out_dir)


def _build(src: Path, tgt: Path, vocab: Any, tmp: Path, settings: Settings, chunk_pairs: int,
           log: Callable[[str], None]) -> dict[str, Any]:
    """Write the arrays and the manifest into ``tmp``; returns the manifest."""
    t0 = time.perf_counter()
    id_dt, len_dt = ids_dtype(len(vocab)), lengths_dtype(settings.max_len)
    reader = _PairReader(src, tgt, settings.limit)
    names = {side: array_files(side) for side in SIDES}
    files = {name: open(tmp / name, "wb") for side in SIDES for name in names[side]}  # noqa: SIM115
    files[INDEX_FILE] = open(tmp / INDEX_FILE, "wb")  # noqa: SIM115
    langs = {"src": settings.src_lang, "tgt": settings.tgt_lang}
    total = {"src": 0, "tgt": 0}
    kept = over_len = over_ratio = 0
    last_log = t0
    try:
        for side in SIDES:
            _write(files[names[side][1]], np.zeros(1, np.int64))

        def read_next() -> tuple[_Chunk | None, dict[str, list[str]]]:
            chunk = reader.next_chunk(chunk_pairs)
            if chunk is None:
                return None, {}
            texts = {"src": chunk.src, "tgt": chunk.tgt}
            if settings.preprocess != "none":
                from aiayn.data.text import preprocess_lines

                texts = {s: preprocess_lines(texts[s], langs[s], settings.preprocess)
                         for s in SIDES}
            return chunk, texts

        # the next chunk is read (and preprocessed) while the encoder's threads work on this one
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(read_next)
            while True:
                chunk, texts = pending.result()
                if chunk is None:
                    break
                pending = pool.submit(read_next)
                ids = {s: _encode(vocab, texts[s]) for s in SIDES}
                lens = {s: np.fromiter(map(len, ids[s]), np.int64, len(ids[s])) for s in SIDES}
                ok = (lens["src"] + 1 <= settings.max_len) & (lens["tgt"] + 1 <= settings.max_len)
                over_len += int((~ok).sum())
                if settings.max_ratio > 0:
                    lo = np.minimum(lens["src"], lens["tgt"])
                    hi = np.maximum(lens["src"], lens["tgt"])
                    within = hi <= settings.max_ratio * np.maximum(lo, 1)
                    over_ratio += int((ok & ~within).sum())
                    ok &= within
                keep = np.flatnonzero(ok)
                for s in SIDES:
                    k_lens = lens[s][keep]
                    n_tok = int(k_lens.sum())
                    flat = np.fromiter(itertools.chain.from_iterable(
                        itertools.compress(ids[s], ok)), id_dt, n_tok)
                    ids_f, off_f, len_f = names[s]
                    _write(files[ids_f], flat)
                    _write(files[off_f], total[s] + np.cumsum(k_lens))
                    _write(files[len_f], k_lens.astype(len_dt))
                    total[s] += n_tok
                position = chunk.first + keep
                if len(position) and position[-1] >= 1 << 32:
                    raise DataError(f"{src}: more than 2**32 pairs; split the corpus")
                _write(files[INDEX_FILE], position.astype(np.uint32))
                kept += len(keep)
                if time.perf_counter() - last_log > 30:
                    last_log = time.perf_counter()
                    log(f"aiayn prepare: {reader.lines:,} lines read, {kept:,} pairs kept, "
                        f"{time.perf_counter() - t0:.0f} s")
        reader.drain()
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
        reader.close()
    inputs = {}
    for side, path, raw in zip(SIDES, (src, tgt), reader.raws, strict=True):
        inputs[side] = {**_stat(path), "sha256": raw.digest.hexdigest()}
        if raw.nbytes != inputs[side]["bytes"]:
            raise DataError(f"{path}: changed while it was read ({raw.nbytes} bytes read, "
                            f"{inputs[side]['bytes']} now)")
    vocab.save(tmp)
    manifest: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "inputs": inputs,
        "vocabulary": {"fingerprint": vocab.fingerprint, "size": len(vocab)},
        "settings": settings.to_dict(),
        "counts": {"lines": reader.lines, "empty": reader.empty, "over_max_len": over_len,
                   "over_ratio": over_ratio, "beyond_limit": reader.beyond_limit,
                   "kept": kept, "src_tokens": total["src"], "tgt_tokens": total["tgt"]},
        "dtypes": {"ids": id_dt.name, "lengths": len_dt.name, "offsets": "int64",
                   "index": "uint32"},
        "byteorder": sys.byteorder,  # the arrays' (the machine's): checked by read_manifest
        "seconds": round(time.perf_counter() - t0, 3),
    }
    manifest["fingerprint"] = fingerprint_of(manifest)
    write_json_atomic(tmp / MANIFEST_FILE, manifest)  # last: the folder is complete
    return manifest


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` to ``out_dir``, replacing a prepared corpus there."""
    old = None
    if out_dir.exists():
        if any(out_dir.iterdir()):
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        else:
            out_dir.rmdir()
    os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- reading ----------------------------------------------------------------------------------
class PreparedCorpus:
    """A prepared folder, memory-mapped: the interface of
    :class:`~aiayn.data.batching.EncodedCorpus` (lengths for batching, :meth:`collate_rows`
    for batches) without holding the token ids in memory.

    Use :meth:`open`. The arrays are read-only maps of the files: every process on a machine
    shares one copy in the page cache.

    Attributes:
        directory: the folder.
        manifest: its manifest (see the module doc).
        index: (n,) uint32 each kept pair's position among the non-empty pairs of the inputs.
    """

    def __init__(self, directory: Path, manifest: dict[str, Any],
                 arrays: dict[str, np.ndarray]) -> None:
        self.directory, self.manifest, self._a = directory, manifest, arrays
        self.index = arrays["index"]
        counts = manifest["counts"]
        self.filtered = counts["over_max_len"] + counts["over_ratio"]
        self.dropped_empty = counts["empty"]
        self.name = f"{Path(manifest['inputs']['src']['path']).name} | " \
                    f"{Path(manifest['inputs']['tgt']['path']).name} (prepared)"

    @classmethod
    def open(cls, directory: str | Path) -> PreparedCorpus:
        """Map a prepared folder.

        Raises:
            DataError: not a prepared corpus, an unfinished one, a foreign manifest, or a file
                missing or of another size than the manifest says (truncated); the message
                names the folder or file.
        """
        directory = Path(os.path.abspath(directory))
        manifest = read_manifest(directory)
        try:
            counts, dtypes = manifest["counts"], manifest["dtypes"]
            n = int(counts["kept"])
            shapes = {INDEX_FILE: (dtypes["index"], n)}
            for side in SIDES:
                ids_f, off_f, len_f = array_files(side)
                shapes[ids_f] = (dtypes["ids"], int(counts[f"{side}_tokens"]))
                shapes[off_f] = (dtypes["offsets"], n + 1)
                shapes[len_f] = (dtypes["lengths"], n)
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(f"{directory / MANIFEST_FILE}: incomplete manifest (missing "
                            f"{err})") from None
        arrays: dict[str, np.ndarray] = {}
        for name, (dtype, count) in shapes.items():
            path = directory / name
            dt = np.dtype(dtype)
            expected = dt.itemsize * count
            if not path.is_file():
                raise DataError(f"{path}: missing from the prepared corpus: run `aiayn "
                                "prepare` again")
            size = path.stat().st_size
            if size != expected:
                raise DataError(f"{path}: {size} bytes, but the manifest says {count} "
                                f"{dt.name} values ({expected} bytes): the prepared corpus is "
                                "truncated or damaged; run `aiayn prepare` again")
            arrays[name] = (np.memmap(path, dtype=dt, mode="r", shape=(count,)) if count
                            else np.zeros(0, dt))
        out = {"index": arrays[INDEX_FILE]}
        for side in SIDES:
            ids_f, off_f, len_f = array_files(side)
            out[f"{side}_ids"], out[f"{side}_offsets"] = arrays[ids_f], arrays[off_f]
            out[f"{side}_lengths"] = arrays[len_f]
        return cls(directory, manifest, out)

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]

    def check_vocabulary(self, vocab: Any, where: str = "the vocabulary") -> None:
        """Raise unless ``vocab`` is the one the ids were made with.

        Raises:
            DataError: naming both fingerprints and sizes.
        """
        rec = self.manifest["vocabulary"]
        if vocab.fingerprint != rec["fingerprint"]:
            raise DataError(f"{where} (fingerprint {vocab.fingerprint[:12]}, {len(vocab)} "
                            f"tokens) is not the one {self.directory} was prepared with "
                            f"({rec['fingerprint'][:12]}, {rec['size']} tokens): use "
                            f"{self.directory / VOCAB_FILE}, or prepare again with this one")

    def load_vocabulary(self) -> Any:
        """The vocabulary the folder was prepared with (its ``tokenizer.json``)."""
        from aiayn.data.vocab import Vocabulary

        vocab = Vocabulary.load(self.directory / VOCAB_FILE)
        self.check_vocabulary(vocab, str(self.directory / VOCAB_FILE))
        return vocab

    def __len__(self) -> int:
        return len(self.index)

    def src_lengths(self) -> np.ndarray:
        """(n,) int64 encoder lengths: source tokens + EOS."""
        return self._a["src_lengths"].astype(np.int64) + 1

    def tgt_lengths(self) -> np.ndarray:
        """(n,) int64 decoder lengths: target tokens + 1."""
        return self._a["tgt_lengths"].astype(np.int64) + 1

    def target_token_ids(self) -> np.ndarray:
        """(k,) int64 sorted ids the targets hold, EOS included (read in slices: bounded
        memory)."""
        ids = self._a["tgt_ids"]
        seen = np.zeros(self.manifest["vocabulary"]["size"], dtype=bool)
        step = 1 << 24
        for start in range(0, len(ids), step):
            seen[np.unique(ids[start:start + step])] = True
        seen[EOS_ID] = True
        return np.flatnonzero(seen).astype(np.int64)

    def describe(self) -> str:
        c = self.manifest["counts"]
        return (f"{self.name}: {len(self)} of {c['lines']} pairs kept ({c['empty']} with an "
                f"empty side, {c['over_max_len']} over max_len "
                f"{self.manifest['settings']['max_len']}, {c['over_ratio']} over the length "
                "ratio dropped)")

    def _rows(self, side: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                          np.ndarray]:
        """(lengths, row, col, values) of the sentences ``rows`` of ``side``: one gather of
        their contiguous id slices from the map."""
        lens = self._a[f"{side}_lengths"][rows].astype(np.int64)
        starts = self._a[f"{side}_offsets"][rows]
        total = int(lens.sum())
        row = np.repeat(np.arange(len(rows)), lens)
        col = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        values = self._a[f"{side}_ids"][np.repeat(starts, lens) + col]
        return lens, row, col, values

    def collate_rows(self, indices: Any, start_id: int) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray, list[int]]:
        """(src, tgt_in, tgt_out, corpus indices) of the pairs ``indices``, padded int64
        arrays as :func:`~aiayn.data.batching.collate` makes them."""
        rows = np.asarray(indices, dtype=np.int64)
        B = len(rows)
        lens, r, c, v = self._rows("src", rows)
        src = np.full((B, int(lens.max()) + 1), PAD_ID, dtype=np.int64)
        src[r, c] = v
        src[np.arange(B), lens] = EOS_ID
        lens, r, c, v = self._rows("tgt", rows)
        T = int(lens.max()) + 1
        tgt_in = np.full((B, T), PAD_ID, dtype=np.int64)
        tgt_out = np.full((B, T), PAD_ID, dtype=np.int64)
        tgt_in[:, 0] = start_id
        tgt_in[r, c + 1] = v
        tgt_out[r, c] = v
        tgt_out[np.arange(B), lens] = EOS_ID
        return src, tgt_in, tgt_out, self.index[rows].tolist()

    def pair(self, i: int) -> tuple[list[int], list[int]]:
        """The source (ending in EOS) and target ids of pair ``i``, as EncodedCorpus holds
        them (for tests and inspection)."""
        out = []
        for side in SIDES:
            o = self._a[f"{side}_offsets"]
            out.append(self._a[f"{side}_ids"][o[i]:o[i + 1]].astype(np.int64).tolist())
        return out[0] + [EOS_ID], out[1]



# --- training runs ----------------------------------------------------------------------------
CACHE_SUBDIR = "prepared"


FULL_HASH_ENV = "AIAYN_CACHE_FULL_HASH"  # 1: key cache entries on the inputs' whole sha256
CACHE_LIMIT_ENV = "AIAYN_CACHE_MAX_GB"  # the cache's size limit; 0: none
CACHE_LIMIT_GB = 50.0
ENDS_BYTES = 1 << 20  # the key hashes a file's first and last MiB


def content_key(path: Path, full: bool = False) -> str:
    """A key of ``path``'s bytes, not of its name or time: its size and the sha256 of its first
    and last MiB (of all of it when ``full`` or when it is no longer than 2 MiB). A ``touch``
    or a copy elsewhere keeps the key; an edit of the middle that keeps the size does not change
    it, but :func:`prepare` then finds the file's sha256 changed and prepares anew."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if full or size <= 2 * ENDS_BYTES:
            while block := f.read(1 << 22):
                digest.update(block)
        else:
            digest.update(f.read(ENDS_BYTES))
            f.seek(size - ENDS_BYTES)
            digest.update(f.read(ENDS_BYTES))
    return f"{size}:{'all' if full or size <= 2 * ENDS_BYTES else 'ends'}:{digest.hexdigest()}"


def cache_folder(src: Path, tgt: Path, vocab: Any, settings: Settings,
                 full_hash: bool | None = None) -> Path:
    """Where training prepares raw files: ``$AIAYN_CACHE_DIR/prepared/KEY``, KEY a hash of the
    files' :func:`content_key` (with ``full_hash``, default ``$AIAYN_CACHE_FULL_HASH=1``, of
    their whole bytes), the vocabulary and the settings: a run, its resume, the members of an
    ensemble and every rank find one folder, and a ``touch`` of an input does not move it."""
    from aiayn.data.corpus import cache_dir

    if full_hash is None:
        full_hash = os.environ.get(FULL_HASH_ENV, "") not in ("", "0")
    key = json.dumps({"inputs": [content_key(src, full_hash), content_key(tgt, full_hash)],
                      "vocabulary": vocab.fingerprint, "settings": settings.to_dict(),
                      "format_version": FORMAT_VERSION}, sort_keys=True)
    return cache_dir() / CACHE_SUBDIR / hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]


def cache_limit_bytes() -> int:
    """``$AIAYN_CACHE_MAX_GB`` (default 50) in bytes; 0: no limit.

    Raises:
        UserError: not a number >= 0.
    """
    text = os.environ.get(CACHE_LIMIT_ENV, "")
    try:
        gb = float(text) if text else CACHE_LIMIT_GB
    except ValueError:
        gb = -1.0
    if not gb >= 0:
        raise UserError(f"{CACHE_LIMIT_ENV}={text!r}: not a size in GB (a number >= 0; 0: no "
                        "limit)")
    return int(gb * 1e9)


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def evict(keep: Path, limit: int) -> list[Path]:
    """Remove the cache entries beside ``keep`` least recently used first (a folder's time is
    set on each use) until the entries, ``keep`` included, hold at most ``limit`` bytes; and
    what killed prepares left there. Never ``keep``. Only under :func:`output_lock` of
    ``keep`` (the lock of every entry: they share the parent). A process that has an evicted
    entry mapped reads on (the files go when it unmaps them). The entries removed."""
    entries, total, gone = [], _folder_bytes(keep), []
    for p in keep.parent.iterdir():
        if p.name.startswith(".") and (".partial-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)  # no live prepare writes them: we hold the lock
        elif p != keep and p.is_dir() and not p.name.startswith("."):
            size = _folder_bytes(p)
            entries.append((p.stat().st_mtime_ns, p.name, p, size))
            total += size
    for _, _, p, size in sorted(entries):
        if not limit or total <= limit:
            break
        shutil.rmtree(p, ignore_errors=True)
        total -= size
        gone.append(p)
    return gone


def prepare_for_training(src: Path, tgt: Path, vocab: Any, settings: Settings, info: Any,
                         log: Callable[[str], None]) -> PreparedCorpus:
    """The raw training files prepared (or found prepared) in :func:`cache_folder`: the main
    process prepares, the others wait for it and map its folder. The cache is then trimmed to
    :func:`cache_limit_bytes`, least recently used entries first (:func:`evict`).

    Raises:
        see :func:`prepare` (no pair kept names ``data.max_len``); UserError: a bad
        ``$AIAYN_CACHE_MAX_GB``.
    """
    folder = cache_folder(src, tgt, vocab, settings)
    corpus = None
    if info.is_main:
        limit = cache_limit_bytes()
        # runs started side by side (Table 3's rows, an ensemble's members) share the entry:
        # one prepares it, the others wait on the lock and reuse it (never one replacing it
        # under another that is opening it)
        with output_lock(folder):
            corpus = _prepare_locked(src, tgt, vocab, folder, settings, CHUNK_PAIRS, log,
                                     "data.max_len")
            os.utime(folder)  # its last use, for evict
            for p in evict(folder, limit):
                log(f"aiayn train: removed the prepared cache entry {p} (least recently used; "
                    f"the cache holds at most {limit / 1e9:g} GB, ${CACHE_LIMIT_ENV})")
    if info.world_size > 1:
        import torch.distributed as dist

        dist.barrier()
    return corpus if corpus is not None else PreparedCorpus.open(folder)


def check_settings(corpus: PreparedCorpus, data: Any) -> None:
    """Refuse a prepared folder whose text or lengths are not what a DataConfig trains on.

    Raises:
        UserError: another ``preprocess`` or language (the model would learn other text than
            it is given when translating), or a ``max_len`` above ``data.max_len``; naming
            both values and the way out.
    """
    have = corpus.manifest["settings"]
    for key in ("preprocess", "src_lang", "tgt_lang"):
        if have[key] != getattr(data, key):
            raise UserError(f"{corpus.directory}: prepared with {key} = {have[key]!r}, but "
                            f"data.{key} = {getattr(data, key)!r}; prepare again with that "
                            f"setting, or set data.{key}={have[key]}")
    if have["max_len"] > data.max_len:
        raise UserError(f"{corpus.directory}: prepared with max_len {have['max_len']}, above "
                        f"data.max_len = {data.max_len}; prepare again with --max-len "
                        f"{data.max_len}, or set data.max_len={have['max_len']}")


def record_run_data(run_dir: str | Path, corpus: PreparedCorpus) -> None:
    """Write ``run_dir/data.json``: the fingerprint and identity of the data the run trains
    on (checked by :func:`check_run_data` on ``--resume``)."""
    m = corpus.manifest
    write_json_atomic(RunDir(run_dir).data_record, {
        "fingerprint": m["fingerprint"], "directory": str(corpus.directory),
        "inputs": m["inputs"], "vocabulary": m["vocabulary"], "settings": m["settings"],
        "format_version": m["format_version"], "counts": m["counts"]})


def check_run_data(run_dir: str | Path, corpus: PreparedCorpus) -> None:
    """Refuse to resume a run on other data than it started with.

    Raises:
        UserError: ``run_dir/data.json`` names another fingerprint; the message says what
            changed (an input's bytes, the vocabulary, a setting). A run without the file
            (started before fingerprints were recorded) passes.
    """
    path = RunDir(run_dir).data_record
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved["fingerprint"] == corpus.fingerprint:
            return
        changes = describe_changes(saved, corpus.manifest)
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path}: unreadable ({err}); it records the data the run trains on")
    raise UserError(f"--resume: the training data is not the data {run_dir} started with ("
                    + ("; ".join(changes) or f"fingerprint {saved['fingerprint'][:12]} -> "
                       f"{corpus.fingerprint[:12]}")
                    + "): resume with the same files, vocabulary and data settings, or train "
                    "in a new --run-dir")
