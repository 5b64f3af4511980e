"""``aiayn pipeline``: the main job, end to end — vocabulary, training, checkpoint averaging,
beam-search translation of the test set, BLEU and chrF, curves."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from aiayn.errors import UserError

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


def _auto_shape(args: argparse.Namespace, overrides: list[str], run_dir: Path, say,
                device: Any) -> Any:
    """``--ensemble auto``: (members, preset, threads, shape record) for this run. A new run
    learns its vocabulary into a scratch folder, times the candidate shapes
    (:func:`aiayn.training.probe.choose_for_budget`) and writes the choice to the run
    directory; a resumed one keeps the shape it started with.

    Raises:
        ConfigError: a budget too short to train anything (the minimum named).
    """
    import tempfile

    from aiayn.budget import (MEMBER_PRESET, SINGLE_PRESET, Choice, checkpoint_every_for,
                              choice_overrides)
    from aiayn.config import load_config, read_json_object
    from aiayn.data.splits import load_split
    from aiayn.data.vocab import learn_vocabulary
    from aiayn.fileio import write_json_atomic
    from aiayn.rundir import RunDir
    from aiayn.training.ensemble import members_found
    from aiayn.training.probe import choose_for_budget

    layout = RunDir(run_dir)
    if args.resume:
        n = members_found(run_dir) or 1
        record = read_json_object(layout.shape) if layout.shape.is_file() else None
        preset = args.preset or (MEMBER_PRESET if n > 1 else SINGLE_PRESET)
        return n, preset, None, record
    probe_cfg = load_config(args.preset or MEMBER_PRESET, overrides)
    budget_s = probe_cfg.train.time_budget_s
    if device.type != "cpu":  # the rule's rates and shapes are CPU cores'; a GPU trains one model
        # (a GPU's first updates of each batch shape are many times slower than its steady
        # rate, so a few timed updates would project a fraction of the run: docs/hardware.md)
        preset = args.preset or SINGLE_PRESET
        choice = Choice(1, 0, preset, load_config(preset, overrides).train.warmup_steps, 0, 0.0,
                        f"on {device}: one model (the probe times shapes of CPU cores)")
        say(f"[0/4] {choice.line()}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            learn_vocabulary(load_split(probe_cfg.data, "train"), probe_cfg.data).save(tmp)
            choice = choose_for_budget(overrides, budget_s, tmp,
                                       lambda msg: say(f"[0/4] {msg}"), preset=args.preset)
    # rule 5: the checkpoints follow the budget, whichever way the shape was found (unless the
    # user set the interval)
    preset_every = load_config(choice.preset, overrides).train.checkpoint_every_s
    every = checkpoint_every_for(budget_s, preset_every)
    if every != preset_every and \
            not any(o.startswith("train.checkpoint_every_s=") for o in overrides):
        choice = dataclasses.replace(choice, checkpoint_every_s=every)
        say(f"[0/4] a checkpoint every {every:g} s: about {budget_s / every:.0f} in the "
            f"{budget_s / 60:g}-minute budget, as the hour writes 30, so that the averaged "
            "last ones are the run's end, not its warmup")
    overrides += choice_overrides(choice, overrides, load_config(choice.preset, overrides).model)
    record = choice.to_dict()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(layout.shape, record)
    return choice.members, choice.preset, choice.threads if choice.members > 1 else None, record


def _ensemble_summary(members: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary for an ensemble's members: their updates and target tokens summed, the
    fewest epochs, the longest time, the stop reason of the first that did not end normally."""
    steal = [m["cpu_steal_pct"] for m in members if m.get("cpu_steal_pct") is not None]
    stops = [m["stop_reason"] for m in members if m["stop_reason"].startswith("signal")]
    return {"steps": sum(m["steps"] for m in members),
            "epochs": min(m["epochs"] for m in members),
            "elapsed_s": max(m["elapsed_s"] for m in members),
            "target_tokens": sum(m["target_tokens"] for m in members),
            "parameters": members[0]["parameters"],
            "stop_reason": stops[0] if stops else members[0]["stop_reason"],
            "cpu_steal_pct": max(steal) if steal else None,
            "valid_bleu": None}


