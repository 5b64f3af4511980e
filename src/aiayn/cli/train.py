"""``aiayn train``: train a Transformer with the recipe of §5 (also under torchrun)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HELP = ("Train a model from a preset or config file; resumable, checkpoints every N steps or "
        "M seconds. Several processes: torchrun --nproc-per-node N -m aiayn train ...")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="preset name (multi30k, tiny, base, big, table3-A1 … table3-E); "
                          "default multi30k")
    src.add_argument("--config", default=None, metavar="FILE",
                     help="a .toml or .json config file (a run's config.json repeats that run)")
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="where config, vocabulary, checkpoints, metrics and events go")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. train.max_steps=2000 (repeatable)")
    p.add_argument("--vocab", default=None, metavar="PATH",
                   help="an existing vocabulary (tokenizer.json or its folder); default: learn "
                        "one from the training data (data.vocab_size, data.vocab_kind)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest checkpoint")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if "
                                                  "available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")


def load_split(data: Any, split: str) -> Any:
    """The ``split`` ("train" or "valid") pairs of a DataConfig."""
    from aiayn.data.corpus import load_dataset, load_parallel

    if data.dataset == "files":
        src, tgt = (data.train_src, data.train_tgt) if split == "train" else \
            (data.valid_src, data.valid_tgt)
        if not src or not tgt:
            if split == "valid":
                return None
            raise ValueError("data.dataset = 'files' needs data.train_src and data.train_tgt")
        return load_parallel(src, tgt)
    name = {"train": "train", "valid": "val"}[split]
    if data.dataset == "wmt14-en-de":
        name = {"train": "train", "valid": "newstest2013"}[split]
    return load_dataset(data.dataset, name, data.src_lang, data.tgt_lang)


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from aiayn.checkpoint import list_checkpoints, write_json_atomic
    from aiayn.config import Config, load_config
    from aiayn.data.batching import encode_corpus
    from aiayn.data.vocab import Vocabulary
    from aiayn.errors import UserError
    from aiayn.training.loop import DistInfo, Trainer

    run_dir = Path(args.run_dir)
    info = DistInfo.from_env()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and info.world_size > 1:
        device = torch.device("cuda", info.local_rank)
    resume_from = None
    if args.resume:
        found = list_checkpoints(run_dir)
        if not found:
            raise UserError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        resume_from = found[-1]
        config = Config.from_dict(json.loads((run_dir / "config.json").read_text()),
                                  source=str(run_dir / "config.json"))
        if args.set:
            config = config.with_overrides(args.set)  # e.g. a longer train.max_steps
        vocab = Vocabulary.load(run_dir)
    else:
        if list_checkpoints(run_dir):
            raise UserError(f"{run_dir} already holds checkpoints: add --resume to continue "
                            "that run, or choose another --run-dir")
        config = load_config(args.config or args.preset or "multi30k", args.set)
        vocab = None
    train_corpus = load_split(config.data, "train")
    if config.data.train_limit:
        from aiayn.data.corpus import ParallelCorpus

        k = config.data.train_limit
        train_corpus = ParallelCorpus(train_corpus.src[:k], train_corpus.tgt[:k],
                                      train_corpus.name)
    valid_corpus = load_split(config.data, "valid")
    if vocab is None:
        if args.vocab:
            vocab = Vocabulary.load(args.vocab)
        elif info.is_main:
            vocab = Vocabulary.learn(train_corpus.src + train_corpus.tgt,
                                     config.data.vocab_size, config.data.vocab_kind)
        if info.world_size > 1:
            if info.is_main:
                vocab.save(run_dir)
            if not dist.is_initialized():
                dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
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
        print(f"aiayn train: {len(train)} training pairs ({train.filtered} over "
              f"{config.data.max_len} tokens dropped, {train_corpus.dropped_empty} empty dropped), "
              f"vocabulary {len(vocab)}, {info.world_size} process(es) on {device}, "
              f"run dir {run_dir}", flush=True)
    trainer = Trainer(config, run_dir, vocab, train, valid_corpus, valid_enc, device,
                      progress=not args.no_progress)
    if resume_from is not None:
        trainer.resume(resume_from)
        if info.is_main:
            print(f"aiayn train: resumed from {resume_from} (step {trainer.state.step})",
                  flush=True)
    try:
        summary = trainer.fit()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if info.is_main:
        if args.json:
            print(json.dumps(summary))
        else:
            print("aiayn train: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                              f"{k}={v}" for k, v in summary.items()))
    return 0
