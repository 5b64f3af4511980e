"""The throughput probe of the main job (issue 57): a few real updates of each candidate shape on
the machine at hand, before the budget's clock starts, so that :func:`aiayn.budget.choose_shape`
picks the shape from measured rates and not from the machine the recipe was tuned on.

Each shape is timed in its own processes, as it would train: one model over all the cores
(``SINGLE_PRESET``), and two models at once on half the cores each (``MEMBER_PRESET``, both
processes timed together, so that they share the caches and memory bandwidth as members do).
A process times :meth:`aiayn.training.update.Learner.update` on the run's own batches, in the
precision the run would choose (``train.precision``), after a few untimed updates that build the
batch shapes' kernels.

``python -m aiayn.training.probe --config C.json --vocab DIR --threads T`` is one such process;
it prints one JSON object (``updates_per_s``, ``tokens_per_update``, ``corpus_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiayn.budget import (MEMBER_PRESET, SINGLE_PRESET, Candidate, Choice, choose_shape,
                          default_choice)
from aiayn.config import Config, load_config

#: untimed updates first (each new batch shape builds its oneDNN kernels), then timed ones
WARM_UPDATES = 3
TIMED_UPDATES = 8
#: a probe process that takes longer than this has failed (the default shape is used)
PROBE_TIMEOUT_S = 300


def measure(config: Config, vocab_dir: str | Path, threads: int, warm: int = WARM_UPDATES,
            timed: int = TIMED_UPDATES) -> dict[str, float]:
    """Time ``timed`` updates of ``config`` on ``threads`` CPU threads, after ``warm``.

    Returns:
        ``updates_per_s`` (updates a second), ``tokens_per_update`` (target tokens an update,
        padding excluded), ``corpus_tokens`` (target tokens of one epoch of the kept pairs),
        ``precision`` (the one the run would train in).

    Raises:
        UserError: the training data cannot be read (see :func:`aiayn.data.splits.load_split`).
    """
    import torch

    from aiayn.data.batching import encode_corpus
    from aiayn.data.splits import load_split
    from aiayn.data.vocab import Vocabulary
    from aiayn.training.loop import Trainer
    from aiayn.training.run import prepare_training_process, sized_to

    torch.set_num_threads(threads)
    device = torch.device("cpu")
    prepare_training_process(device)
    vocab = Vocabulary.load(vocab_dir)
    enc = encode_corpus(vocab, load_split(config.data, "train"), config.data.max_len)
    config = sized_to(config, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(config, tmp, vocab, enc, device=device, progress=False)
        for _ in range(warm):
            trainer.learner.update(trainer.next_batches())
        tokens, t0 = 0.0, time.perf_counter()
        for _ in range(timed):
            tokens += trainer.learner.update(trainer.next_batches())["tokens"]
        seconds = time.perf_counter() - t0
        precision = trainer.precision.chosen
    return {"updates_per_s": timed / seconds, "tokens_per_update": tokens / timed,
            "corpus_tokens": int(enc.tgt_lengths().sum()), "precision": precision}


def _spawn(config: Config, vocab_dir: Path, threads: int, work: Path, name: str,
           timed: int) -> subprocess.Popen:
    path = work / f"{name}.json"
    path.write_text(json.dumps(config.to_dict()), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return subprocess.Popen(
        [sys.executable, "-m", "aiayn.training.probe", "--config", str(path), "--vocab",
         str(vocab_dir), "--threads", str(threads), "--timed", str(timed)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(procs: list[subprocess.Popen]) -> list[dict[str, float]]:
    out = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise RuntimeError(f"a probe process ran past {PROBE_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            last = (stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"a probe process failed ({last})")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def available_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def choose_for_budget(overrides: list[str], budget_s: float, vocab_dir: str | Path,
                      log: Callable[[str], None], *, preset: str | None = None,
                      cores: int | None = None, timed: int = TIMED_UPDATES) -> Choice:
    """Measure the candidate shapes and choose one for ``budget_s`` seconds
    (:func:`aiayn.budget.choose_shape`).

    Args:
        overrides: the run's ``--set`` values (applied to every candidate's preset).
        budget_s: the training budget, seconds per member.
        vocab_dir: the run's vocabulary (learned once, before the probe).
        log: where the figures are said.
        preset: the user's ``--preset``: then both shapes train it; default the rule's pair
            (:data:`~aiayn.budget.MEMBER_PRESET` members, :data:`~aiayn.budget.SINGLE_PRESET`
            alone).
        cores: the cores to share out (default: those this process may use); with one core
            only the single model is measured.

    Returns:
        the :class:`~aiayn.budget.Choice`; :func:`~aiayn.budget.default_choice` (said in its
        ``reason``) when a probe process cannot run.

    Raises:
        ConfigError: the budget is too short for any model (the message gives the minimum).
    """
    cores = cores or available_cores()
    single_cfg = load_config(preset or SINGLE_PRESET, overrides)
    member_cfg = load_config(preset or MEMBER_PRESET, overrides)
    preset_warmup = member_cfg.train.warmup_steps
    vocab_dir = Path(vocab_dir)
    log(f"probe: timing {timed} updates of each shape on {cores} core(s) before the budget "
        "starts")
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (single,) = _collect([_spawn(single_cfg, vocab_dir, cores, work, "single", timed)])
            # the preset as the user named it (a config file stays that file, not its name)
            candidates = [Candidate(1, cores, preset or SINGLE_PRESET, single["updates_per_s"],
                                    single["tokens_per_update"])]
            if cores >= 2:
                half = cores // 2
                pair = _collect([_spawn(member_cfg, vocab_dir, half, work, f"member{k}", timed)
                                 for k in (1, 2)])
                rate = min(p["updates_per_s"] for p in pair)  # the slower member sets the pace
                candidates.append(Candidate(2, half, preset or MEMBER_PRESET, rate,
                                            sum(p["tokens_per_update"] for p in pair) / 2))
    except (RuntimeError, OSError, ValueError) as err:
        choice = default_choice(cores, str(err), preset_warmup)
        log(f"probe: {choice.line()}")
        return choice
    for c in candidates:
        log(f"probe: {c.members} × {c.threads} thread(s) of {c.preset}: "
            f"{c.updates_per_s:.2f} updates/s a model, {c.tokens_per_update:,.0f} target tokens "
            "an update")
    choice = choose_shape(candidates, budget_s, int(single["corpus_tokens"]), preset_warmup)
    log(f"probe ({time.monotonic() - t0:.0f} s, precision {single['precision']}): "
        f"{choice.line()}")
    return choice


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiayn.training.probe",
                                description="Time a few training updates of one config; print "
                                            "one JSON object.")
    p.add_argument("--config", required=True, help="a config file (JSON or TOML) or preset")
    p.add_argument("--vocab", required=True, help="the vocabulary folder")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--timed", type=int, default=TIMED_UPDATES)
    p.add_argument("--warm", type=int, default=WARM_UPDATES)
    args = p.parse_args(argv)
    result: dict[str, Any] = measure(load_config(args.config), args.vocab, args.threads,
                                     args.warm, args.timed)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
