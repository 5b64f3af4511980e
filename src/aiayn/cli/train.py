"""``aiayn train``: train a Transformer with the recipe of §5 (also under torchrun)."""

from __future__ import annotations

import argparse
import json

from aiayn.rundir import CONFIG, TOKENIZER

HELP = ("Train a model from a preset or config file; resumable, checkpoints every N steps or "
        "M seconds. Several processes: torchrun --nproc-per-node N -m aiayn train ...")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="preset name (multi30k, tiny, base, big, table3-A1 … table3-E); "
                          "default multi30k")
    src.add_argument("--config", default=None, metavar="FILE",
                     help=f"a .toml or .json config file (a run's {CONFIG} repeats that run)")
    p.add_argument("--run-dir", required=True, metavar="DIR",
                   help="where config, vocabulary, checkpoints, metrics and events go")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. train.max_steps=2000 (repeatable)")
    p.add_argument("--vocab", default=None, metavar="PATH",
                   help=f"an existing vocabulary ({TOKENIZER} or its folder); default: learn "
                        "one from the training data (data.vocab_size, data.vocab_kind)")
    p.add_argument("--init-from", default=None, metavar="CKPT_OR_HF_DIR",
                   help="fine-tune: start from this model's weights and vocabulary (a "
                        "checkpoint, a run directory or a Hugging Face Marian directory), with "
                        "a fresh optimizer and schedule; its architecture, text "
                        "(data.preprocess) and decode settings are kept, dropout, data and "
                        "training come from --preset/--config/--set")
    p.add_argument("--resume", nargs="?", const="yes", default=None, choices=("yes", "auto"),
                   metavar="auto",
                   help="continue the run in --run-dir from its newest checkpoint; --resume "
                        "auto: that when it holds one, else start afresh from --preset/--config "
                        "(one command for torchrun --max-restarts and requeued jobs; the "
                        "setting train.resume=auto does the same)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if "
                                                  "available, else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")


def run(args: argparse.Namespace) -> int:
    from aiayn.config import load_config
    from aiayn.training.loop import DistInfo
    from aiayn.training.run import run_training, summary_line

    from aiayn.errors import UserError

    resume = {"yes": True, "auto": "auto", None: False}[args.resume]
    if args.init_from and (resume is True or args.vocab):
        raise UserError("--init-from brings its own weights and vocabulary: it goes with "
                        "neither --resume nor --vocab")
    config = None if resume is True else load_config(args.config or args.preset or "multi30k",
                                                     args.set)
    summary = run_training(config, args.run_dir, vocab_path=args.vocab, resume=resume,
                           overrides=args.set if resume else None, device=args.device,
                           progress=not args.no_progress,
                           log=lambda msg: print(msg, flush=True), init_from=args.init_from)
    if DistInfo.from_env().is_main:
        if args.json:
            print(json.dumps(summary))
        else:
            print(summary_line(summary))
    return 0
