"""``aiayn pipeline``: the main job, end to end — vocabulary, training, checkpoint averaging,
beam-search translation of the test set, BLEU and chrF, curves. The job is
:func:`aiayn.pipeline.run_job`; this module parses its options and prints what it returns."""

from __future__ import annotations

import argparse
import sys

HELP = ("The whole job on a named corpus: learn the shared BPE vocabulary, train, average the "
        "last checkpoints (§6.1), translate the test set with beam search, report BLEU/chrF.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None,
                   help="preset name or config file (default: multi30k; with --ensemble auto, "
                        "the rule's: multi30k-ensemble members or one multi30k model)")
    p.add_argument("--src-lang", default=None, help="source language (default: the preset's, en)")
    p.add_argument("--tgt-lang", default=None, help="target language (default: the preset's, de)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="run directory (default: runs/<dataset>-<src>-<tgt>)")
    p.add_argument("--time-budget-min", type=float, default=None, metavar="MIN",
                   help="minutes of training (default: the preset's train.time_budget_s)")
    p.add_argument("--average", type=int, nargs="+", default=None, metavar="K",
                   help="how many of the last checkpoints to average (§6.1); several values "
                        "are each tried on the whole validation set, with every alpha, and "
                        "the best pair there translates the test set (default: the preset's "
                        "train.keep_last; a value above it needs --set train.keep_last=K). "
                        "A run with train.ema_decay > 0 also tries its moving average of the "
                        "weights (RUN_DIR/ema) the same way")
    p.add_argument("--alphas", type=float, nargs="+", default=None, metavar="ALPHA",
                   help="length penalties alpha (§6.1, Wu et al. 2016's lp; 0 = none) to try with beam "
                        "search on the whole validation set; the best one there translates "
                        "the test set once (default: the preset's decode.alpha alone)")
    p.add_argument("--ensemble", type=_ensemble_count, default=1, metavar="N|auto",
                   help="train N models at once in the same time budget (one process each, "
                        "the threads shared out, seeds train.seed ... train.seed + N - 1, one "
                        "vocabulary) and translate with their ensemble: their next-token "
                        "probabilities averaged (default 1: one model). auto: time a few "
                        "updates of each shape on this machine first and take the rule's "
                        "(aiayn.budget; docs/recipe.md): two members where each still reaches "
                        "20 epochs in the budget, else one model on all cores, with the warmup "
                        "sized to the projected updates and less dropout under 12 projected "
                        "epochs")
    p.add_argument("--test-src", metavar="FILE",
                   help="the test set's source side, line-aligned with --test-tgt (plain or "
                        ".gz), e.g. newstest2014.en; needed where the dataset names no test "
                        "split (data.dataset = files), else it replaces that split")
    p.add_argument("--test-tgt", metavar="FILE", help="the test set's references")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")


def _ensemble_count(text: str) -> int | str:
    """``--ensemble``'s value: a count, or ``auto`` (the shape from the throughput probe)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of models or 'auto', got "
                                         f"{text!r}") from None


def run(args: argparse.Namespace) -> int:
    from aiayn.pipeline import JobOptions, Stopped, run_job

    options = JobOptions(
        preset=args.preset, src_lang=args.src_lang, tgt_lang=args.tgt_lang,
        run_dir=args.run_dir, time_budget_min=args.time_budget_min, average=args.average,
        alphas=args.alphas, ensemble=args.ensemble, test_src=args.test_src,
        test_tgt=args.test_tgt, overrides=args.set, resume=args.resume, device=args.device,
        progress=not args.no_progress, decode_progress=not args.no_progress and not args.json)
    outcome = run_job(options, say=(lambda _msg: None) if args.json else
                      (lambda msg: print(msg, flush=True)))
    if isinstance(outcome, Stopped):
        print(f"aiayn pipeline: training stopped by {outcome.signal_name} {outcome.at}; the "
              f"checkpoints are in {outcome.run_dir}. Continue with: aiayn pipeline --resume "
              f"--run-dir {outcome.run_dir} --preset {outcome.preset}"
              + (f" --ensemble {outcome.ensemble}" if outcome.ensemble > 1 else ""),
              file=sys.stderr)
        return 128 + outcome.signum
    print(outcome.to_json() if args.json else outcome.describe())
    return 0
