"""Choosing a trained run's model on the validation set, and recording it (§6.1-6.2).

§6.2's rule: settings are chosen on the development set, never on the test set. A finished run
offers candidate weights, the last K step checkpoints averaged (§6.1) for each K tried, and
the moving average of the weights (``ema``) where the run kept one; each is decoded on the
whole validation set with beam search at each length penalty alpha tried, scored with the
run's BLEU (:func:`aiayn.evaluation.bleu.corpus_bleu`), and the best pair wins (ties go to the
first tried). Then:

- :func:`check_reduced_precision`, the int8 fidelity rule: int8 becomes the run's decoding
  precision only where it keeps val BLEU within :data:`REDUCED_PRECISION_MAX_BLEU_LOSS` of
  fp32 and is faster on this machine;
- :func:`record_choice` writes the run's generation record (:data:`aiayn.rundir.
  GENERATION_CONFIG`), so that the run directory loads as the chosen model;
- :func:`write_results` writes the job's ``results.json``.

The job (:func:`aiayn.pipeline.run_job`) calls these in a few lines, and reports their
progress (``say``) under its own stage; so can any script.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiayn.config import DecodeConfig
from aiayn.fileio import write_json_atomic
from aiayn.rundir import EMA, RunDir, is_checkpoint

__all__ = ["REDUCED_PRECISION_MAX_BLEU_LOSS", "Choice", "candidates", "candidate_model",
           "check_reduced_precision", "choose_on_valid", "described", "record_choice",
           "write_results"]

# a reduced decoding precision becomes the run's default only if its val BLEU, at the chosen
# settings, stays within this many points of fp32's (#45)
REDUCED_PRECISION_MAX_BLEU_LOSS = 0.2


def described(candidate: int | str) -> str:
    """How a candidate is named: an averaging width, or "ema"."""
    return "the moving average of the weights" if candidate == EMA \
        else f"the last {candidate} checkpoints averaged"


def candidates(runs: Sequence[RunDir], widths: Sequence[int], ema_decay: float,
               say: Callable[[str], None] = lambda _m: None) -> list[int | str]:
    """The candidates to score on val: each averaging width in ``widths`` that averages other
    checkpoints than an earlier one (a width past the checkpoints a short run saved averages the
    same ones as a narrower width: scored once, under the first given), then ``"ema"`` when
    ``ema_decay > 0`` and every run holds its moving average."""
    saved = [len(run.steps()) for run in runs]
    chosen: list[int | str] = []
    first_of: dict[tuple[int, ...], int] = {}
    for k in widths:
        same = tuple(min(k, n) for n in saved)  # how many checkpoints each run would average
        if same in first_of:
            say(f"--average {k}: the run saved {max(saved)} checkpoints, the same as "
                f"--average {first_of[same]}; scored once")
            continue
        first_of[same] = k
        chosen.append(k)
    if ema_decay > 0 and all(is_checkpoint(run.ema) for run in runs):
        chosen.append(EMA)
    return chosen


def candidate_model(runs: Sequence[RunDir], k: int | str, *, ensemble: bool = False,
                    say: Callable[[str], None] = lambda _m: None
                    ) -> tuple[list[Path], list[Path]]:
    """The folders of candidate ``k`` for each run (one, or each ensemble member): the last
    ``k`` step checkpoints averaged into the run's ``averaged`` folder, or (``k = "ema"``) the
    run's moving average. Returns (the checkpoints it is made of, the folders to decode)."""
    from aiayn.training.average import average_checkpoints

    found, paths = [], []
    for run in runs:
        if k == EMA:
            say(f"the moving average of the weights: {run.ema}")
            found.append(run.ema)
            paths.append(run.ema)
            continue
        last = run.steps()[-k:]
        say(f"averaging the last {len(last)} checkpoints (§6.1)"
            + (f" of {run.path.name}" if ensemble else "") + f": "
            f"{', '.join(p.name for p in last)}")
        found += last
        paths.append(average_checkpoints(last, run.averaged))
    return found, paths


