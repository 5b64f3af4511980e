"""Fetch WMT14 English-German as the paper trained on it (§5.1): the three training corpora of
the WMT14 translation task, joined, and the news test sets newstest2013 (dev) and newstest2014
(test, the full 3,003 segments).

What is fetched is one :class:`Manifest`: each archive with its address, size and sha256, and
each corpus with the paths of its two files inside an archive and its line count. The built-in
one, :data:`WMT14`, takes its sizes and sums from TensorFlow Datasets' ``url_checksums`` for its
WMT builders (``wmt14_translate.txt``, ``wmt_t2t_translate.txt``). A test passes its own.

Layout (``out``, e.g. ``wmt14/``)::

    downloads/NAME         the archives, each checked (size, sha256) before it gets its name;
                           an interrupted download stays in NAME.part and resumes (HTTP Range)
    train.en, train.de     the corpora joined in the manifest's order: line i of train.en
                           translates line i of train.de
    fetch.json             what was written: a re-run that finds it unchanged does nothing

and ``newstest2013.{en,de}``, ``newstest2014.{en,de}`` in ``test_dir`` (the recipe's
``$AIAYN_DATA_DIR/wmt14-en-de/``), whitespace as Moses ``input-from-sgm.perl`` leaves it (runs
of spaces and tabs made one space, both ends trimmed). Test files already there with the
expected line counts are kept.

Members are streamed out of the archives in one pass each, never unpacked by name: each is first
checked by :func:`tarfile.data_filter` (a path that stays inside the folder, not a link) and
must be a regular file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from aiayn.data.corpus import data_dir, sha256_file
from aiayn.errors import DataError
from aiayn.fileio import atomic_file, write_json_atomic

MIRROR_ENV = "AIAYN_WMT14_MIRROR"
LANGS = ("en", "de")
RECORD = "fetch.json"
CHUNK = 1 << 20

# Sizes and sha256: TensorFlow Datasets, tensorflow_datasets/url_checksums/wmt14_translate.txt
# (the training archives) and wmt_t2t_translate.txt (dev.tgz). Line counts: the de-en files as
# distributed (the test sets: 3,000 and the full 3,003 segments).
WMT14: dict[str, Any] = {
    "name": "wmt14",
    "source": "sizes and sha256 of TensorFlow Datasets' url_checksums (wmt14_translate.txt, "
              "wmt_t2t_translate.txt)",
    "langs": ["en", "de"],
    "archives": [
        {"name": "training-parallel-europarl-v7.tgz",
         "url": "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
         "bytes": 657632379,
         "sha256": "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"},
        {"name": "training-parallel-commoncrawl.tgz",
         "url": "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
         "bytes": 918311367,
         "sha256": "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"},
        {"name": "training-parallel-nc-v9.tgz",
         "url": "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
         "bytes": 80418416,
         "sha256": "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"},
        {"name": "dev.tgz",
         "url": "http://data.statmt.org/wmt19/translation-task/dev.tgz",
         "bytes": 38654961,
         "sha256": "7a7deccf82ebb05ba508dba5eb21356492224e8f630ec4f992132b029b4b25e7"},
    ],
    # joined in this order
    "train": [
        {"name": "Europarl v7", "archive": "training-parallel-europarl-v7.tgz",
         "files": {"en": "training/europarl-v7.de-en.en", "de": "training/europarl-v7.de-en.de"},
         "lines": 1920209},
        {"name": "Common Crawl", "archive": "training-parallel-commoncrawl.tgz",
         "files": {"en": "commoncrawl.de-en.en", "de": "commoncrawl.de-en.de"},
         "lines": 2399123},
        {"name": "News Commentary v9", "archive": "training-parallel-nc-v9.tgz",
         "files": {"en": "training/news-commentary-v9.de-en.en",
                   "de": "training/news-commentary-v9.de-en.de"},
         "lines": 201288},
    ],
    "test": [
        {"name": "newstest2013", "archive": "dev.tgz",
         "files": {"en": "dev/newstest2013.en", "de": "dev/newstest2013.de"},
         "lines": 3000},
        {"name": "newstest2014", "archive": "dev.tgz",
         "files": {"en": "dev/newstest2014-deen-src.en.sgm",
                   "de": "dev/newstest2014-deen-ref.de.sgm"},
         "lines": 3003},
    ],
}


@dataclass(frozen=True)
class Archive:
    """One archive: its file name, address, size in bytes and sha256 (hex)."""

    name: str
    url: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Corpus:
    """One parallel corpus: ``files[lang]`` is its path inside ``archive``; ``lines`` each."""

    name: str
    archive: str
    files: dict[str, str]
    lines: int


@dataclass(frozen=True)
class Manifest:
    """What :func:`fetch` downloads and writes (see :data:`WMT14` for the shape)."""

    name: str
    source: str
    langs: tuple[str, ...]
    archives: tuple[Archive, ...]
    train: tuple[Corpus, ...]
    test: tuple[Corpus, ...]

    def archive(self, name: str) -> Archive:
        return next(a for a in self.archives if a.name == name)

    def digest(self) -> str:
        """sha256 of the manifest as canonical JSON: a record from another one is stale."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_manifest(data: dict[str, Any] | str | Path | None = None) -> Manifest:
    """A :class:`Manifest` from a dict shaped like :data:`WMT14`, a JSON file of one, or (None)
    the built-in :data:`WMT14`.

    Raises:
        DataError: the file is not JSON, or a field is missing or of the wrong kind, or a
            corpus names an archive or language the manifest lacks (naming which).
    """
    where = "the built-in manifest"
    if data is None:
        data = WMT14
    elif not isinstance(data, dict):
        where = str(data)
        try:
            data = json.loads(Path(data).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"--manifest {where}: not a JSON file ({err})") from None
    try:
        langs = tuple(data["langs"])
        archives = tuple(Archive(a["name"], a["url"], int(a["bytes"]), str(a["sha256"]).lower())
                         for a in data["archives"])
        parts = {key: tuple(Corpus(c["name"], c["archive"], dict(c["files"]), int(c["lines"]))
                            for c in data[key]) for key in ("train", "test")}
        manifest = Manifest(str(data["name"]), str(data.get("source", where)), langs, archives,
                            parts["train"], parts["test"])
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(f"{where}: not a fetch manifest ({type(err).__name__}: {err}); see "
                        "aiayn.data.fetch.WMT14 for its shape") from None
    names = {a.name for a in manifest.archives}
    for corpus in manifest.train + manifest.test:
        if corpus.archive not in names:
            raise DataError(f"{where}: {corpus.name} is in archive {corpus.archive!r}, which the "
                            f"manifest does not list (it lists {', '.join(sorted(names))})")
        if sorted(corpus.files) != sorted(manifest.langs):
            raise DataError(f"{where}: {corpus.name} has files for {sorted(corpus.files)}, "
                            f"expected one for each of {list(manifest.langs)}")
    return manifest


