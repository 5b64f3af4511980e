"""Parallel corpora: aligned text files (plain or ``.gz``), TSV files of pairs, named datasets.

Every reader strips each line (Multi30k has stray leading and trailing spaces) and checks
alignment: a mismatch or an undecodable byte raises :class:`~aiayn.errors.DataError` naming the
file and line, never a silent loss. Pairs with an empty side are either kept, aligned, or dropped
and counted in :attr:`ParallelCorpus.dropped_empty`.

Named datasets (:func:`load_dataset`):

``multi30k``
    Task 1 of Multi30k (splits ``train``, ``val``, ``test_2016_flickr``; languages en, de, fr,
    cs), read from ``$AIAYN_DATA_DIR/multi30k/`` or, when ``AIAYN_DATA_DIR`` is unset,
    downloaded from the dataset's repository (github.com/multi30k/dataset at a fixed commit) into
    ``$AIAYN_CACHE_DIR/multi30k/`` (default ``~/.cache/aiayn``) and checked against sha256 sums.
``wmt14-en-de``
    newstest2013 (split ``newstest2013``, alias ``val``) and newstest2014 (full 3003 segments;
    ``newstest2014``, alias ``test``) from ``$AIAYN_DATA_DIR/wmt14-en-de/``. No training data.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

from aiayn.errors import ConfigError, DataError

DATA_DIR_ENV = "AIAYN_DATA_DIR"
CACHE_DIR_ENV = "AIAYN_CACHE_DIR"
MULTI30K_URL_ENV = "AIAYN_MULTI30K_URL"

DATASETS = ("multi30k", "wmt14-en-de")

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_LANGS = ("en", "de", "fr", "cs")
MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
MULTI30K_URL = (f"https://raw.githubusercontent.com/multi30k/dataset/{MULTI30K_COMMIT}"
                "/data/task1/raw/")
# sha256 of the .gz files at MULTI30K_COMMIT (the same bytes as ../shared/data/multi30k/).
MULTI30K_SHA256 = {
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
}

WMT14_SPLITS = {"newstest2013": "newstest2013", "val": "newstest2013",
                "newstest2014": "newstest2014", "test": "newstest2014"}
WMT14_LANGS = ("en", "de")


# --- files ------------------------------------------------------------------------------------
def decode_line(line: bytes, name: str | Path, number: int) -> str:
    """One line's bytes as UTF-8 text, for files and stdin alike.

    Raises:
        DataError: invalid UTF-8, naming ``name``, the 1-based line ``number`` and the byte.
    """
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{name}, line {number}: invalid UTF-8 ({err.reason} at "
                        f"byte {err.start} of the line)") from None


def read_lines(path: str | Path, strip: bool = True) -> list[str]:
    """All lines of a UTF-8 text file (plain, or gzip when the name ends in ``.gz``), each
    stripped of surrounding whitespace (``strip=False``: of the line end ``\\n`` or ``\\r\\n``
    only). Lines are split on ``\\n`` only, so a stray U+2028 or form feed inside a sentence
    cannot shift the alignment.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: invalid UTF-8 (the message gives the file and line number), or a broken
            gzip stream.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a text file")
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    out: list[str] = []
    number = 0
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            for number, line in enumerate(f, start=1):
                text = decode_line(line, path, number)
                out.append(text.strip() if strip else text.rstrip("\r\n"))
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        hint = "; is it a complete gzip file?" if path.suffix == ".gz" else ""
        raise DataError(f"{path}: read failed after line {number} ({err}){hint}") from None
    return out


@dataclass
class ParallelCorpus:
    """Aligned sentence pairs: ``src[i]`` translates to ``tgt[i]``."""

    src: list[str]
    tgt: list[str]
    name: str = "corpus"
    dropped_empty: int = 0  # pairs removed because one side was empty

    def __len__(self) -> int:
        return len(self.src)

    def describe(self) -> str:
        """One line for logs: name, pairs, and the empty pairs dropped if any."""
        extra = f", {self.dropped_empty} pairs with an empty side dropped" \
            if self.dropped_empty else ""
        return f"{self.name}: {len(self)} pairs{extra}"


def _pair_up(src: list[str], tgt: list[str], drop_empty: bool, name: str) -> ParallelCorpus:
    dropped = 0
    if drop_empty:
        keep = [i for i in range(len(src)) if src[i] and tgt[i]]
        dropped = len(src) - len(keep)
        if dropped:
            src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    return ParallelCorpus(src, tgt, name, dropped)