@dataclasses.dataclass
class Choice:
    """What :func:`choose_on_valid` chose.

    Attributes:
        weights: the averaging width, or "ema".
        alpha: the length penalty.
        found: the checkpoints the chosen weights are made of.
        paths: the folders that decode as the model (one per run).
        by_average: val BLEU of every candidate at every alpha, ``{"5": {"0.6": 25.1}}``.
        val_hyps: the chosen model's val output at ``alpha`` (fp32), or None without val.
    """

    weights: int | str
    alpha: float
    found: list[Path]
    paths: list[Path]
    by_average: dict[str, dict[str, float]]
    val_hyps: list[str] | None

    @property
    def valid_bleu(self) -> dict[str, float]:
        """Val BLEU of the chosen weights at each alpha ({} without val)."""
        return self.by_average.get(str(self.weights), {})

    def to_results(self, run_dir: str | Path, *, ensemble: bool = False) -> dict[str, Any]:
        """The choice's fields of the job's results record (``results.json``)."""
        run_dir = Path(run_dir)
        return {
            "averaged": [str(p.relative_to(run_dir)) if ensemble else p.name
                         for p in self.found],
            # "ema" when the moving average of the weights won on val, else the width
            "weights": str(self.weights), "alpha": self.alpha,
            # beam-search BLEU on the whole validation set at each alpha tried (the run's
            # protocol, bleu_protocol), the test set translated once with the best
            "valid_bleu_by_alpha": self.valid_bleu,
            # the same for every candidate tried ({"5": {"0.6": ...}}, and "ema" for the
            # moving average of the weights), the chosen one above
            "valid_bleu_by_average": self.by_average,
        }


def choose_on_valid(runs: Sequence[RunDir], options: Sequence[int | str],
                    alphas: Sequence[float], decode: DecodeConfig,
                    valid_src: list[str] | None, bleu: Callable[[list[str]], float],
                    translator_of: Callable[[list[Path]], Any], *, ensemble: bool = False,
                    progress: bool = False, say: Callable[[str], None] = lambda _m: None
                    ) -> Choice:
    """Score every candidate in ``options`` at every alpha on the validation sentences with
    beam search (``decode``'s other settings) and return the best (ties: the first given).
    Without val sentences the first candidate and ``decode.alpha`` are chosen. The chosen
    weights are left in their folder (``averaged`` is averaged again when another width was
    tried last).

    Args:
        valid_src: val sentences in the model's text, or None.
        bleu: val hypotheses -> BLEU (the run's protocol, against the val references).
        translator_of: folders -> a :class:`aiayn.Translator` decoding them together
            (the precision settings are chosen in: fp32).
    """
    by_average: dict[str, dict[str, float]] = {}
    hyps: dict[tuple[str, str], list[str]] = {}
    made: dict[str, tuple[list[Path], list[Path]]] = {}
    weights, alpha = options[0], decode.alpha
    if valid_src:
        for k in options:
            made[str(k)] = candidate_model(runs, k, ensemble=ensemble, say=say)
            translator = translator_of(made[str(k)][1])
            say(f"translating {len(valid_src)} validation sentences: beam "
                f"{decode.beam_size}, alpha {', '.join(map(str, alphas))}")
            scores = by_average[str(k)] = {}
            for a in alphas:
                search = dataclasses.asdict(dataclasses.replace(decode, alpha=a))
                hyps[(str(k), str(a))] = translator.translate(
                    valid_src, preprocessed=True, progress=progress, **search)
                scores[str(a)] = round(bleu(hyps[(str(k), str(a))]), 2)
                say(f"  val BLEU, {described(k)}, alpha {a}: {scores[str(a)]:.2f}")
        weights, alpha = max(((k, a) for k in options for a in alphas),
                             key=lambda ka: by_average[str(ka[0])][str(ka[1])])
    if valid_src and weights == options[-1]:  # on disk as it was scored
        found, paths = made[str(weights)]
    else:  # averaged again: each width writes the same `averaged` folder
        found, paths = candidate_model(runs, weights, ensemble=ensemble, say=say)
    return Choice(weights, alpha, found, paths, by_average, hyps.get((str(weights), str(alpha))))