# --- downloading -----------------------------------------------------------------------------
def archive_url(archive: Archive, mirror: str | None) -> str:
    """Where ``archive`` is fetched from: ``mirror`` + its name when a mirror is given (a folder
    URL: ``https://…/``, ``http://127.0.0.1:PORT/``, ``file:///…/``), else its own address."""
    if not mirror:
        return archive.url
    return mirror.rstrip("/") + "/" + urllib.parse.quote(archive.name)


def _progress(total: int, initial: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True,
                unit_divisor=1024, disable=not enabled, file=sys.stderr, leave=False)


def _hash_file(path: Path, digest: Any) -> None:
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)


def download(archive: Archive, folder: str | Path, *, mirror: str | None = None,
             progress: bool = False, timeout_s: float = 60.0) -> tuple[Path, str]:
    """Fetch ``archive`` into ``folder/archive.name`` unless a file with its size and sha256 is
    there already.

    The bytes go to ``NAME.part``; a ``.part`` left by an interrupted run is continued with an
    HTTP Range request (a server that ignores it sends the whole file, which is then written
    from the start). Only a file of the right size and sha256 is renamed to ``NAME``.

    Returns:
        (path, how): ``how`` is ``"kept"`` (already there and checked), ``"downloaded"`` or
        ``"resumed"``.

    Raises:
        DataError: the address cannot be read (what was kept to resume from is named), the
            transfer stopped short, or the bytes are more than the archive's or have another
            sha256 (the download is then removed: one line naming the address, both sums and
            the way on).
    """
    folder = Path(folder)
    target = folder / archive.name
    if target.is_file():
        if target.stat().st_size == archive.bytes and sha256_file(target) == archive.sha256:
            return target, "kept"
        target.unlink()  # renamed here only after its check: changed since; fetch it again
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / (archive.name + ".part")
    offset = part.stat().st_size if part.is_file() else 0
    if offset > archive.bytes:
        part.unlink()
        offset = 0
    url = archive_url(archive, mirror)
    digest = hashlib.sha256()
    how = "downloaded"
    if offset < archive.bytes:
        request = urllib.request.Request(url, headers={"User-Agent": "aiayn-fetch"})
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                if offset and getattr(response, "status", None) == 206:
                    how = "resumed"
                    _hash_file(part, digest)
                else:
                    offset = 0
                with open(part, "ab" if offset else "wb") as out, \
                        _progress(archive.bytes, offset, archive.name, progress) as bar:
                    written = offset
                    for chunk in iter(lambda: response.read(CHUNK), b""):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
                        written += len(chunk)
                        if written > archive.bytes:
                            break  # not this archive: refused below, without reading the rest
        except (urllib.error.URLError, OSError) as err:
            kept = part.stat().st_size if part.is_file() else 0
            raise DataError(
                f"cannot download {url} ({getattr(err, 'reason', err)}); {kept:,} of "
                f"{archive.bytes:,} bytes kept in {part}, run again to resume, or give "
                f"--mirror URL (or {MIRROR_ENV}) for a folder that holds {archive.name}") \
                from None
    else:
        _hash_file(part, digest)
    size = part.stat().st_size
    if size < archive.bytes:
        raise DataError(f"{url}: the transfer stopped at {size:,} of {archive.bytes:,} bytes "
                        f"(kept in {part}); run again to resume")
    if size > archive.bytes:
        part.unlink()
        raise DataError(f"{url}: more than the {archive.bytes:,} bytes expected; removed, not "
                        "used (is it another file? check --mirror)")
    if digest.hexdigest() != archive.sha256:
        part.unlink()
        raise DataError(f"{url}: sha256 {digest.hexdigest()}, expected {archive.sha256}; "
                        "removed, not used (run again to download it anew, or check --mirror)")
    os.replace(part, target)
    return target, how


