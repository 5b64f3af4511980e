"""Table 3 (§6.2): every model variation of the paper, scaled to any base preset, trained for
the same time budget each and scored on the dev set as the paper did (beam 4, alpha 0.6, no
checkpoint averaging; perplexity per subword). Dev BLEU is the corpus's own protocol
(:func:`aiayn.evaluation.bleu.corpus_bleu`: the Multi30k protocol on Multi30k, else sacreBLEU).

Scaling rule: a row changes the base preset the way the paper's row changes the paper's base.
A changed number is multiplied by (paper row value / paper base value), rounded for integers
(at least 1); 0 stays 0. Rows (A) and the d_model rows of (C) keep h · d_k = d_model, as the
paper did, so there d_k = d_v = d_model / h. Scaling the paper's own base reproduces the
``table3-*`` presets exactly (the tests check every cell).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiayn.config import Config
from aiayn.fileio import save_with
from aiayn.rundir import TOKENIZER
from aiayn.errors import ConfigError

# The paper's base row and each variation's changes, as Table 3 prints them.
PAPER_BASE: dict[str, Any] = {"N": 6, "d_model": 512, "d_ff": 2048, "h": 8, "d_k": 64,
                              "d_v": 64, "P_drop": 0.1, "epsilon_ls": 0.1,
                              "positional": "sinusoidal"}
PAPER_ROWS: dict[str, dict[str, Any]] = {
    "base": {},
    "A1": {"h": 1}, "A2": {"h": 4}, "A3": {"h": 16}, "A4": {"h": 32},
    "B1": {"d_k": 16}, "B2": {"d_k": 32},
    "C1": {"N": 2}, "C2": {"N": 4}, "C3": {"N": 8},
    "C4": {"d_model": 256}, "C5": {"d_model": 1024}, "C6": {"d_ff": 1024}, "C7": {"d_ff": 4096},
    "D1": {"P_drop": 0.0}, "D2": {"P_drop": 0.2}, "D3": {"epsilon_ls": 0.0},
    "D4": {"epsilon_ls": 0.2},
    "E": {"positional": "learned"},
}
# Rows where the paper keeps h · d_k = d_model (so d_k = d_v = d_model / h).
CONSTANT_COMPUTE = {"A1", "A2", "A3", "A4", "C4", "C5"}
# Not in the paper's table: restricted self-attention (§4) with window r, everything else base.
RESTRICTED = "R"
ROW_NAMES = [*PAPER_ROWS, RESTRICTED]
# The paper's dev figures (newstest2013, EN-DE, 100K steps on 8 P100s) and parameters (×10^6).
PAPER_RESULTS: dict[str, tuple[float, float, int | None]] = {
    "base": (4.92, 25.8, 65), "A1": (5.29, 24.9, None), "A2": (5.00, 25.5, None),
    "A3": (4.91, 25.8, None), "A4": (5.01, 25.4, None), "B1": (5.16, 25.1, 58),
    "B2": (5.01, 25.4, 60), "C1": (6.11, 23.7, 36), "C2": (5.19, 25.3, 50),
    "C3": (4.88, 25.5, 80), "C4": (5.75, 24.5, 28), "C5": (4.66, 26.0, 168),
    "C6": (5.12, 25.4, 53), "C7": (4.75, 26.2, 90), "D1": (5.77, 24.6, None),
    "D2": (4.95, 25.5, None), "D3": (4.67, 25.3, None), "D4": (5.47, 25.7, None),
    "E": (4.92, 25.7, None),
}
COLUMNS = ("N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "epsilon_ls", "positional")


def parse_rows(text: str) -> list[str]:
    """``"base,A1,R"`` -> ["base", "A1", "R"]; "all" is every row, R (restricted) included.

    Raises:
        ValueError: an unknown row, naming the known ones.
    """
    if text.strip() == "all":
        return list(ROW_NAMES)
    rows = [r.strip() for r in text.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROW_NAMES]
    if bad or not rows:
        raise ConfigError(f"unknown Table 3 row(s) {bad or text!r}; known: {', '.join(ROW_NAMES)}")
    return rows


def _scale(name: str, paper_value: Any, base_value: Any) -> Any:
    if isinstance(paper_value, str):
        return paper_value
    if paper_value == 0:
        return type(base_value)(0)
    value = base_value * paper_value / PAPER_BASE[name]
    return max(1, round(value)) if isinstance(base_value, int) else round(value, 6)


def scale_row(base: Config, row: str, window: int = 4) -> Config:
    """The config of Table 3 row ``row`` relative to ``base`` (see the module docstring).

    Args:
        base: the preset playing the paper's base row.
        row: "base", "A1" … "E", or "R" (restricted self-attention with ``window``).
        window: r for row R, positions on either side.

    Raises:
        ValueError: an unknown row, or a scaled h that does not divide d_model.
    """
    if row not in ROW_NAMES:
        raise ConfigError(f"unknown Table 3 row {row!r}; known: {', '.join(ROW_NAMES)}")
    model = dataclasses.asdict(base.model)
    train = dataclasses.asdict(base.train)
    if row == RESTRICTED:
        model["attention_window"] = window
    for name, paper_value in PAPER_ROWS.get(row, {}).items():
        section = train if name == "epsilon_ls" else model
        section[name] = _scale(name, paper_value, section[name])
    if row in CONSTANT_COMPUTE:
        if model["d_model"] % model["h"]:
            raise ValueError(f"Table 3 row {row}: h={model['h']} does not divide "
                             f"d_model={model['d_model']}")
        model["d_k"] = model["d_v"] = model["d_model"] // model["h"]
    return base.replace(name=f"table3-{row}@{base.name}",
                        model=type(base.model)(**model), train=type(base.train)(**train))


SEED_SUFFIX = "-seed"  # job "base-seed2": the base row again, with train.seed + 1


def job_names(rows: list[str], base_seeds: int = 1) -> list[str]:
    """The trainings a table needs: each row once, and the base row ``base_seeds`` times
    (``base``, ``base-seed2``, ``base-seed3`` …: train.seed, seed + 1, …), so its spread over
    seeds can be measured.

    Raises:
        ValueError: ``base_seeds`` below 1, or above 1 without the base row.
    """
    if base_seeds < 1:
        raise ConfigError(f"base seeds must be at least 1, got {base_seeds}")
    if base_seeds > 1 and "base" not in rows:
        raise ConfigError("several base seeds need the base row among the rows")
    jobs = []
    for row in rows:
        jobs.append(row)
        if row == "base":
            jobs += [f"base{SEED_SUFFIX}{k}" for k in range(2, base_seeds + 1)]
    return jobs


def job_config(base: Config, job: str, window: int = 4) -> Config:
    """The config of one job of :func:`job_names`: its row's (:func:`scale_row`), with the seed
    moved on for a repeated base row."""
    row, _, k = job.partition(SEED_SUFFIX)
    config = scale_row(base, row, window)
    if k:
        config = config.with_overrides([f"train.seed={base.train.seed + int(k) - 1}"])
    return config


def prepare_table3(base: Config, out_dir: str | Path,
                   log: Callable[[str], None] = print) -> Path:
    """``out_dir/vocab``: the one vocabulary every row shares, learned from the base preset's
    training data unless it is there already. Returns its folder."""
    from aiayn.data.vocab import learn_vocabulary
    from aiayn.data.splits import load_split

    vocab_dir = Path(out_dir) / "vocab"
    if not (vocab_dir / TOKENIZER).is_file():
        log(f"table3: learning a {base.data.vocab_size}-token {base.data.vocab_kind} vocabulary")
        train = load_split(base.data, "train")  # its first train_limit pairs when set
        learn_vocabulary(train, base.data).save(vocab_dir)
    return vocab_dir


def row_warmup_steps(base: Config, minutes: float) -> int:
    """The warmup every row gets: the base preset's ``train.warmup_steps`` scaled to the row's
    budget, so warmup takes the same share of ``minutes`` as of the preset's
    ``train.time_budget_s`` (at least 1); unchanged for a preset without a time budget.

    Without it, a 10-minute row of the hour-long ``multi30k`` preset would spend its whole run
    in the preset's 1,600-step warmup, and rows would be ranked by how many updates they fit
    before the learning rate peaked rather than by their architecture.
    """
    tc = base.train
    if tc.time_budget_s <= 0:
        return tc.warmup_steps
    return max(1, round(tc.warmup_steps * minutes * 60 / tc.time_budget_s))


def row_cells(config: Config) -> dict[str, Any]:
    m = config.model
    cells = {k: getattr(m, k) for k in COLUMNS if k != "epsilon_ls"}
    cells["epsilon_ls"] = config.train.epsilon_ls
    cells["attention_window"] = m.attention_window
    return cells


# --- running ----------------------------------------------------------------------------------

def run_table3(
    base: Config,
    out_dir: str | Path,
    rows: list[str],
    *,
    minutes_per_row: float,
    window: int = 4,
    dev_sentences: int = 0,
    base_seeds: int = 1,
    only: list[str] | None = None,
    device: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Train and score each job of :func:`job_names` into ``out_dir/rows/JOB``; resumable.

    A signal (Ctrl-C, SIGTERM) stops the row in training with a checkpoint, and the table
    with it: the row is not scored, and :class:`KeyboardInterrupt` is raised.

    A job with ``row.json`` is done and not run again; a job with checkpoints but no
    ``row.json`` was interrupted and continues from its newest checkpoint. One vocabulary,
    learned once from the base preset's training data (:func:`prepare_table3`), serves every
    row. ``only``: run just these jobs (one process of several running a table at once).

    Returns:
        One result dict per job run or found (the cells, steps, minutes, dev_ppl, dev_bleu,
        parameters, seed).
    """
    from aiayn.checkpoint import list_checkpoints, write_json_atomic
    from aiayn.data.splits import load_split

    out_dir = Path(out_dir)
    (out_dir / "rows").mkdir(parents=True, exist_ok=True)
    jobs = job_names(rows, base_seeds)
    if only is not None:
        jobs = [j for j in jobs if j in only]
    configs = {job: job_config(base, job, window) for job in jobs}  # fail before any training
    vocab_dir = prepare_table3(base, out_dir, log)
    log(f"table3: {minutes_per_row:g} min per row, warmup "
        f"{row_warmup_steps(base, minutes_per_row)} updates "
        f"(the preset's {base.train.warmup_steps} scaled to the row's budget)")
    valid = load_split(base.data, "valid")
    if valid is None:
        raise ValueError("table3 needs a validation set (data.valid_src / data.valid_tgt)")
    if dev_sentences:
        valid = type(valid)(valid.src[:dev_sentences], valid.tgt[:dev_sentences], valid.name,
                            valid.dropped_empty)
    results = []
    for i, job in enumerate(jobs, 1):
        row_dir = out_dir / "rows" / job
        done = row_dir / "row.json"
        if done.is_file():
            results.append(json.loads(done.read_text(encoding="utf-8")))
            log(f"table3: [{i}/{len(jobs)}] row {job} done before, kept")
            continue
        resume = bool(list_checkpoints(row_dir))
        log(f"table3: [{i}/{len(jobs)}] row {job}"
            f"{' (resuming)' if resume else ''}: {row_cells(configs[job])}")
        result = _run_row(configs[job], job.partition(SEED_SUFFIX)[0], row_dir, vocab_dir,
                          valid, minutes_per_row, row_warmup_steps(base, minutes_per_row),
                          resume, device, progress, log)
        if result is None:  # stopped by a signal: not a finished row, and nothing else runs
            log(f"table3: row {job} stopped before its budget; its checkpoints are in "
                f"{row_dir}. Rerun the same command to continue it")
            raise KeyboardInterrupt
        result["job"] = job
        write_json_atomic(done, result)
        results.append(result)
    return results


