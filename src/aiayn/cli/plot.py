"""``aiayn plot``: training curves of a run as a PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELP = "Plot loss, perplexity, validation BLEU and learning rate against steps (PNG)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `aiayn train`")
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


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Read ``RUN_DIR/metrics.jsonl`` and write a 2x2 figure; returns the PNG path.

    Raises:
        FileNotFoundError: the run has no metrics.jsonl.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}: is {run_dir} a run directory?")
    train, valid = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}, line {number}: not JSON") from None
        (train if record.get("kind") == "train" else valid).append(record)
    bleu_title, lr_title = panel_titles(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (smoothed)")
    ax.plot([r["step"] for r in valid if "valid_loss" in r],
            [r["valid_loss"] for r in valid if "valid_loss" in r], "o-", label="valid")
    ax.set_title("label-smoothed loss (nats / token)")
    ax.legend()
    ax = axes[0][1]
    ax.plot([r["step"] for r in train], [r["ppl"] for r in train], label="train")
    ax.plot([r["step"] for r in valid if "valid_ppl" in r],
            [r["valid_ppl"] for r in valid if "valid_ppl" in r], "o-", label="valid")
    ax.set_yscale("log")
    ax.set_title("perplexity (per subword)")
    ax.legend()
    ax = axes[1][0]
    bleu = [r for r in valid if "valid_bleu" in r]
    ax.plot([r["step"] for r in bleu], [r["valid_bleu"] for r in bleu], "o-", color="C2")
    ax.set_title(bleu_title)
    ax = axes[1][1]
    ax.plot([r["step"] for r in train], [r["lr"] for r in train], color="C3")
    ax.set_title(lr_title)
    for a in axes.flat:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.suptitle(f"aiayn run {run_dir.name}")
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