# --- reading members out of an archive -------------------------------------------------------
def _member_name(name: str) -> str:
    return name.removeprefix("./")


def stream_members(path: Path, wanted: set[str],
                   take: Callable[[str, IO[bytes], int], None]) -> None:
    """Call ``take(name, file, size)`` for each member of the tar archive ``path`` (any
    compression) whose name is in ``wanted``, in one pass over the archive.

    Raises:
        DataError: a wanted member is missing, is not a regular file, or its path would land
            outside the folder it is unpacked into (:func:`tarfile.data_filter`: ``..``, a
            link); the archive is unreadable.
    """
    seen: set[str] = set()
    unreadable = (tarfile.TarError, EOFError, OSError, zlib.error)
    try:
        tar = tarfile.open(path, "r:*")
    except unreadable as err:
        raise DataError(f"{path}: cannot read the archive ({err})") from None
    with tar:
        members = iter(tar)
        while True:
            try:
                member = next(members)
            except StopIteration:
                break
            except unreadable as err:
                raise DataError(f"{path}: cannot read the archive ({err})") from None
            name = _member_name(member.name)
            if name not in wanted or name in seen:
                continue
            try:
                member = tarfile.data_filter(member, str(path.parent))
            except tarfile.FilterError as err:
                raise DataError(f"{path}: member {member.name!r} refused ({err})") from None
            if not member.isfile():
                raise DataError(f"{path}: member {member.name!r} is not a regular file")
            handle = tar.extractfile(member)
            assert handle is not None  # a regular file
            # errors reading the member name it; errors writing where it goes stay OSErrors
            take(name, _Member(handle, f"{path}: member {member.name!r}"), member.size)
            seen.add(name)
    missing = sorted(wanted - seen)
    if missing:
        raise DataError(f"{path}: no member {', '.join(missing)} (the manifest's path); list "
                        f"the archive with: tar -tzf {path}")


