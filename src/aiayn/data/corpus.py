"""Parallel corpora: aligned text files (plain or ``.gz``) and the named datasets.

Every reader strips each line (Multi30k has stray leading and trailing spaces) and checks
alignment: a mismatch or undecodable byte raises :class:`~aiayn.errors.DataError` naming the
file and line, never a silent loss.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

from aiayn.errors import DataError

DATA_DIR_ENV = "AIAYN_DATA_DIR"

MULTI30K_SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_LANGS = ("en", "de", "fr", "cs")


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file (plain or gzip), each stripped of surrounding whitespace.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: invalid UTF-8 (the message gives the file and line number).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for number, line in enumerate(lines, start=1):
        try:
            out.append(line.decode("utf-8").strip())
        except UnicodeDecodeError as err:
            raise DataError(f"{path}, line {number}: invalid UTF-8 ({err.reason} at byte "
                            f"{err.start})") from None
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


def load_parallel(src_path: str | Path, tgt_path: str | Path, drop_empty: bool = True,
                  name: str | None = None) -> ParallelCorpus:
    """Read two aligned files.

    Args:
        drop_empty: remove pairs with an empty side (counted in ``dropped_empty``); when False
            they are kept, aligned.

    Raises:
        DataError: the files have different line counts (both named, both counts given).
    """
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
                        "source and target files must be line-aligned")
    dropped = 0
    if drop_empty:
        keep = [i for i in range(len(src)) if src[i] and tgt[i]]
        dropped = len(src) - len(keep)
        src, tgt = [src[i] for i in keep], [tgt[i] for i in keep]
    return ParallelCorpus(src, tgt, name or f"{src_path}|{tgt_path}", dropped)


def data_dir() -> Path | None:
    value = os.environ.get(DATA_DIR_ENV)
    return Path(value) if value else None


def multi30k_paths(split: str, src_lang: str, tgt_lang: str) -> tuple[Path, Path]:
    """Paths of a Multi30k task-1 split under ``$AIAYN_DATA_DIR/multi30k/``.

    Raises:
        ValueError: unknown split or language.
        FileNotFoundError: the files are not there (the message says where it looked).
    """
    if split not in MULTI30K_SPLITS:
        raise ValueError(f"unknown Multi30k split {split!r}; known: {', '.join(MULTI30K_SPLITS)}")
    for lang in (src_lang, tgt_lang):
        if lang not in MULTI30K_LANGS:
            raise ValueError(f"Multi30k has no language {lang!r}; known: "
                             f"{', '.join(MULTI30K_LANGS)}")
    root = data_dir()
    if root is None:
        raise FileNotFoundError(f"Multi30k: set {DATA_DIR_ENV} to the folder holding multi30k/")
    paths = tuple(root / "multi30k" / f"{split}.{lang}.gz" for lang in (src_lang, tgt_lang))
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"Multi30k file not found: {p} (looked in "
                                    f"{DATA_DIR_ENV}={root})")
    return paths  # type: ignore[return-value]


def load_dataset(name: str, split: str, src_lang: str, tgt_lang: str) -> ParallelCorpus:
    """A split of a named dataset (``multi30k``) as a :class:`ParallelCorpus`."""
    if name == "multi30k":
        src, tgt = multi30k_paths(split, src_lang, tgt_lang)
        return load_parallel(src, tgt, name=f"multi30k/{split}.{src_lang}-{tgt_lang}")
    raise ValueError(f"unknown dataset {name!r}; known: multi30k")
