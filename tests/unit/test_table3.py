"""Table 3's rows scaled to a preset (§6.2), checked cell by cell."""

from __future__ import annotations

import pytest

from aiayn.config import load_config
from aiayn.experiments.table3 import (
    PAPER_ROWS,
    ROW_NAMES,
    markdown_table,
    parse_rows,
    plot_bleu,
    row_cells,
    row_warmup_steps,
    scale_row,
)

CELLS = ("N", "d_model", "d_ff", "h", "d_k", "d_v", "P_drop", "epsilon_ls", "positional",
         "attention_window")


@pytest.mark.parametrize("row", [r for r in PAPER_ROWS if r != "base"])
def test_scaling_the_paper_base_gives_the_shipped_preset_of_each_row(row):
    got = row_cells(scale_row(load_config("base"), row))
    want = row_cells(load_config(f"table3-{row}"))
    for cell in CELLS:
        assert got[cell] == want[cell], (row, cell)


# The multi30k preset (N 3, d_model 256, d_ff 512, h 4, d_k = d_v 64, P_drop 0.2, eps 0.1)
# scaled row by row, worked out by hand from the paper's ratios.
MULTI30K = {
    "base": (3, 256, 512, 4, 64, 64, 0.2, 0.1, "sinusoidal", None),
    "A1": (3, 256, 512, 1, 256, 256, 0.2, 0.1, "sinusoidal", None),   # h 8 -> 1: 1/8 of 4, >= 1
    "A2": (3, 256, 512, 2, 128, 128, 0.2, 0.1, "sinusoidal", None),   # h x 1/2
    "A3": (3, 256, 512, 8, 32, 32, 0.2, 0.1, "sinusoidal", None),     # h x 2
    "A4": (3, 256, 512, 16, 16, 16, 0.2, 0.1, "sinusoidal", None),    # h x 4
    "B1": (3, 256, 512, 4, 16, 64, 0.2, 0.1, "sinusoidal", None),     # d_k x 1/4, d_v kept
    "B2": (3, 256, 512, 4, 32, 64, 0.2, 0.1, "sinusoidal", None),     # d_k x 1/2
    "C1": (1, 256, 512, 4, 64, 64, 0.2, 0.1, "sinusoidal", None),     # N x 2/6
    "C2": (2, 256, 512, 4, 64, 64, 0.2, 0.1, "sinusoidal", None),     # N x 4/6
    "C3": (4, 256, 512, 4, 64, 64, 0.2, 0.1, "sinusoidal", None),     # N x 8/6
    "C4": (3, 128, 512, 4, 32, 32, 0.2, 0.1, "sinusoidal", None),     # d_model / 2, d_k = d/h
    "C5": (3, 512, 512, 4, 128, 128, 0.2, 0.1, "sinusoidal", None),   # d_model x 2
    "C6": (3, 256, 256, 4, 64, 64, 0.2, 0.1, "sinusoidal", None),     # d_ff / 2
    "C7": (3, 256, 1024, 4, 64, 64, 0.2, 0.1, "sinusoidal", None),    # d_ff x 2
    "D1": (3, 256, 512, 4, 64, 64, 0.0, 0.1, "sinusoidal", None),     # P_drop off
    "D2": (3, 256, 512, 4, 64, 64, 0.4, 0.1, "sinusoidal", None),     # P_drop x 2
    "D3": (3, 256, 512, 4, 64, 64, 0.2, 0.0, "sinusoidal", None),     # no label smoothing
    "D4": (3, 256, 512, 4, 64, 64, 0.2, 0.2, "sinusoidal", None),     # eps_ls x 2
    "E": (3, 256, 512, 4, 64, 64, 0.2, 0.1, "learned", None),
    "R": (3, 256, 512, 4, 64, 64, 0.2, 0.1, "sinusoidal", 5),         # §4, r = 5
}


@pytest.mark.parametrize("row", ROW_NAMES)
def test_multi30k_rows_cell_by_cell(row):
    cells = row_cells(scale_row(load_config("multi30k"), row, window=5))
    for name, want in zip(CELLS, MULTI30K[row]):
        assert cells[name] == want, (row, name, cells[name], want)


def test_rows_keep_everything_else_of_the_base():
    base = load_config("multi30k")
    scaled = scale_row(base, "C4")
    assert scaled.data == base.data and scaled.decode == base.decode
    assert scaled.train.warmup_steps == base.train.warmup_steps
    assert scaled.model.vocab_size == base.model.vocab_size


def test_warmup_takes_the_presets_share_of_the_row_budget():
    hour = load_config("multi30k")  # 1,600 warmup updates in a 3,600-second budget
    assert (hour.train.warmup_steps, hour.train.time_budget_s) == (1600, 3600)
    assert row_warmup_steps(hour, 10) == 267  # 1600 * 600 / 3600
    assert row_warmup_steps(hour, 60) == 1600
    assert row_warmup_steps(hour, 0.001) == 1  # never zero
    steps_only = load_config("base")  # the paper's: no time budget, warmup kept
    assert steps_only.train.time_budget_s == 0
    assert row_warmup_steps(steps_only, 10) == steps_only.train.warmup_steps


def test_bad_rows_and_bad_scalings_are_named():
    with pytest.raises(ValueError, match="Z9"):
        parse_rows("base,Z9")
    assert parse_rows("all") == ROW_NAMES
    assert parse_rows(" base , E ") == ["base", "E"]
    odd = load_config("multi30k", ["model.h=3", "model.d_model=255", "model.d_k=85",
                                   "model.d_v=85"])
    with pytest.raises(ValueError, match="does not divide"):
        scale_row(odd, "A3")  # h 6 does not divide d_model 255


def test_markdown_leaves_cells_equal_to_base_blank():
    base = load_config("multi30k")
    results = []
    for row in ("base", "C1", "R"):
        results.append({"row": row, **row_cells(scale_row(base, row, 4)), "steps": 10,
                        "train_minutes": 1.0, "dev_ppl": 9.5, "dev_bleu": 3.2,
                        "parameters": 1_500_000})
    lines = markdown_table(results).splitlines()
    c1 = [c.strip() for c in lines[3].split("|")[1:-1]]
    assert c1[:3] == ["C1", "1", ""] and c1[-2:] == ["6.11", "23.7"]
    r = [c.strip() for c in lines[4].split("|")[1:-1]]
    assert r[10] == "4" and r[1] == ""


def test_the_chart_shades_the_base_seeds_noise_band(tmp_path, monkeypatch):
    """With two base seeds the chart draws the band that † marks rows outside of."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = load_config("multi30k")
    results = [{"row": row, "job": job, **row_cells(scale_row(base, row, 4)), "steps": 10,
                "train_minutes": 1.0, "dev_ppl": 9.5, "dev_bleu": bleu, "parameters": 1}
               for row, job, bleu in (("base", "base", 20.0), ("base", "base-seed2", 21.0),
                                      ("C1", "C1", 30.0))]
    labels: list[str] = []
    savefig = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        labels.extend(p.get_label() for p in fig.axes[0].patches)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    assert plot_bleu(results, tmp_path / "t3.png").stat().st_size > 1000
    assert any("2 × seed spread" in label for label in labels)  # the band: 18.0 to 23.0