class _Member:
    """A member's reader whose read errors (a truncated or corrupt archive) are DataErrors
    naming the archive and member."""

    def __init__(self, handle: IO[bytes], where: str) -> None:
        self.handle, self.where = handle, where

    def read(self, n: int = -1) -> bytes:
        try:
            return self.handle.read(n)
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            raise DataError(f"{self.where}: cannot be read ({err})") from None


def _copy_counting(src: IO[bytes], out: IO[bytes]) -> tuple[int, int, bool]:
    """Copy ``src`` to ``out``: (bytes, newlines, whether the last byte was a newline)."""
    size = lines = 0
    last = b"\n"
    for chunk in iter(lambda: src.read(CHUNK), b""):
        out.write(chunk)
        size += len(chunk)
        lines += chunk.count(b"\n")
        last = chunk[-1:]
    return size, lines, last == b"\n"


_SPACES = re.compile(rb"[ \t\r\f\v]+")
_SEG = re.compile(rb"<seg[^>]*>(.*)</seg>")


def segments(data: bytes, sgm: bool) -> list[bytes]:
    """The segments of a test file: an SGML file's ``<seg>`` texts, or a text file's lines;
    each with runs of ASCII spaces and tabs made one space and both ends trimmed (as Moses
    ``input-from-sgm.perl``: a no-break space is kept)."""
    if sgm:
        rows = [m.group(1) for m in map(_SEG.search, data.split(b"\n")) if m]
    else:
        rows = data.split(b"\n")
        if rows and rows[-1] == b"":
            rows.pop()
    return [_SPACES.sub(b" ", row).strip(b" ") for row in rows]


# --- the whole fetch -------------------------------------------------------------------------
@dataclass
class FetchResult:
    """What :func:`fetch` did: ``fetched`` False when the record showed nothing to do."""

    out: str
    test_dir: str
    fetched: bool
    archives: list[dict[str, Any]] = field(default_factory=list)
    corpora: list[dict[str, Any]] = field(default_factory=list)
    train: dict[str, dict[str, Any]] = field(default_factory=dict)
    test: list[dict[str, Any]] = field(default_factory=list)
    manifest: str = ""


def default_test_dir(out: str | Path) -> Path:
    """``$AIAYN_DATA_DIR/wmt14-en-de``, where the recipe and ``data.dataset = wmt14-en-de``
    read newstest2013/2014; ``OUT/wmt14-en-de`` when ``AIAYN_DATA_DIR`` is unset."""
    root = data_dir()
    return (root if root is not None else Path(out)) / "wmt14-en-de"


def _file_entry(path: Path, lines: int) -> dict[str, Any]:
    return {"path": str(path), "lines": lines, "bytes": path.stat().st_size}


def _up_to_date(out: Path, manifest: Manifest, test_dir: Path) -> dict[str, Any] | None:
    """The record of an earlier fetch when it is of this manifest and test folder and every
    file it names still has its size, else None."""
    record_path = out / RECORD
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if record.get("manifest_sha256") != manifest.digest() or \
            record.get("test_dir") != str(test_dir):
        return None
    files = list(record.get("train", {}).values()) + record.get("test", [])
    for entry in files:
        path = Path(entry["path"])
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return None
    return record