def check_reduced_precision(translator, sources: list[str], bleu, decode, *,
                            fp32_hyps: list[str] | None = None,
                            progress: bool = False) -> dict[str, Any]:
    """Whether the run may decode in int8 by default: val BLEU at ``decode`` in fp32 and in
    int8 (:func:`aiayn.model.quantize.quantize_int8`), on the members ``translator`` holds.

    int8 is chosen only where it loses at most :data:`REDUCED_PRECISION_MAX_BLEU_LOSS` BLEU and
    decoding's ``auto`` (:func:`~aiayn.precision.choose_precision`, which times a decoder
    step: :func:`aiayn.precision.probe_int8_step`) picks int8 on this machine. bf16 is never
    recorded, however fast: it is not batch-invariant.

    Args:
        translator: the chosen members, at any precision (their float weights are used).
        sources: val sentences, the model's text; bleu: hypotheses -> BLEU.
        fp32_hyps: the fp32 output of ``sources`` at ``decode``, when the caller has it
            (:attr:`Choice.val_hyps`); else decoded here.

    Returns:
        ``{"chosen": "fp32"|"int8", "reason", "fp32": BLEU, "int8": BLEU or None,
        "identical": share of sentences int8 decodes as fp32 does, "auto": what the probe
        chose}``.
    """
    from aiayn.precision import choose_precision
    from aiayn.translator import Translator

    search = dataclasses.asdict(decode)
    auto = choose_precision("auto", translator.device, translator.config.model,
                            training=False)
    outputs = {} if fp32_hyps is None else {"fp32": fp32_hyps}
    for precision in ("fp32", "int8"):
        if precision not in outputs:
            t = Translator(translator.models, translator.vocab, config=translator.config,
                           decode=decode, device=translator.device, precision=precision,
                           workers=translator.workers)
            outputs[precision] = t.translate(sources, preprocessed=True, progress=progress,
                                             **search)
    scores = {precision: round(bleu(hyps), 2) for precision, hyps in outputs.items()}
    same = sum(a == b for a, b in zip(outputs["fp32"], outputs["int8"])) / max(1, len(sources))
    loss = scores["fp32"] - scores["int8"]
    fast = auto.uses_int8  # the one rule, choose_precision's: int8 first where it is faster
    ok = loss <= REDUCED_PRECISION_MAX_BLEU_LOSS
    chosen = "int8" if ok and fast else "fp32"
    why = (f"val BLEU fp32 {scores['fp32']:.2f}, int8 {scores['int8']:.2f} "
           f"({same:.1%} of sentences identical); ")
    if chosen == "int8":
        why += f"int8 is within {REDUCED_PRECISION_MAX_BLEU_LOSS} BLEU and faster here"
    elif not ok:
        why += f"int8 loses more than {REDUCED_PRECISION_MAX_BLEU_LOSS} BLEU: fp32"
    else:
        why += f"int8 is not faster on this machine ({auto.reason}): fp32"
    return {"chosen": chosen, "reason": why, "fp32": scores["fp32"], "int8": scores["int8"],
            "identical": round(same, 4), "auto": auto.to_dict()}


def record_choice(run_dir: str | Path, choice: Choice, decode: DecodeConfig, *,
                  precision: str, data, length_range=None) -> Path:
    """Write the run's generation record: the run directory becomes the chosen model (its
    folders, ``decode`` with the chosen alpha, the decoding ``precision``), with its val BLEU
    and that BLEU's protocol (:func:`aiayn.evaluation.bleu.bleu_protocol` of ``data``, the
    run's DataConfig), and ``length_range`` (a :class:`aiayn.decoding.quality.LengthRange`
    made on val, the ``length_ratio`` flag's bounds) where given. Returns the file written."""
    from aiayn.evaluation.bleu import PROTOCOLS, bleu_protocol

    from aiayn.model.kernels import build_record

    run = RunDir(run_dir)
    return run.write_generation(
        choice.paths, dataclasses.replace(decode, alpha=choice.alpha), precision=precision,
        machine=build_record(),  # what decides int8's numbers here (docs/hardware.md)
        weights=str(choice.weights),
        averaged=[str(p.relative_to(run.path)) for p in choice.found],
        valid_bleu=choice.valid_bleu.get(str(choice.alpha)),
        valid_protocol=PROTOCOLS[bleu_protocol(data)],
        **({} if length_range is None else {"length_ratio": length_range.to_record()}))


def write_results(run_dir: str | Path, results: dict[str, Any]) -> Path:
    """Write the job's results record, ``results.json`` in the run directory (atomically)."""
    path = RunDir(run_dir).results
    write_json_atomic(path, results)
    return path
