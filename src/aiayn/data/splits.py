"""The named splits of a run's corpus (``data.dataset``): train, valid and test, as
distributed or under ``data.preprocess``."""

from __future__ import annotations

from typing import Any

from aiayn.data.corpus import ParallelCorpus, load_dataset, load_parallel
from aiayn.data.text import preprocess_corpus
from aiayn.errors import ConfigError

__all__ = ["load_split", "load_raw_split"]


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
    if data.dataset == "files":
        src, tgt = {"train": (data.train_src, data.train_tgt),
                    "valid": (data.valid_src, data.valid_tgt)}.get(split, (None, None))
        if not src or not tgt:
            if split != "train":
                return None
            raise ConfigError("data.dataset = 'files' needs data.train_src and data.train_tgt")
        return load_parallel(src, tgt)
    names = {"multi30k": {"train": "train", "valid": "val", "test": "test_2016_flickr"},
             "wmt14-en-de": {"train": "train", "valid": "newstest2013", "test": "newstest2014"}}
    if data.dataset not in names:
        raise ConfigError(f"unknown dataset {data.dataset!r}; known: files, "
                         f"{', '.join(names)}")
    return load_dataset(data.dataset, names[data.dataset][split], data.src_lang, data.tgt_lang)