def fetch(out: str | Path, *, manifest: Manifest | None = None,
          test_dir: str | Path | None = None, mirror: str | None = None,
          progress: bool = False, say: Callable[[str], None] = lambda _msg: None) -> FetchResult:
    """Download, check, unpack and join the manifest's corpora into ``out``; write its test
    sets into ``test_dir``.

    Args:
        out: the folder for ``downloads/``, ``train.{en,de}`` and ``fetch.json``.
        manifest: what to fetch (default :data:`WMT14`).
        test_dir: where the test sets go (default :func:`default_test_dir`).
        mirror: a folder URL holding the archives by name, instead of their own addresses
            (default ``$AIAYN_WMT14_MIRROR``).
        progress: tqdm bars on stderr for downloads and unpacking.
        say: called with one line for each thing done.

    Returns:
        a :class:`FetchResult`; its ``fetched`` is False when ``out/fetch.json`` records this
        manifest's files, all still there (nothing is read or written then).

    Raises:
        DataError: a download or archive that fails its checks, a member missing, line counts
            that differ between the languages or from the manifest, or a test file already in
            ``test_dir`` with another line count (each one line naming the file and numbers).
    """
    manifest = manifest or load_manifest()
    out = Path(out)
    test_dir = Path(test_dir) if test_dir is not None else default_test_dir(out)
    mirror = mirror or os.environ.get(MIRROR_ENV) or None
    record = _up_to_date(out, manifest, test_dir)
    if record is not None:
        return FetchResult(str(out), str(test_dir), False, record["archives"],
                           record["corpora"], record["train"], record["test"],
                           record["manifest"])
    out.mkdir(parents=True, exist_ok=True)
    test_dir.mkdir(parents=True, exist_ok=True)
    result = FetchResult(str(out), str(test_dir), True, manifest=manifest.source)
    paths: dict[str, Path] = {}
    for archive in manifest.archives:
        path, how = download(archive, out / "downloads", mirror=mirror, progress=progress)
        paths[archive.name] = path
        result.archives.append({"name": archive.name, "url": archive_url(archive, mirror),
                                "bytes": archive.bytes, "sha256": archive.sha256, "how": how})
        say(f"{archive.name}: {how}, {archive.bytes:,} bytes, size and sha256 checked")

    totals = {lang: 0 for lang in manifest.langs}
    with contextlib.ExitStack() as stack:
        joined = {lang: stack.enter_context(atomic_file(out / f"train.{lang}"))
                  for lang in manifest.langs}
        for corpus in manifest.train:
            counts = _join_corpus(paths[corpus.archive], corpus, joined, progress)
            _check_counts(corpus, paths[corpus.archive], counts)
            for lang in manifest.langs:
                totals[lang] += counts[lang]
            result.corpora.append({"name": corpus.name, "archive": corpus.archive,
                                   "files": corpus.files, "lines": corpus.lines})
            say(f"{corpus.name}: {corpus.lines:,} pairs ({', '.join(corpus.files.values())} "
                f"of {corpus.archive})")
    for lang in manifest.langs:
        result.train[lang] = _file_entry(out / f"train.{lang}", totals[lang])
    names = ", ".join(c.name for c in manifest.train)
    say(f"wrote {' and '.join(str(out / f'train.{lang}') for lang in manifest.langs)}: "
        f"{totals[manifest.langs[0]]:,} lines each ({names}, in that order)")

    for corpus in manifest.test:
        result.test.extend(_write_test(paths[corpus.archive], corpus, test_dir, say))
    write_json_atomic(out / RECORD, {"manifest_sha256": manifest.digest(),
                                     "test_dir": str(test_dir), **asdict(result)})
    return result


