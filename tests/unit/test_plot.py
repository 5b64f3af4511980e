"""``aiayn plot``: a run's curves, and an ensemble's in one figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import sys
from pathlib import Path as _Path

sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))
from figures import assert_drawn  # noqa: E402

from aiayn.viz.curves import plot_run, read_metrics  # noqa: E402



def write_metrics(run: Path, steps: int, scale: float) -> None:
    """Records in the shape `aiayn train` writes: a train line every 10 steps, a valid line
    every 20."""
    run.mkdir(parents=True)
    lines = []
    for step in range(10, steps + 1, 10):
        loss = scale * 8.0 / step ** 0.5
        lines.append({"kind": "train", "step": step, "loss": loss, "nll": loss,
                      "ppl": 2.718 ** loss, "lr": 1e-3 * step / steps})
        if step % 20 == 0:
            lines.append({"kind": "valid", "step": step, "valid_loss": loss + 0.1,
                          "valid_nll": loss, "valid_ppl": 2.718 ** loss,
                          "valid_bleu": 40.0 - 10 * loss})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_a_run_and_an_ensemble_are_plotted(tmp_path: Path) -> None:
    single = tmp_path / "single"
    write_metrics(single, 100, 1.0)
    assert_drawn(plot_run(single))

    ens = tmp_path / "ens"
    ens.mkdir()
    (ens / "ensemble.json").write_text('{"members": 2}')
    write_metrics(ens / "member-1", 100, 1.0)
    write_metrics(ens / "member-2", 80, 1.2)
    out = plot_run(ens, tmp_path / "both.png")
    assert out == tmp_path / "both.png"
    assert_drawn(out)

    # every member is read: one missing is named, not skipped
    (ens / "member-2" / "metrics.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="member-2"):
        plot_run(ens)


def test_metrics_lines_are_read_and_a_bad_one_named(tmp_path: Path) -> None:
    write_metrics(tmp_path / "r", 40, 1.0)
    train, valid = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert [r["step"] for r in valid] == [20, 40]
    with open(tmp_path / "r" / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 7: not JSON"):
        read_metrics(tmp_path / "r" / "metrics.jsonl")
