"""Training curves of a run: loss, perplexity, validation BLEU and learning rate against
steps, from its metrics (``aiayn plot``, and the pipeline's figure)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from aiayn.config import DataConfig
from aiayn.errors import DataError
from aiayn.rundir import RunDir

__all__ = ["panel_titles", "plot_run", "read_metrics"]


def panel_titles(run_dir: Path) -> tuple[str, str]:
    """Titles of the BLEU and learning-rate panels, named after the run's config (the protocol
    its validation BLEU used, :func:`aiayn.evaluation.bleu.bleu_protocol`, and its schedule);
    the defaults' when there is none."""
    from aiayn.config import LR_SCHEDULE_TITLES
    from aiayn.evaluation.bleu import PROTOCOL_TITLES, bleu_protocol

    data, train = {}, {}
    try:
        config = json.loads(RunDir(run_dir).config.read_text(encoding="utf-8"))
        data, train = config.get("data", {}), config.get("train", {})
    except (OSError, ValueError, AttributeError):
        pass
    defaults = DataConfig()
    protocol = bleu_protocol(SimpleNamespace(
        dataset=data.get("dataset", defaults.dataset),
        preprocess=data.get("preprocess", defaults.preprocess)))
    schedule = train.get("lr_schedule", "inverse_sqrt")
    return (f"validation BLEU (greedy, {PROTOCOL_TITLES[protocol]})",
            f"learning rate ({LR_SCHEDULE_TITLES.get(schedule, schedule)})")


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The training and validation records of a run's metrics file.

    Raises:
        FileNotFoundError: no file at ``path``.
        DataError: a line that is not JSON, naming the file and line.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}: is {path.parent} a run directory?")
    train, valid = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"{path}, line {number}: not JSON") from None
        kind = record.get("kind")
        if kind in ("train", "valid"):  # other kinds (the precision record) are not curves
            (train if kind == "train" else valid).append(record)
    return train, valid


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Read a run's metrics and write a 2x2 figure (default: the run's curves PNG); returns
    the PNG path. An ensemble's run directory (``aiayn pipeline --ensemble N``) gets one
    figure with each member's curves drawn over each other.

    Raises:
        FileNotFoundError: the run (or a member of it) has no metrics.
        DataError: a metrics line that is not JSON.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aiayn.fileio import save_with

    run = RunDir(run_dir)
    n = run.members_found()
    runs = [(r.path.name, r) for r in run.runs()] if n else [("", run)]
    series = [(name, *read_metrics(r.metrics)) for name, r in runs]
    bleu_title, lr_title = panel_titles(run.path)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))

    def curve(ax, records: list[dict], key: str, label: str | None, **style) -> None:
        shown = [r for r in records if key in r]
        ax.plot([r["step"] for r in shown], [r[key] for r in shown], label=label, **style)

    for k, (name, train, valid) in enumerate(series):
        # one colour pair per run, train then valid, so members stay apart
        light, dark = f"C{2 * k}", f"C{2 * k + 1}"
        prefix = f"{name}, " if name else ""
        for ax, key, train_label in ((axes[0][0], "loss", "train (smoothed)"),
                                     (axes[0][1], "ppl", "train")):
            curve(ax, train, key, prefix + train_label, color=light)
            curve(ax, valid, "valid_" + key, prefix + "valid", color=dark, marker="o")
        curve(axes[1][0], valid, "valid_bleu", name or None, color=dark, marker="o")
        curve(axes[1][1], train, "lr", name or None, color=dark)
    axes[0][0].set_title("label-smoothed loss (nats / token)")
    axes[0][1].set_yscale("log")
    axes[0][1].set_title("perplexity (per subword)")
    axes[1][0].set_title(bleu_title)
    axes[1][1].set_title(lr_title)
    for a in axes.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[1]:
            a.legend()
    fig.suptitle(f"aiayn run {run.path.name}" + (f", an ensemble of {n}" if n else ""))
    fig.tight_layout()
    out = Path(output) if output else run.curves
    save_with(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return out
