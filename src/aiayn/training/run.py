"""Set up and run one training run: config, vocabulary, data, Trainer (used by ``aiayn train``
and ``aiayn pipeline``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from aiayn.checkpoint import list_checkpoints, write_json_atomic
from aiayn.config import Config
from aiayn.data.batching import encode_corpus
from aiayn.data.corpus import ParallelCorpus, load_dataset, load_parallel
from aiayn.data.vocab import Vocabulary
from aiayn.errors import UserError
from aiayn.training.loop import DistInfo, Trainer


def load_split(data: Any, split: str) -> ParallelCorpus | None:
    """The ``split`` ("train", "valid" or "test") pairs described by a DataConfig; None when a
    ``files`` config names no such files."""
    if data.dataset == "files":
        src, tgt = {"train": (data.train_src, data.train_tgt),
                    "valid": (data.valid_src, data.valid_tgt)}.get(split, (None, None))
        if not src or not tgt:
            if split != "train":
                return None
            raise ValueError("data.dataset = 'files' needs data.train_src and data.train_tgt")
        return load_parallel(src, tgt)
    names = {"multi30k": {"train": "train", "valid": "val", "test": "test_2016_flickr"},
             "wmt14-en-de": {"train": "train", "valid": "newstest2013", "test": "newstest2014"}}
    if data.dataset not in names:
        raise ValueError(f"unknown dataset {data.dataset!r}; known: files, "
                         f"{', '.join(names)}")
    return load_dataset(data.dataset, names[data.dataset][split], data.src_lang, data.tgt_lang)


def run_training(
    config: Config | None,
    run_dir: str | Path,
    *,
    vocab_path: str | Path | None = None,
    resume: bool = False,
    overrides: list[str] | None = None,
    device: str | None = None,
    progress: bool = True,
    log: Any = print,
) -> dict[str, Any]:
    """Train ``config`` into ``run_dir`` (or resume the run there) and return the summary.

    Without ``vocab_path`` a vocabulary of ``data.vocab_size`` is learned from the training
    pairs; ``model.vocab_size`` is then set to its real size. ``config.json`` and
    ``tokenizer.json`` are written into ``run_dir`` before training starts.

    Raises:
        UserError: resuming without a checkpoint, or starting over one.
    """
    run_dir = Path(run_dir)
    info = DistInfo.from_env()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and info.world_size > 1:
        dev = torch.device("cuda", info.local_rank)
    resume_from = None
    vocab = None
    if resume:
        found = list_checkpoints(run_dir)
        if not found:
            raise UserError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        resume_from = found[-1]
        config = Config.from_dict(json.loads((run_dir / "config.json").read_text()),
                                  source=str(run_dir / "config.json"))
        if overrides:
            config = config.with_overrides(overrides)  # e.g. a longer train.max_steps
        vocab = Vocabulary.load(run_dir)
    elif list_checkpoints(run_dir):
        raise UserError(f"{run_dir} already holds checkpoints: add --resume to continue that "
                        "run, or choose another --run-dir")
    assert config is not None
    train_corpus = load_split(config.data, "train")
    if config.data.train_limit:
        k = config.data.train_limit
        train_corpus = ParallelCorpus(train_corpus.src[:k], train_corpus.tgt[:k],
                                      train_corpus.name, train_corpus.dropped_empty)
    valid_corpus = load_split(config.data, "valid")
    if vocab is None:
        if vocab_path:
            vocab = Vocabulary.load(vocab_path)
        elif info.is_main:
            vocab = Vocabulary.learn(train_corpus.src + train_corpus.tgt,
                                     config.data.vocab_size, config.data.vocab_kind)
        if info.world_size > 1:  # one process learns, the others read its file
            if info.is_main:
                vocab.save(run_dir)
            if not dist.is_initialized():
                dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
            dist.barrier()
            vocab = Vocabulary.load(run_dir)
        model_cfg = config.model.__class__(**{**config.model.__dict__,
                                              "vocab_size": len(vocab), "tgt_vocab_size": None})
        config = config.replace(model=model_cfg)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        vocab.save(run_dir)
        write_json_atomic(run_dir / "config.json", config.to_dict())
    train = encode_corpus(vocab, train_corpus, config.data.max_len)
    valid_enc = encode_corpus(vocab, valid_corpus, config.data.max_len) if valid_corpus else None
    if info.is_main:
        log(f"aiayn train: {len(train)} training pairs ({train.filtered} over "
            f"{config.data.max_len} tokens dropped, {train_corpus.dropped_empty} empty dropped), "
            f"vocabulary {len(vocab)}, {info.world_size} process(es) on {dev}, "
            f"run dir {run_dir}")
    trainer = Trainer(config, run_dir, vocab, train, valid_corpus, valid_enc, dev,
                      progress=progress)
    if resume_from is not None:
        trainer.resume(resume_from)
        if info.is_main:
            log(f"aiayn train: resumed from {resume_from} (step {trainer.state.step})")
    try:
        return trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
