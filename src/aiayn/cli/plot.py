"""``aiayn plot``: training curves of a run as a PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aiayn.errors import DataError, UserError

HELP = "Plot loss, perplexity, validation BLEU and learning rate against steps (PNG)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory of `aiayn train`, or of `aiayn pipeline --ensemble N` "
                        "(one figure, each member's curves drawn over each other)")
    p.add_argument("-o", "--output", default=None, metavar="PNG",
                   help="image to write (default: RUN_DIR/curves.png)")


def panel_titles(run_dir: Path) -> tuple[str, str]:
    """Titles of the BLEU and learning-rate panels, named after the run's config.json (the
    protocol its validation BLEU used, its schedule); the defaults' when there is none."""
    data, train = {}, {}
    try:
        config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        data, train = config.get("data", {}), config.get("train", {})
    except (OSError, ValueError, AttributeError):
        pass
    from aiayn.config import LR_SCHEDULE_TITLES
    from aiayn.data.text import is_protocol_text

    protocol = ("Multi30k protocol" if is_protocol_text(data.get("preprocess", "none"))
                else "sacreBLEU cased")
    schedule = train.get("lr_schedule", "inverse_sqrt")
    return (f"validation BLEU (greedy, {protocol})",
            f"learning rate ({LR_SCHEDULE_TITLES.get(schedule, schedule)})")


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The training and validation records of a run's ``metrics.jsonl``.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a line that is not JSON, naming the file and line.
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
    """Read ``RUN_DIR/metrics.jsonl`` and write a 2x2 figure; returns the PNG path. An
    ensemble's run directory (``aiayn pipeline --ensemble N``) gets one figure with each
    member's curves (``RUN_DIR/member-K/metrics.jsonl``) drawn over each other.

    Raises:
        FileNotFoundError: the run (or a member of it) has no metrics.jsonl.
        ValueError: a metrics line that is not JSON.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from aiayn.training.ensemble import member_dirs, members_found

    run_dir = Path(run_dir)
    n = members_found(run_dir)
    runs = [(d.name, d) for d in member_dirs(run_dir, n)] if n else [("", run_dir)]
    series = [(name, *read_metrics(d / "metrics.jsonl")) for name, d in runs]
    bleu_title, lr_title = panel_titles(run_dir)
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
    fig.suptitle(f"aiayn run {run_dir.name}" + (f", an ensemble of {n}" if n else ""))
    fig.tight_layout()
    out = Path(output) if output else run_dir / "curves.png"
    from aiayn.fileio import save_with

    save_with(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    if args.output:
        from aiayn.fileio import check_output_file

        check_output_file(args.output)
    print(plot_run(args.run_dir, args.output))
    return 0