def load_parallel(src_path: str | Path, tgt_path: str | Path, drop_empty: bool = True,
                  name: str | None = None) -> ParallelCorpus:
    """Read two line-aligned files (plain or ``.gz``).

    Args:
        drop_empty: remove pairs with an empty side (counted in ``dropped_empty``); when False
            they are kept, aligned.

    Raises:
        FileNotFoundError: a file does not exist.
        DataError: the files have different line counts (both named, both counts given), or
            see :func:`read_lines`.
    """
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
                        "source and target files must be line-aligned")
    return _pair_up(src, tgt, drop_empty, name or f"{src_path}|{tgt_path}")


def load_tsv(path: str | Path, drop_empty: bool = True, name: str | None = None,
             reverse: bool = False) -> ParallelCorpus:
    """Read a file (plain or ``.gz``) of ``source<TAB>target`` lines.

    Args:
        drop_empty: as in :func:`load_parallel`. A line with nothing on it is an empty pair.
        reverse: the file holds ``target<TAB>source``.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: a non-empty line without exactly one tab (file, line and tab count given).
    """
    src: list[str] = []
    tgt: list[str] = []
    for number, line in enumerate(read_lines(path, strip=False), start=1):
        if not line.strip():
            src.append("")
            tgt.append("")
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise DataError(f"{path}, line {number}: expected source<TAB>target, found "
                            f"{len(parts) - 1} tabs in {line[:60]!r}")
        a, b = parts[0].strip(), parts[1].strip()
        src.append(b if reverse else a)
        tgt.append(a if reverse else b)
    return _pair_up(src, tgt, drop_empty, name or str(path))


def load_files(src_path: str | Path, tgt_path: str | Path | None = None,
               drop_empty: bool = True) -> ParallelCorpus:
    """Two aligned files, or (``tgt_path`` None) one TSV file of pairs."""
    if tgt_path is None:
        return load_tsv(src_path, drop_empty)
    return load_parallel(src_path, tgt_path, drop_empty)


# --- named datasets ---------------------------------------------------------------------------
def data_dir() -> Path | None:
    """``$AIAYN_DATA_DIR``, or None when unset."""
    value = os.environ.get(DATA_DIR_ENV)
    return Path(value) if value else None


def cache_dir() -> Path:
    """Where downloads go: ``$AIAYN_CACHE_DIR``, else ``~/.cache/aiayn``."""
    value = os.environ.get(CACHE_DIR_ENV)
    return Path(value) if value else Path.home() / ".cache" / "aiayn"


def _check_multi30k(split: str, langs: tuple[str, ...]) -> None:
    if split not in MULTI30K_SPLITS:
        raise ConfigError(f"unknown Multi30k split {split!r}; known: {', '.join(MULTI30K_SPLITS)}")
    for lang in langs:
        if lang not in MULTI30K_LANGS:
            raise ConfigError(f"Multi30k has no language {lang!r}; known: "
                             f"{', '.join(MULTI30K_LANGS)}")