def _test_split(args: argparse.Namespace, d: Any) -> tuple[Any, Any]:
    """The test pairs (as the model reads them, and as distributed): ``--test-src`` and
    ``--test-tgt`` when given, else the dataset's own test split ((None, None) for none)."""
    from aiayn.data.corpus import load_parallel
    from aiayn.data.text import preprocess_corpus
    from aiayn.data.splits import load_raw_split, load_split

    if bool(args.test_src) != bool(args.test_tgt):
        raise UserError("--test-src and --test-tgt go together")
    if args.test_src:
        raw = load_parallel(args.test_src, args.test_tgt)
        return preprocess_corpus(raw, d.src_lang, d.tgt_lang, d.preprocess), raw
    return load_split(d, "test"), load_raw_split(d, "test")


def _tok_reference(dataset: str, tgt_lang: str) -> Path | None:
    from aiayn.data.corpus import data_dir

    root = data_dir()
    if dataset != "multi30k" or root is None:
        return None
    path = root / "multi30k" / "tok" / f"test_2016_flickr.lc.norm.tok.{tgt_lang}.gz"
    return path if path.is_file() else None


def run(args: argparse.Namespace) -> int:
    import torch

    import signal
    import sys

    from aiayn.config import load_config
    from aiayn.data.splits import load_split
    from aiayn.devices import choose_device
    from aiayn.evaluation.bleu import (chrf_score, corpus_bleu, multi30k_tok_bleu,
                                       multi30k_tokenize, sacrebleu_scores)
    from aiayn.evaluation.bleu import read_lines as read_ref_lines
    from aiayn.fileio import write_atomic
    from aiayn.precision import may_reduce_decoding_precision
    from aiayn.rundir import GENERATION_CONFIG, RESULTS, RunDir
    from aiayn.selection import (candidates, check_reduced_precision, choose_on_valid,
                                 described, record_choice, write_results)
    from aiayn.training.ensemble import (check_new_run, member_dirs, members_found,
                                         train_members)
    from aiayn.training.run import run_training
    from aiayn.viz.curves import plot_run

    def say(msg: str) -> None:
        if not args.json:
            print(msg, flush=True)

    if args.average is not None and min(args.average) < 1:
        raise UserError(f"--average must be at least 1, got {min(args.average)}")
    if args.ensemble != "auto" and args.ensemble < 1:
        raise UserError(f"--ensemble must be at least 1, got {args.ensemble}")
    overrides = list(args.set)
    if args.src_lang:
        overrides.append(f"data.src_lang={args.src_lang}")
    if args.tgt_lang:
        overrides.append(f"data.tgt_lang={args.tgt_lang}")
    if args.time_budget_min is not None:
        overrides.append(f"train.time_budget_s={args.time_budget_min * 60}")
    config = load_config(args.preset or "multi30k", overrides)
    d = config.data
    run_dir = Path(args.run_dir or f"runs/{d.dataset}-{d.src_lang}-{d.tgt_lang}")
    shape, threads = None, None
    if args.ensemble == "auto":
        if not args.resume:
            check_new_run(run_dir, 2)  # before the probe's minute, not after it
        args.ensemble, args.preset, threads, shape = _auto_shape(args, overrides, run_dir, say,
                                                                 choose_device(args.device))
        config = load_config(args.preset, overrides)
    args.preset = args.preset or "multi30k"
    # fail early, before training, if the test set is missing
    test, raw_test = _test_split(args, d)
    if test is None or len(test) == 0:
        raise UserError(f"aiayn pipeline needs a test set: data.dataset={d.dataset!r} names "
                        "none, so give --test-src FILE --test-tgt FILE")
    found_members = members_found(run_dir)
    if args.resume and found_members and args.ensemble != found_members:
        raise UserError(f"{run_dir} holds an ensemble of {found_members} members: resume it "
                        f"with --ensemble {found_members}")
    if not args.resume:  # before a new run writes over the config and vocabulary there
        check_new_run(run_dir, args.ensemble)
    # the run's own keep_last on --resume (its config.json), so a wider average fails now and
    # not after an hour of training
    kept = config.train.keep_last
    if args.resume and RunDir(run_dir).config.is_file():
        kept = load_config(str(RunDir(run_dir).config), overrides).train.keep_last
    widths = list(dict.fromkeys(args.average or [kept]))
    if max(widths) > kept:
        raise UserError(f"--average {max(widths)}: the run keeps only its last {kept} "
                         f"checkpoints (train.keep_last); add --set train.keep_last="
                         f"{max(widths)}")
    device = choose_device(args.device)  # one device for training and decoding
    t0 = time.monotonic()
    say(f"[1/4] training {config.name} ({d.dataset} {d.src_lang}->{d.tgt_lang}) in {run_dir}"
        + (f", an ensemble of {args.ensemble}" if args.ensemble > 1 else ""))
    if args.ensemble > 1:
        members = train_members(config, run_dir, args.ensemble, resume=args.resume,
                                overrides=overrides if args.resume else None,
                                device=args.device, log=say, threads=threads)
        summary = _ensemble_summary(members)
        runs = member_dirs(run_dir, args.ensemble)
    else:
        summary = run_training(None if args.resume else config, run_dir, resume=args.resume,
                               overrides=overrides if args.resume else None,
                               device=str(device), progress=not args.no_progress, log=say)
        members, runs = [], [run_dir]
    if summary["stop_reason"].startswith("signal"):  # Ctrl-C / SIGTERM: stop here
        name = summary["stop_reason"].split()[-1]
        signum = getattr(signal, name, signal.SIGINT)
        at = (", ".join(f"{Path(m['run_dir']).name} at step {m['steps']}" for m in members)
              if members else f"at step {summary['steps']}")
        print(f"aiayn pipeline: training stopped by {name} {at}; the "
              f"checkpoints are in {run_dir}. Continue with: aiayn pipeline --resume --run-dir "
              f"{run_dir} --preset {args.preset}"
              + (f" --ensemble {args.ensemble}" if args.ensemble > 1 else ""), file=sys.stderr)
        return 128 + int(signum)

    dc = config.decode
    from aiayn.data.text import is_protocol_text
    from aiayn.translator import Translator

    trained = (members[0] if members else summary)["precision"]
    say(f"[1/4] trained at precision {trained['chosen']} ({trained['requested']}: "
        f"{trained['reason']})")
    # settings are chosen in fp32; the precision a run records for decoding comes after (see
    # below). bf16 is never recorded: its products are not batch-invariant (on the bf16 class,
    # 12-40 of 1,000 test lines changed with the batch), so a run directory would not give its
    # test output line for line however `aiayn translate` or `serve` batch it. fp32 is; int8
    # (per-row scales, exact integer sums) nearly is: 3 of 1,000 test lines changed between
    # batches of 16 and 128 on round 3's main job, through the float attention around it.
    decode_precision = "fp32"

    lc_tok = is_protocol_text(d.preprocess)  # outputs already in the Multi30k protocol's form
    progress = not args.no_progress and not args.json

    def bleu_of(hyps: list[str], refs: list[str]) -> float:
        """The job's headline BLEU on its own corpus text (:func:`corpus_bleu`'s rule)."""
        return corpus_bleu(hyps, refs, d)["bleu"]

    # §6.2: the weights and alpha are chosen on the whole validation set (aiayn.selection)
    valid = load_split(d, "valid")
    valid = valid if valid is not None and len(valid) else None
    layouts = [RunDir(run) for run in runs]
    # the run's own config (a resumed run may not repeat its --set train.ema_decay)
    ema_decay = load_config(str(layouts[0].config)).train.ema_decay
    options = candidates(layouts, widths, ema_decay, say)
    choice = choose_on_valid(
        layouts, options, args.alphas or [dc.alpha], dc, valid and valid.src,
        lambda hyps: bleu_of(hyps, valid.tgt),
        lambda paths: Translator.from_pretrained(paths, device=device,
                                                 precision=decode_precision, workers="auto"),
        ensemble=bool(members), progress=progress, say=say)
    width, alpha, by_average = choice.weights, choice.alpha, choice.by_average
    chosen = dataclasses.replace(dc, alpha=alpha)
    precision_check = None
    # a run trained in fp32 because its config asked for it decodes in fp32
    # (may_reduce_decoding_precision); the others may take int8
    if valid is not None and device.type == "cpu" and \
            may_reduce_decoding_precision(config.train.precision):
        precision_check = check_reduced_precision(
            Translator.from_pretrained(choice.paths, device=device, precision="fp32",
                                       workers="auto"),
            valid.src, lambda hyps: bleu_of(hyps, valid.tgt), chosen,
            fp32_hyps=choice.val_hyps, progress=progress)
        decode_precision = precision_check["chosen"]
        say(f"[3/4] decoding precision: {precision_check['reason']}")
    # the run directory becomes the model it reports: these members, this search
    record_choice(run_dir, choice, dc, precision=decode_precision, data=d)
    final = Translator.from_pretrained(run_dir, device=device, workers="auto")
    say(f"[3/4] translating {len(test)} test sentences: beam {chosen.beam_size}, alpha {alpha}, "
        f"max length input + {chosen.max_len_b} (the model {run_dir} now loads as)")
    t1 = time.monotonic()
    hyps = final.translate(raw_test.src, progress=not args.no_progress and not args.json)
    decode_s = time.monotonic() - t1
    hyp_path = RunDir(run_dir).test_output(d.tgt_lang)
    write_atomic(hyp_path, "".join(h + "\n" for h in hyps))

    say("[4/4] scoring")
    if lc_tok:  # sacreBLEU's 13a BLEU is meant for detokenized text: chrF only
        chrf, chrf_sig = chrf_score(hyps, test.tgt)
        scores = {"bleu": None, "chrf": chrf, "bleu_signature": None, "chrf_signature": chrf_sig}
    else:
        scores = sacrebleu_scores(hyps, test.tgt)
    results: dict[str, Any] = {
        "dataset": d.dataset, "direction": f"{d.src_lang}-{d.tgt_lang}", "preset": config.name,
        "test_set": (Path(args.test_src).name if args.test_src else
                     "test_2016_flickr" if d.dataset == "multi30k" else "test"),
        "parameters": summary["parameters"], "train_steps": summary["steps"],
        "train_epochs": summary["epochs"], "train_wall_s": round(summary["elapsed_s"], 1),
        "pipeline_wall_s": None, "decode_wall_s": round(decode_s, 1),
        # the share of CPU time the host took during training (Linux; absent elsewhere): runs
        # on a shared machine compare only when this is small
        "train_cpu_steal_pct": summary.get("cpu_steal_pct"),
        "threads": torch.get_num_threads(),
        # train.precision as resolved on this machine (with the probe's figures), and decoding's
        "precision": trained, "decode_precision": final.precision.chosen,
        # val BLEU at the chosen settings in fp32 and in the machine's reduced precision, the
        # share of identical sentences, and which one the run records (and why)
        "decode_precision_check": precision_check, "beam_size": dc.beam_size,
        # --ensemble auto: the shape the throughput probe chose and the figures behind it
        "shape": shape,
        **choice.to_results(run_dir, ensemble=bool(members)),
        # the text the model reads and writes: "none" (cased, detokenized, scored with
        # sacreBLEU) or "lc-norm-tok" (the Multi30k protocol's text, scored as it is)
        "text": d.preprocess, "lr_schedule": config.train.lr_schedule,
        # sacreBLEU's 13a BLEU is a standard figure on cased, detokenized output only
        "sacrebleu_bleu": None if lc_tok else round(scores["bleu"], 2),
        "sacrebleu_chrf": round(scores["chrf"], 2),
        "bleu_signature": scores["bleu_signature"],
        "chrf_signature": scores["chrf_signature"],
        "hypotheses": str(hyp_path), "valid_bleu_greedy_last": summary.get("valid_bleu"),
    }
    if members:  # train_steps is their sum, train_epochs the fewest, threads each one's
        results.update(ensemble=len(members), threads=members[0].get("threads"), members=[
            {k: m.get(k) for k in ("run_dir", "seed", "steps", "epochs", "target_tokens",
                                   "valid_nll", "valid_bleu", "cpu_steal_pct", "precision")}
            for m in members])
    if d.dataset == "multi30k" and not args.test_src:
        ref_tok = _tok_reference(d.dataset, d.tgt_lang)
        if ref_tok is not None:
            refs, ref_name = read_ref_lines(ref_tok), str(ref_tok)
        else:  # the same processing reproduces the shipped tok/ files exactly (tests check it)
            refs = [multi30k_tokenize(r, d.tgt_lang) for r in test.tgt]
            ref_name = "raw reference, lowercased, normalized and Moses-tokenized here"
        results["multi30k_tok_bleu"] = round(
            multi30k_tok_bleu(hyps, refs, d.tgt_lang, pretokenized=lc_tok), 2)
        results["multi30k_tok_reference"] = ref_name
    results["pipeline_wall_s"] = round(time.monotonic() - t0, 1)
    write_results(run_dir, results)
    if members:
        for run in runs:
            plot_run(run)  # each member's own figure
    png = plot_run(run_dir)  # a single run's, or every member's curves in one
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"\nResults on {d.dataset} {results['test_set']} ({d.src_lang}->{d.tgt_lang}), "
          f"{described(width)}, beam {dc.beam_size}, alpha {alpha}:")
    if lc_tok:
        print(f"  text: lowercased, normalized, Moses-tokenized (data.preprocess = lc-norm-tok); "
              f"chrF {results['sacrebleu_chrf']:.2f} on that text")
    else:
        print(f"  sacreBLEU (cased, detokenized)   BLEU {results['sacrebleu_bleu']:.2f}   "
              f"chrF {results['sacrebleu_chrf']:.2f}")
    if "multi30k_tok_bleu" in results:
        print(f"  Multi30k literature protocol     BLEU {results['multi30k_tok_bleu']:.2f}   "
              "(lowercased, normalized, Moses-tokenized)")
    if results["bleu_signature"]:
        print(f"  {results['bleu_signature']}")
    for k, by_alpha in by_average.items():
        print(f"  validation set, same beam, headline protocol, {described(k)}: " + ", ".join(
            f"BLEU {b:.2f} at alpha {a}" for a, b in by_alpha.items()))
    for m in members:
        print(f"  ensemble {Path(m['run_dir']).name} (seed {m['seed']}, "
              f"{m['threads']} thread(s)): {m['steps']} steps, {m['epochs']} epochs, "
              f"val nll {m.get('valid_nll', float('nan')):.3f}")
    print(f"  training {summary['elapsed_s'] / 60:.1f} min, {summary['steps']} steps"
          + (" (all members)" if members else "") + "; "
          f"decoding {decode_s:.0f} s; run directory {run_dir} ({RESULTS}, "
          f"{png.name}, {hyp_path.name}, {GENERATION_CONFIG})")
    print(f"  the run loads as this model: aiayn translate --checkpoint {run_dir}, "
          f"aiayn serve --checkpoint {run_dir}, Translator.from_pretrained({str(run_dir)!r})")
    return 0
