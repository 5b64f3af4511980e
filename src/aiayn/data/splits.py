"""The named splits of a run's corpus (``data.dataset``): train, valid and test, as
distributed or under ``data.preprocess``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiayn.data.corpus import (ParallelCorpus, load_dataset, load_parallel, multi30k_paths,
                               wmt14_paths)
from aiayn.data.text import preprocess_corpus
from aiayn.errors import ConfigError

__all__ = ["DATASET_SPLITS", "load_raw_split", "load_split", "split_paths"]


def load_split(data: Any, split: str) -> ParallelCorpus | None:
    """The ``split`` ("train", "valid" or "test") pairs described by a DataConfig (the first
    ``train_limit`` training pairs when set), under its ``preprocess`` mode; None when a
    ``files`` config names no such files."""
    corpus = load_raw_split(data, split)
    if corpus is None:
        return None
    if split == "train" and data.train_limit:  # before preprocessing: only what is used
        k = data.train_limit
        corpus = ParallelCorpus(corpus.src[:k], corpus.tgt[:k], corpus.name,
                                corpus.dropped_empty)
    return preprocess_corpus(corpus, data.src_lang, data.tgt_lang, data.preprocess)


def load_raw_split(data: Any, split: str) -> ParallelCorpus | None:
    """The ``split`` pairs as distributed, before ``data.preprocess`` (what a user's file
    holds; :class:`aiayn.Translator` preprocesses such text itself)."""
    paths = split_paths(data, split)
    if paths is None:
        return None
    if data.dataset == "files":
        return load_parallel(*paths)
    return load_dataset(data.dataset, DATASET_SPLITS[data.dataset][split], data.src_lang,
                        data.tgt_lang)


DATASET_SPLITS = {"multi30k": {"train": "train", "valid": "val", "test": "test_2016_flickr"},
                  "wmt14-en-de": {"train": "train", "valid": "newstest2013",
                                  "test": "newstest2014"}}


def split_paths(data: Any, split: str) -> tuple[Path, Path] | None:
    """The (source, target) files of the ``split`` pairs a DataConfig names; None when a
    ``files`` config names no such files.

    Raises:
        ConfigError: ``files`` without training files, an unknown dataset, or a dataset
            without training data.
    """
    if data.dataset == "files":
        src, tgt = {"train": (data.train_src, data.train_tgt),
                    "valid": (data.valid_src, data.valid_tgt)}.get(split, (None, None))
        if not src or not tgt:
            if split != "train":
                return None
            raise ConfigError("data.dataset = 'files' needs data.train_src and data.train_tgt")
        return Path(src), Path(tgt)
    if data.dataset not in DATASET_SPLITS:
        raise ConfigError(f"unknown dataset {data.dataset!r}; known: files, "
                          f"{', '.join(DATASET_SPLITS)}")
    name = DATASET_SPLITS[data.dataset][split]
    if data.dataset == "multi30k":
        return multi30k_paths(name, data.src_lang, data.tgt_lang)
    try:
        return wmt14_paths(name, data.src_lang, data.tgt_lang)
    except ValueError as err:  # no training data: say what to do instead
        raise ConfigError(str(err)) from None