def multi30k_paths(split: str, src_lang: str, tgt_lang: str, *, download: bool = True,
                   base_url: str | None = None,
                   cache: str | Path | None = None) -> tuple[Path, Path]:
    """Paths of a Multi30k task-1 split: under ``$AIAYN_DATA_DIR/multi30k/`` when that is set,
    else in the download cache (fetched and verified on first use, see :func:`download_file`).

    Args:
        download: when False, never download; a file not already cached is an error.
        base_url: folder URL the ``.gz`` files are fetched from; default ``$AIAYN_MULTI30K_URL``,
            else the dataset's repository at commit ``MULTI30K_COMMIT``.
        cache: download folder; default ``cache_dir()/multi30k``.

    Raises:
        ValueError: unknown split or language.
        FileNotFoundError: the files are not there (the message says where it looked and how
            to get them).
        DataError: a download failed or its sha256 is wrong (see :func:`download_file`).
    """
    _check_multi30k(split, (src_lang, tgt_lang))
    names = [f"{split}.{lang}.gz" for lang in (src_lang, tgt_lang)]
    root = data_dir()
    if root is not None:
        paths = tuple(root / "multi30k" / n for n in names)
        for p in paths:
            if not p.is_file():
                raise FileNotFoundError(
                    f"Multi30k file not found: {p} (looked in {DATA_DIR_ENV}={root}). Copy the "
                    f"data/task1/raw/ files of github.com/multi30k/dataset into {root}/multi30k/, "
                    f"or unset {DATA_DIR_ENV} to download them into {cache_dir()}/multi30k/")
        return paths  # type: ignore[return-value]
    folder = Path(cache) if cache is not None else cache_dir() / "multi30k"
    url = base_url or os.environ.get(MULTI30K_URL_ENV) or MULTI30K_URL
    out = []
    for n in names:
        target = folder / n
        if not download and not target.is_file():
            raise FileNotFoundError(
                f"Multi30k file not found: {target} ({DATA_DIR_ENV} is unset and downloading "
                f"is off). Set {DATA_DIR_ENV} to a folder holding multi30k/, or allow the "
                f"download from {url}")
        out.append(download_file(url.rstrip("/") + "/" + n, target, MULTI30K_SHA256[n]))
    return out[0], out[1]


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, target: str | Path, sha256: str, timeout_s: float = 60.0) -> Path:
    """Fetch ``url`` into ``target`` unless a file with the right sha256 is already there.

    The bytes go to a temporary file beside ``target``, are checked against ``sha256``, and only
    then renamed to ``target``, so an interrupted or corrupted download never leaves a file under
    the final name. A cached file with a wrong checksum is fetched again.

    Raises:
        DataError: the URL cannot be fetched (the message names it and the way around it), or
            the bytes do not have the expected sha256 (expected and actual given).
    """
    target = Path(target)
    if target.is_file() and sha256_file(target) == sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout_s) as response:
                    for chunk in iter(lambda: response.read(1 << 16), b""):
                        digest.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, OSError) as err:
                raise DataError(
                    f"cannot download {url} ({getattr(err, 'reason', err)}); set {DATA_DIR_ENV} "
                    f"to a folder holding multi30k/ with the files, or {MULTI30K_URL_ENV} to "
                    "another copy of them") from None
        if digest.hexdigest() != sha256:
            raise DataError(f"{url}: downloaded file has sha256 {digest.hexdigest()}, expected "
                            f"{sha256}; not saved to {target}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def wmt14_paths(split: str, src_lang: str, tgt_lang: str) -> tuple[Path, Path]:
    """Paths of a WMT14 en-de news test set under ``$AIAYN_DATA_DIR/wmt14-en-de/``.

    Raises:
        ValueError: unknown split or language; ``train`` (not provided) says what to do instead.
        FileNotFoundError: unset ``AIAYN_DATA_DIR`` or missing files (where it looked, and how
            to get them).
    """
    if split == "train":
        raise ConfigError("wmt14-en-de has no training data here (only newstest2013/2014): "
                          "download and clean it as docs/wmt14.md says, then train on it with "
                          "data.dataset=files, data.train_src and data.train_tgt")
    if split not in WMT14_SPLITS:
        raise ValueError(f"unknown wmt14-en-de split {split!r}; known: "
                         f"{', '.join(WMT14_SPLITS)}")
    for lang in (src_lang, tgt_lang):
        if lang not in WMT14_LANGS:
            raise ConfigError(f"wmt14-en-de has no language {lang!r}; known: en, de")
    how = ("newstest2013/2014 .en/.de as plain text (e.g. from github.com/Helsinki-NLP/"
           "OPUS-MT-testsets, testsets/en-de/)")
    root = data_dir()
    if root is None:
        raise FileNotFoundError(f"wmt14-en-de: set {DATA_DIR_ENV} to a folder holding "
                                f"wmt14-en-de/ with {how}")
    stem = WMT14_SPLITS[split]
    paths = tuple(root / "wmt14-en-de" / f"{stem}.{lang}" for lang in (src_lang, tgt_lang))
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"wmt14-en-de file not found: {p} (looked in "
                                    f"{DATA_DIR_ENV}={root}); put {how} there")
    return paths  # type: ignore[return-value]


def load_dataset(name: str, split: str, src_lang: str, tgt_lang: str, *,
                 drop_empty: bool = True, download: bool = True,
                 base_url: str | None = None) -> ParallelCorpus:
    """A split of a named dataset (``multi30k``, ``wmt14-en-de``) as a :class:`ParallelCorpus`.

    Args:
        download, base_url: for ``multi30k``, see :func:`multi30k_paths`.

    Raises:
        ValueError: unknown dataset, split or language.
        FileNotFoundError, DataError: see :func:`multi30k_paths`, :func:`wmt14_paths`.
    """
    if src_lang == tgt_lang:
        raise ConfigError(f"source and target language are both {src_lang!r}")
    if name == "multi30k":
        src, tgt = multi30k_paths(split, src_lang, tgt_lang, download=download,
                                  base_url=base_url)
    elif name == "wmt14-en-de":
        src, tgt = wmt14_paths(split, src_lang, tgt_lang)
    else:
        raise ConfigError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)} (or give "
                         "aligned files)")
    return load_parallel(src, tgt, drop_empty=drop_empty,
                         name=f"{name}/{split}.{src_lang}-{tgt_lang}")