def pending_jobs(out_dir: str | Path, rows: list[str], base_seeds: int = 1) -> list[str]:
    """The jobs of :func:`job_names` without a ``row.json`` in ``out_dir/rows`` yet."""
    return [j for j in job_names(rows, base_seeds)
            if not (Path(out_dir) / "rows" / j / "row.json").is_file()]


def base_spread(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The base row over its seeds: mean and spread (max - min) of dev BLEU and PPL, or None
    with fewer than two seeds."""
    runs = [r for r in results if r["row"] == "base"]
    if len(runs) < 2:
        return None
    out: dict[str, Any] = {"seeds": [r.get("seed") for r in runs]}
    for key in ("dev_bleu", "dev_ppl"):
        values = [r[key] for r in runs]
        out[key] = {"mean": round(sum(values) / len(values), 3),
                    "spread": round(max(values) - min(values), 3), "values": values}
    return out


def beyond_noise(result: dict[str, Any], spread: dict[str, Any] | None, key: str) -> bool:
    """Whether a row's ``key`` (dev_bleu or dev_ppl) differs from the base seeds' mean by more
    than twice their spread (False without a measured spread)."""
    if spread is None or result["row"] == "base":
        return False
    s = spread[key]
    return abs(result[key] - s["mean"]) > 2 * s["spread"]


def _run_row(config: Config, row: str, row_dir: Path, vocab_dir: Path, valid: Any,
             minutes: float, warmup_steps: int, resume: bool, device: str | None,
             progress: bool, log: Callable[[str], None]) -> dict[str, Any] | None:
    from aiayn.checkpoint import list_checkpoints
    from aiayn.evaluation.bleu import corpus_bleu
    from aiayn.training.run import run_training
    from aiayn.translator import Translator

    budget = [f"train.time_budget_s={minutes * 60}", f"train.warmup_steps={warmup_steps}",
              "train.max_steps=100000000",
              "train.eval_bleu_sentences=0", "train.eval_every_steps=100000000",
              "train.early_stopping_patience=0", "train.keep_last=1",
              f"train.checkpoint_every_s={max(30.0, minutes * 60 / 4)}",
              "train.checkpoint_every_steps=0"]
    config = config.with_overrides(budget)
    summary = run_training(None if resume else config, row_dir, vocab_path=vocab_dir,
                           resume=resume, overrides=budget if resume else None, device=device,
                           progress=progress, log=log)
    if summary["stop_reason"].startswith("signal"):
        return None
    translator = Translator.from_pretrained(list_checkpoints(row_dir)[-1], device=device)
    run_config, dc = translator.config, translator.decode_config
    t0 = time.monotonic()
    # the row's own decode settings (every preset: §6.1's beam 4, alpha 0.6); the corpus is the
    # model's text already
    hyps = translator.translate(valid.src, preprocessed=True)
    bleu = corpus_bleu(hyps, valid.tgt, run_config.data)
    ppl = summary.get("valid_ppl", math.nan)
    log(f"table3: row {row}: {summary['steps']} steps in {summary['elapsed_s'] / 60:.1f} min, "
        f"dev PPL {ppl:.2f}, dev BLEU {bleu['bleu']:.2f} (beam {dc.beam_size}, alpha "
        f"{dc.alpha} in "
        f"{time.monotonic() - t0:.0f} s)")
    return {"row": row, **row_cells(run_config), "steps": summary["steps"],
            "train_minutes": round(summary["elapsed_s"] / 60, 2),
            "warmup_steps": run_config.train.warmup_steps,
            "dev_ppl": round(ppl, 3), "dev_bleu": round(bleu["bleu"], 2),
            "dev_bleu_sentences": len(valid), "bleu_protocol": bleu["protocol"],
            "bleu_signature": bleu["signature"],
            "parameters": summary["parameters"], "config": run_config.name,
            "precision": summary["precision"]["chosen"], "dev_beam_size": dc.beam_size,
            "dev_alpha": dc.alpha, "seed": run_config.train.seed}


# --- reporting --------------------------------------------------------------------------------

def _cell(value: Any, base_value: Any) -> str:
    if value == base_value:
        return ""
    return "-" if value is None else str(value)


def markdown_table(results: list[dict[str, Any]], title: str = "") -> str:
    """Table 3 as the paper lays it out: blank cells equal the base row; the paper's own dev
    PPL and BLEU beside ours. With the base row over several seeds, a line gives their mean
    and spread, and † marks a row's PPL or BLEU that differs from that mean by more than twice
    the spread."""
    base = next((r for r in results if r["row"] == "base"), None)
    spread = base_spread(results)
    head = ("| | N | d_model | d_ff | h | d_k | d_v | P_drop | ε_ls | positional | r | steps | "
            "minutes | PPL (dev) | BLEU (dev) | params ×10^6 | paper PPL | paper BLEU |")
    lines = [title, ""] if title else []
    lines += [head, "|" + "---|" * 18]
    for r in results:
        paper = PAPER_RESULTS.get(r["row"], (None, None, None))
        keys = [*COLUMNS, "attention_window"]
        if base is None or r["row"] == "base":
            cells = ["-" if r[k] is None else str(r[k]) for k in keys]
        else:
            cells = [_cell(r[k], base[k]) for k in keys]
        mark = {k: " †" if beyond_noise(r, spread, k) else "" for k in ("dev_ppl", "dev_bleu")}
        name = r["row"] if r.get("job", r["row"]) == r["row"] else f"base (seed {r['seed']})"
        lines.append("| " + " | ".join([
            name, *cells, str(r["steps"]), f"{r['train_minutes']:.1f}",
            f"{r['dev_ppl']:.2f}{mark['dev_ppl']}", f"{r['dev_bleu']:.1f}{mark['dev_bleu']}",
            f"{r['parameters'] / 1e6:.1f}",
            "" if paper[0] is None else f"{paper[0]:.2f}",
            "" if paper[1] is None else f"{paper[1]:.1f}"]) + " |")
    warmups = sorted({r["warmup_steps"] for r in results if "warmup_steps" in r})
    if warmups:
        lines += ["", f"Warmup: {', '.join(map(str, warmups))} updates "
                      "(the base preset's, scaled to the row's budget)."]
    protocols = sorted({r["bleu_protocol"] for r in results if "bleu_protocol" in r})
    if protocols:
        from aiayn.evaluation.bleu import PROTOCOLS

        lines += ["", "Dev BLEU: " + "; ".join(PROTOCOLS[p] for p in protocols) + "."]
    if spread is not None:
        b, p = spread["dev_bleu"], spread["dev_ppl"]
        lines += ["", f"Base row over {len(spread['seeds'])} seeds {spread['seeds']}: dev BLEU "
                      f"{b['mean']:.2f} (spread {b['spread']:.2f}), dev PPL {p['mean']:.2f} "
                      f"(spread {p['spread']:.2f}); † marks a row more than twice the spread "
                      "from the base mean."]
    return "\n".join(lines) + "\n"


def plot_bleu(results: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Bar chart of dev BLEU per row (ours) with the paper's as dots on a second axis. With
    two base seeds or more, a band shows the base mean ± twice the seeds' spread: a bar that
    ends outside it is a row marked † in the table (:func:`beyond_noise`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    rows = [r.get("job", r["row"]) for r in results]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(rows) + 2), 3.2), dpi=100)
    ax.bar(rows, [r["dev_bleu"] for r in results], color="tab:blue", label="this run (left)")
    spread = base_spread(results)
    if spread is not None:
        b = spread["dev_bleu"]
        ax.axhspan(b["mean"] - 2 * b["spread"], b["mean"] + 2 * b["spread"], color="0.85",
                   zorder=0, label="base mean ± 2 × seed spread (left)")
    ax.set_ylabel("dev BLEU (this run)")
    ax.set_title(title or "Table 3 variations: dev BLEU per row", fontsize=9)
    twin = ax.twinx()
    paper = [(i, PAPER_RESULTS[r["row"]][1]) for i, r in enumerate(results)
             if r["row"] in PAPER_RESULTS]
    if paper:
        twin.plot([p[0] for p in paper], [p[1] for p in paper], "o", color="tab:orange",
                  label="paper, newstest2013 (right)")
        twin.set_ylabel("paper dev BLEU")
    fig.legend(loc="lower right", fontsize=7)
    ax.tick_params(axis="x", labelsize=8, labelrotation=60)
    fig.tight_layout()
    try:
        return save_with(path, fig.savefig)
    finally:
        plt.close(fig)