def _join_corpus(archive: Path, corpus: Corpus, joined: dict[str, IO[bytes]],
                 progress: bool) -> dict[str, int]:
    """Append ``corpus``'s file of each language to ``joined[lang]``: its line counts. A file
    without a final newline gets one, so the next corpus starts on a line of its own."""
    by_member = {member: lang for lang, member in corpus.files.items()}
    counts: dict[str, int] = {}

    def take(name: str, handle: IO[bytes], size: int) -> None:
        lang = by_member[name]
        with _progress(size, 0, f"{corpus.name} ({lang})", progress) as bar:
            wrapped = _Counted(handle, bar)
            _, lines, ends = _copy_counting(wrapped, joined[lang])
        if not ends and size:
            joined[lang].write(b"\n")
            lines += 1
        counts[lang] = lines

    stream_members(archive, set(by_member), take)
    return counts


class _Counted:
    """A reader that advances a progress bar by the bytes read."""

    def __init__(self, handle: IO[bytes], bar: Any) -> None:
        self.handle, self.bar = handle, bar

    def read(self, n: int) -> bytes:
        chunk = self.handle.read(n)
        self.bar.update(len(chunk))
        return chunk


def _check_counts(corpus: Corpus, archive: Path, counts: dict[str, int]) -> None:
    """Raise DataError when the languages' line counts differ or are not the manifest's."""
    found = ", ".join(f"{corpus.files[lang]} {n:,}" for lang, n in counts.items())
    if len(set(counts.values())) != 1 or next(iter(counts.values())) != corpus.lines:
        raise DataError(f"{archive}: {corpus.name} has lines {found}; the manifest expects "
                        f"{corpus.lines:,} in each")


def _write_test(archive: Path, corpus: Corpus, test_dir: Path,
                say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Write ``corpus`` (a test set) as ``test_dir/NAME.LANG``, one segment a line; a file
    already there with the expected line count is kept."""
    targets = {lang: test_dir / f"{corpus.name}.{lang}" for lang in corpus.files}
    kept: dict[str, int] = {}
    for lang, target in targets.items():
        if target.is_file():
            with open(target, "rb") as f:
                n = sum(1 for _ in f)
            if n != corpus.lines:
                raise DataError(f"{target}: already there with {n:,} lines, but {corpus.name} "
                                f"has {corpus.lines:,}; move it away and run again")
            kept[lang] = n
    rows: dict[str, list[bytes]] = {}

    def take(name: str, handle: IO[bytes], size: int) -> None:
        lang = next(lang for lang, member in corpus.files.items() if member == name)
        rows[lang] = segments(handle.read(), sgm=name.endswith(".sgm"))

    if len(kept) < len(targets):
        stream_members(archive, set(corpus.files.values()), take)
        _check_counts(corpus, archive, {lang: len(r) for lang, r in rows.items()})
    entries = []
    for lang, target in targets.items():
        if lang in kept:
            how = "kept"
        else:
            with atomic_file(target) as f:
                f.writelines(row + b"\n" for row in rows[lang])
            how = "written"
        entries.append({**_file_entry(target, corpus.lines), "how": how})
    done = ", ".join(f"{Path(e['path']).name} {e['how']}" for e in entries)
    say(f"{corpus.name}: {corpus.lines:,} segments in {test_dir} ({done})")
    return entries


def iter_summary(result: FetchResult) -> Iterator[str]:
    """The lines that say what a fetch holds (for a re-run that did nothing)."""
    train = [result.train[lang] for lang in LANGS if lang in result.train]
    lines = train[0]["lines"] if train else 0
    yield (f"nothing to do: {Path(result.out) / RECORD} records "
           f"{' and '.join(e['path'] for e in train)} ({lines:,} lines each)")
    tests = ", ".join(Path(entry["path"]).name for entry in result.test)
    yield f"and {tests} in {result.test_dir}, all unchanged; delete {RECORD} to fetch again"
