"""The main job as a library function: :func:`run_job` learns the vocabulary, trains (one model
or an ensemble, in a time budget), chooses the weights and the length penalty on the validation
set (§6.1-6.2, :mod:`aiayn.selection`), decides the decoding precision (the int8 fidelity
rule), translates the test set once with the model the run directory now loads as, scores it,
and writes the run's :class:`Results` (``RUN/results.json``) and curves. ``aiayn pipeline``
only parses its arguments into :class:`JobOptions` and prints what comes back.

Example::

    from aiayn.pipeline import JobOptions, run_job

    results = run_job(JobOptions(preset="multi30k", time_budget_min=10, alphas=[0.6, 1.0]))
    print(results.sacrebleu_bleu, results.multi30k_tok_bleu)

The job reports its progress through ``say`` in four stages, ``[1/4]`` training, ``[2/4]``
choosing on the validation set, ``[3/4]`` translating the test set, ``[4/4]`` scoring (and
``[0/4]`` the shape ``--ensemble auto`` measures first).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiayn.errors import UserError

__all__ = ["JobOptions", "Results", "Stopped", "run_job"]

Say = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """What the job is asked to do (``aiayn pipeline``'s options).

    Attributes:
        preset: preset name or config file (default: ``multi30k``; with ``ensemble="auto"``,
            the rule's: :data:`aiayn.budget.MEMBER_PRESET` members or one
            :data:`aiayn.budget.SINGLE_PRESET` model).
        src_lang, tgt_lang: the direction (default: the preset's).
        run_dir: the run directory (default ``runs/<dataset>-<src>-<tgt>``).
        time_budget_min: minutes of training (default: the preset's ``train.time_budget_s``).
        average: the averaging widths tried on val (§6.1; default: ``train.keep_last``).
        alphas: the length penalties tried on val (default: the preset's ``decode.alpha``).
        ensemble: members trained at once (1: one model), or ``"auto"`` (the throughput probe).
        test_src, test_tgt: a test set's files (default: the dataset's own test split).
        overrides: ``--set section.field=value`` strings.
        resume: continue an interrupted run.
        device: "cpu", "cuda" or "cuda:N" (default: cuda where there is one).
        progress: training's progress bar; decode_progress: decoding's.

    Raises:
        UserError: a width or member count below 1; ``test_src`` without ``test_tgt``.
    """

    preset: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    run_dir: str | Path | None = None
    time_budget_min: float | None = None
    average: Sequence[int] | None = None
    alphas: Sequence[float] | None = None
    ensemble: int | str = 1
    test_src: str | None = None
    test_tgt: str | None = None
    overrides: Sequence[str] = ()
    resume: bool = False
    device: str | None = None
    progress: bool = True
    decode_progress: bool = True

    def __post_init__(self) -> None:
        if self.average is not None and min(self.average) < 1:
            raise UserError(f"--average must be at least 1, got {min(self.average)}")
        if self.ensemble != "auto" and (not isinstance(self.ensemble, int) or
                                        self.ensemble < 1):
            raise UserError(f"--ensemble must be at least 1, got {self.ensemble}")
        if bool(self.test_src) != bool(self.test_tgt):
            raise UserError("--test-src and --test-tgt go together")


@dataclasses.dataclass(frozen=True)
class Stopped:
    """Training was stopped by a signal (Ctrl-C, SIGTERM): the checkpoints are in ``run_dir``
    and the job can be resumed (``resume=True`` with the same ``preset`` and ``ensemble``).

    Attributes:
        signal_name: "SIGINT" or "SIGTERM"; signum: its number.
        at: where each run stopped ("at step 120", or each member's).
    """

    signal_name: str
    signum: int
    at: str
    run_dir: Path
    preset: str
    ensemble: int


# results.json keys written only where they apply
_OPTIONAL = ("ensemble", "members", "multi30k_tok_bleu", "multi30k_tok_reference")


@dataclasses.dataclass
class Results:
    """The job's results, ``RUN/results.json`` (:meth:`to_dict`; keys sorted in the file).

    Attributes:
        dataset, direction ("en-de"), preset, test_set: what was trained and tested.
        parameters, train_steps, train_epochs, train_wall_s: training (an ensemble's steps
            summed over its members, its epochs the fewest, its time the longest).
        pipeline_wall_s, decode_wall_s: seconds of the whole job and of the test decode.
        train_cpu_steal_pct: the share of CPU time the host took during training (Linux; None
            elsewhere): runs on a shared machine compare only when this is small.
        threads: torch threads (an ensemble's: each member's).
        precision: ``train.precision`` as resolved on this machine, with the probe's figures.
        decode_precision: the precision the test set was decoded in (the run's record).
        decode_precision_check: val BLEU at the chosen settings in fp32 and in int8, the share
            of identical sentences, and which one the run records and why (None: not checked).
        beam_size: the beam.
        shape: ``--ensemble auto``'s shape and the figures behind it (None otherwise).
        averaged, weights, alpha, valid_bleu_by_alpha, valid_bleu_by_average: the choice on
            val (:meth:`aiayn.selection.Choice.to_results`).
        text: the text the model reads and writes: "none" (cased, detokenized, scored with
            sacreBLEU) or "lc-norm-tok" (the Multi30k protocol's text, scored as it is).
        lr_schedule: ``train.lr_schedule``.
        sacrebleu_bleu: sacreBLEU's 13a BLEU, a standard figure on cased, detokenized output
            only (None on lc-norm-tok text); sacrebleu_chrf: chrF; their signatures.
        hypotheses: the test output file; valid_bleu_greedy_last: training's last val BLEU.
        ensemble, members: an ensemble's size and each member's summary (absent otherwise).
        multi30k_tok_bleu, multi30k_tok_reference: the Multi30k literature protocol's BLEU and
            its reference (absent but on Multi30k's own test set).
    """

    dataset: str
    direction: str
    preset: str
    test_set: str
    parameters: int
    train_steps: int
    train_epochs: float
    train_wall_s: float
    pipeline_wall_s: float | None
    decode_wall_s: float
    train_cpu_steal_pct: float | None
    threads: int | None
    precision: dict[str, Any]
    decode_precision: str
    decode_precision_check: dict[str, Any] | None
    beam_size: int
    shape: dict[str, Any] | None
    averaged: list[str]
    weights: str
    alpha: float
    valid_bleu_by_alpha: dict[str, float]
    valid_bleu_by_average: dict[str, dict[str, float]]
    text: str
    lr_schedule: str
    sacrebleu_bleu: float | None
    sacrebleu_chrf: float
    bleu_signature: str | None
    chrf_signature: str
    hypotheses: str
    valid_bleu_greedy_last: float | None
    ensemble: int | None = None
    members: list[dict[str, Any]] | None = None
    multi30k_tok_bleu: float | None = None
    multi30k_tok_reference: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as ``results.json`` holds it (the optional keys only where they apply)."""
        out = dataclasses.asdict(self)
        for key in _OPTIONAL:
            if out[key] is None:
                del out[key]
        return out

    def to_json(self) -> str:
        """One line of JSON (``aiayn pipeline --json``)."""
        return json.dumps(self.to_dict())

    def describe(self) -> str:
        """The job's closing report in words: test scores, val scores of every candidate,
        each member, the time taken and how the run (the test output's folder) loads."""
        from aiayn.data.text import is_protocol_text
        from aiayn.rundir import CURVES, GENERATION_CONFIG, RESULTS
        from aiayn.selection import described

        run_dir = Path(self.hypotheses).parent

        src, tgt = self.direction.split("-", 1)
        lines = [f"\nResults on {self.dataset} {self.test_set} ({src}->{tgt}), "
                 f"{described(self.weights)}, beam {self.beam_size}, alpha {self.alpha}:"]
        if is_protocol_text(self.text):
            lines.append("  text: lowercased, normalized, Moses-tokenized (data.preprocess = "
                         f"lc-norm-tok); chrF {self.sacrebleu_chrf:.2f} on that text")
        else:
            lines.append(f"  sacreBLEU (cased, detokenized)   BLEU {self.sacrebleu_bleu:.2f}   "
                         f"chrF {self.sacrebleu_chrf:.2f}")
        if self.multi30k_tok_bleu is not None:
            lines.append(f"  Multi30k literature protocol     BLEU {self.multi30k_tok_bleu:.2f}"
                         "   (lowercased, normalized, Moses-tokenized)")
        if self.bleu_signature:
            lines.append(f"  {self.bleu_signature}")
        for k, by_alpha in self.valid_bleu_by_average.items():
            lines.append(f"  validation set, same beam, headline protocol, {described(k)}: "
                         + ", ".join(f"BLEU {b:.2f} at alpha {a}" for a, b in by_alpha.items()))
        for m in self.members or []:
            nll = m.get("valid_nll")
            lines.append(f"  ensemble {Path(m['run_dir']).name} (seed {m['seed']}, "
                         f"{self.threads} thread(s)): {m['steps']} steps, {m['epochs']} epochs, "
                         f"val nll {float('nan') if nll is None else nll:.3f}")
        lines.append(f"  training {self.train_wall_s / 60:.1f} min, {self.train_steps} steps"
                     + (" (all members)" if self.members else "") + "; "
                     f"decoding {self.decode_wall_s:.0f} s; run directory {run_dir} ({RESULTS}, "
                     f"{CURVES}, {Path(self.hypotheses).name}, {GENERATION_CONFIG})")
        lines.append(f"  the run loads as this model: aiayn translate --checkpoint {run_dir}, "
                     f"aiayn serve --checkpoint {run_dir}, "
                     f"Translator.from_pretrained({str(run_dir)!r})")
        return "\n".join(lines)


def _auto_shape(options: JobOptions, overrides: list[str], run_dir: Path, say: Say,
                device: Any) -> tuple[int, str, int | None, dict | None]:
    """``ensemble="auto"``: (members, preset, threads, shape record) for this run. A new run
    learns its vocabulary into a scratch folder, times the candidate shapes
    (:func:`aiayn.training.probe.choose_for_budget`) and writes the choice to the run
    directory; a resumed one keeps the shape it started with. ``overrides`` gets the shape's.

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
    if options.resume:
        n = members_found(run_dir) or 1
        record = read_json_object(layout.shape) if layout.shape.is_file() else None
        preset = options.preset or (MEMBER_PRESET if n > 1 else SINGLE_PRESET)
        return n, preset, None, record
    probe_cfg = load_config(options.preset or MEMBER_PRESET, overrides)
    budget_s = probe_cfg.train.time_budget_s
    if device.type != "cpu":  # the rule's rates and shapes are CPU cores'; a GPU trains one model
        # (a GPU's first updates of each batch shape are many times slower than its steady
        # rate, so a few timed updates would project a fraction of the run: docs/hardware.md)
        preset = options.preset or SINGLE_PRESET
        choice = Choice(1, 0, preset, load_config(preset, overrides).train.warmup_steps, 0, 0.0,
                        f"on {device}: one model (the probe times shapes of CPU cores)")
        say(f"[0/4] {choice.line()}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            learn_vocabulary(load_split(probe_cfg.data, "train"), probe_cfg.data).save(tmp)
            choice = choose_for_budget(overrides, budget_s, tmp,
                                       lambda msg: say(f"[0/4] {msg}"), preset=options.preset)
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


def _test_split(options: JobOptions, d: Any) -> tuple[Any, Any]:
    """The test pairs (as the model reads them, and as distributed): ``test_src`` and
    ``test_tgt`` when given, else the dataset's own test split ((None, None) for none)."""
    from aiayn.data.corpus import load_parallel
    from aiayn.data.splits import load_raw_split, load_split
    from aiayn.data.text import preprocess_corpus

    if options.test_src:
        raw = load_parallel(options.test_src, options.test_tgt)
        return preprocess_corpus(raw, d.src_lang, d.tgt_lang, d.preprocess), raw
    return load_split(d, "test"), load_raw_split(d, "test")


def _tok_reference(dataset: str, tgt_lang: str) -> Path | None:
    """The shipped Multi30k test reference in the literature's tokenized form, if present."""
    from aiayn.data.corpus import data_dir

    root = data_dir()
    if dataset != "multi30k" or root is None:
        return None
    path = root / "multi30k" / "tok" / f"test_2016_flickr.lc.norm.tok.{tgt_lang}.gz"
    return path if path.is_file() else None


def _train(options: JobOptions, config: Any, run_dir: Path, n: int, overrides: list[str],
           threads: int | None, device: Any, say: Say
           ) -> tuple[dict[str, Any], list[dict[str, Any]], list[Path]]:
    """[1/4]: train one model or ``n`` members; (summary, members' summaries, run folders)."""
    from aiayn.training.ensemble import member_dirs, train_members
    from aiayn.training.run import run_training

    d = config.data
    say(f"[1/4] training {config.name} ({d.dataset} {d.src_lang}->{d.tgt_lang}) in {run_dir}"
        + (f", an ensemble of {n}" if n > 1 else ""))
    if n > 1:
        members = train_members(config, run_dir, n, resume=options.resume,
                                overrides=overrides if options.resume else None,
                                device=options.device, log=say, threads=threads)
        return _ensemble_summary(members), members, member_dirs(run_dir, n)
    summary = run_training(None if options.resume else config, run_dir, resume=options.resume,
                           overrides=overrides if options.resume else None,
                           device=str(device), progress=options.progress, log=say)
    return summary, [], [run_dir]


def _scores(hyps: list[str], test: Any, d: Any, lc_tok: bool, test_src: str | None
            ) -> dict[str, Any]:
    """[4/4]: the test scores (the protocol's: chrF alone on lc-norm-tok text, else
    sacreBLEU's BLEU and chrF; on Multi30k's own test set its literature protocol too)."""
    from aiayn.evaluation.bleu import (chrf_score, multi30k_tok_bleu, multi30k_tokenize,
                                       sacrebleu_scores)
    from aiayn.evaluation.bleu import read_lines as read_ref_lines

    if lc_tok:  # sacreBLEU's 13a BLEU is meant for detokenized text: chrF only
        chrf, chrf_sig = chrf_score(hyps, test.tgt)
        scores = {"bleu": None, "chrf": chrf, "bleu_signature": None, "chrf_signature": chrf_sig}
    else:
        scores = sacrebleu_scores(hyps, test.tgt)
    out = {"sacrebleu_bleu": None if lc_tok else round(scores["bleu"], 2),
           "sacrebleu_chrf": round(scores["chrf"], 2),
           "bleu_signature": scores["bleu_signature"],
           "chrf_signature": scores["chrf_signature"]}
    if d.dataset == "multi30k" and not test_src:
        ref_tok = _tok_reference(d.dataset, d.tgt_lang)
        if ref_tok is not None:
            refs, ref_name = read_ref_lines(ref_tok), str(ref_tok)
        else:  # the same processing reproduces the shipped tok/ files exactly (tests check it)
            refs = [multi30k_tokenize(r, d.tgt_lang) for r in test.tgt]
            ref_name = "raw reference, lowercased, normalized and Moses-tokenized here"
        out["multi30k_tok_bleu"] = round(
            multi30k_tok_bleu(hyps, refs, d.tgt_lang, pretokenized=lc_tok), 2)
        out["multi30k_tok_reference"] = ref_name
    return out


def run_job(options: JobOptions, say: Say = print) -> Results | Stopped:
    """Run the main job (see the module's docstring); ``say`` receives its progress.

    Returns:
        The :class:`Results` written to ``RUN/results.json``, or :class:`Stopped` when a
        signal stopped training (nothing after training is done then).

    Raises:
        UserError: bad options or config values (named); no test set; a resume that does not
            match the run; an ``average`` wider than the checkpoints the run keeps.
    """
    import torch

    from aiayn.config import load_config
    from aiayn.data.splits import load_split
    from aiayn.data.text import is_protocol_text
    from aiayn.devices import choose_device
    from aiayn.evaluation.bleu import corpus_bleu
    from aiayn.fileio import write_atomic
    from aiayn.precision import may_reduce_decoding_precision
    from aiayn.rundir import RunDir
    from aiayn.selection import (candidates, check_reduced_precision, choose_on_valid,
                                 record_choice, write_results)
    from aiayn.training.ensemble import check_new_run, members_found
    from aiayn.translator import Translator
    from aiayn.viz.curves import plot_run

    overrides = list(options.overrides)
    if options.src_lang:
        overrides.append(f"data.src_lang={options.src_lang}")
    if options.tgt_lang:
        overrides.append(f"data.tgt_lang={options.tgt_lang}")
    if options.time_budget_min is not None:
        overrides.append(f"train.time_budget_s={options.time_budget_min * 60}")
    config = load_config(options.preset or "multi30k", overrides)
    d = config.data
    run_dir = Path(options.run_dir or f"runs/{d.dataset}-{d.src_lang}-{d.tgt_lang}")
    n, preset, shape, threads = options.ensemble, options.preset, None, None
    if n == "auto":
        if not options.resume:
            check_new_run(run_dir, 2)  # before the probe's minute, not after it
        n, preset, threads, shape = _auto_shape(options, overrides, run_dir, say,
                                                choose_device(options.device))
        config = load_config(preset, overrides)
    preset = preset or "multi30k"
    # fail early, before training, if the test set is missing
    test, raw_test = _test_split(options, d)
    if test is None or len(test) == 0:
        raise UserError(f"aiayn pipeline needs a test set: data.dataset={d.dataset!r} names "
                        "none, so give --test-src FILE --test-tgt FILE")
    found_members = members_found(run_dir)
    if options.resume and found_members and n != found_members:
        raise UserError(f"{run_dir} holds an ensemble of {found_members} members: resume it "
                        f"with --ensemble {found_members}")
    if not options.resume:  # before a new run writes over the config and vocabulary there
        check_new_run(run_dir, n)
    # the run's own keep_last on a resume (its config.json), so a wider average fails now and
    # not after an hour of training
    run = RunDir(run_dir)
    kept = config.train.keep_last
    if options.resume and run.config.is_file():
        kept = load_config(str(run.config), overrides).train.keep_last
    widths = list(dict.fromkeys(options.average or [kept]))
    if max(widths) > kept:
        raise UserError(f"--average {max(widths)}: the run keeps only its last {kept} "
                        f"checkpoints (train.keep_last); add --set train.keep_last="
                        f"{max(widths)}")
    device = choose_device(options.device)  # one device for training and decoding
    t0 = time.monotonic()
    summary, members, runs = _train(options, config, run_dir, n, overrides, threads, device,
                                    say)
    if summary["stop_reason"].startswith("signal"):  # Ctrl-C / SIGTERM: stop here
        name = summary["stop_reason"].split()[-1]
        at = (", ".join(f"{Path(m['run_dir']).name} at step {m['steps']}" for m in members)
              if members else f"at step {summary['steps']}")
        return Stopped(name, int(getattr(signal, name, signal.SIGINT)), at, run_dir, preset, n)

    dc = config.decode
    trained = (members[0] if members else summary)["precision"]
    say(f"[1/4] trained at precision {trained['chosen']} ({trained['requested']}: "
        f"{trained['reason']})")
    # settings are chosen in fp32; the precision a run records for decoding comes after (see
    # below). bf16 is never recorded: its products are not batch-invariant (on the bf16 class,
    # 12-40 of 1,000 test lines changed with the batch), so a run directory would not give its
    # test output line for line however `aiayn translate` or `serve` batch it. fp32 is; int8
    # (per-row scales, exact integer sums) nearly is: 3 of 1,000 test lines changed between
    # batches of 16 and 128 on round 3's main job, through the float attention around it.
    lc_tok = is_protocol_text(d.preprocess)  # outputs already in the Multi30k protocol's form

    def bleu_of(hyps: list[str], refs: list[str]) -> float:
        """The job's headline BLEU on its own corpus text (:func:`corpus_bleu`'s rule)."""
        return corpus_bleu(hyps, refs, d)["bleu"]

    # [2/4] §6.2: the weights and alpha are chosen on the whole validation set
    valid = load_split(d, "valid")
    valid = valid if valid is not None and len(valid) else None
    layouts = [RunDir(r) for r in runs]
    # the run's own config (a resumed run may not repeat its --set train.ema_decay)
    ema_decay = load_config(str(layouts[0].config)).train.ema_decay
    choosing = lambda msg: say(f"[2/4] {msg}")  # noqa: E731
    options_tried = candidates(layouts, widths, ema_decay, choosing)
    choice = choose_on_valid(
        layouts, options_tried, options.alphas or [dc.alpha], dc, valid and valid.src,
        lambda hyps: bleu_of(hyps, valid.tgt),
        lambda paths: Translator.from_pretrained(paths, device=device, precision="fp32",
                                                 workers="auto"),
        ensemble=bool(members), progress=options.decode_progress, say=choosing)
    chosen = dataclasses.replace(dc, alpha=choice.alpha)
    decode_precision, precision_check = "fp32", None
    # a run trained in fp32 because its config asked for it decodes in fp32
    # (may_reduce_decoding_precision); the others may take int8
    if valid is not None and device.type == "cpu" and \
            may_reduce_decoding_precision(config.train.precision):
        precision_check = check_reduced_precision(
            Translator.from_pretrained(choice.paths, device=device, precision="fp32",
                                       workers="auto"),
            valid.src, lambda hyps: bleu_of(hyps, valid.tgt), chosen,
            fp32_hyps=choice.val_hyps, progress=options.decode_progress)
        decode_precision = precision_check["chosen"]
        say(f"[3/4] decoding precision: {precision_check['reason']}")
    # the output/input length ratios of val's references bound the length_ratio flag
    # (aiayn.decoding.quality); they travel with the model in its record
    length_range = None
    if valid is not None:
        from aiayn.data.vocab import Vocabulary
        from aiayn.decoding.quality import length_ratio_range

        length_range = length_ratio_range(Vocabulary.load(choice.paths[0]), valid.src,
                                          valid.tgt)
    # the run directory becomes the model it reports: these members, this search
    record_choice(run_dir, choice, dc, precision=decode_precision, data=d,
                  length_range=length_range)

    # [3/4] the test set, once, with the model the run directory now loads as
    final = Translator.from_pretrained(run_dir, device=device, workers="auto")
    say(f"[3/4] translating {len(test)} test sentences: beam {chosen.beam_size}, alpha "
        f"{choice.alpha}, max length input + {chosen.max_len_b} (the model {run_dir} now "
        "loads as)")
    t1 = time.monotonic()
    hyps = final.translate(raw_test.src, progress=options.decode_progress)
    decode_s = time.monotonic() - t1
    hyp_path = run.test_output(d.tgt_lang)
    write_atomic(hyp_path, "".join(h + "\n" for h in hyps))

    say("[4/4] scoring")
    scores = _scores(hyps, test, d, lc_tok, options.test_src)
    tok = {k: scores.pop(k) for k in ("multi30k_tok_bleu", "multi30k_tok_reference")
           if k in scores}
    results = Results(
        dataset=d.dataset, direction=f"{d.src_lang}-{d.tgt_lang}", preset=config.name,
        test_set=(Path(options.test_src).name if options.test_src else
                  "test_2016_flickr" if d.dataset == "multi30k" else "test"),
        parameters=summary["parameters"], train_steps=summary["steps"],
        train_epochs=summary["epochs"], train_wall_s=round(summary["elapsed_s"], 1),
        pipeline_wall_s=None, decode_wall_s=round(decode_s, 1),
        train_cpu_steal_pct=summary.get("cpu_steal_pct"),
        threads=members[0].get("threads") if members else torch.get_num_threads(),
        precision=trained, decode_precision=final.precision.chosen,
        decode_precision_check=precision_check, beam_size=dc.beam_size, shape=shape,
        **choice.to_results(run_dir, ensemble=bool(members)),
        text=d.preprocess, lr_schedule=config.train.lr_schedule, **scores,
        hypotheses=str(hyp_path), valid_bleu_greedy_last=summary.get("valid_bleu"),
        # an ensemble's train_steps is its members' sum, train_epochs the fewest
        ensemble=len(members) if members else None,
        members=[{k: m.get(k) for k in ("run_dir", "seed", "steps", "epochs", "target_tokens",
                                        "valid_nll", "valid_bleu", "cpu_steal_pct",
                                        "precision")}
                 for m in members] or None,
        **tok)
    results.pipeline_wall_s = round(time.monotonic() - t0, 1)
    write_results(run_dir, results.to_dict())
    for r in runs if members else []:
        plot_run(r)  # each member's own figure
    plot_run(run_dir)  # a single run's, or every member's curves in one
    return results
