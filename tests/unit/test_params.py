"""Parameter counts against Table 3's last column, through ``aiayn params``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from aiayn.cli import main
from aiayn.config import ModelConfig, load_config
from aiayn.model import Transformer, count_parameters

# Table 3, params x 10^6, for the rows that give a count (§6.2)
TABLE3 = {
    "base": 65, "big": 213,
    "table3-B1": 58, "table3-B2": 60,
    "table3-C1": 36, "table3-C2": 50, "table3-C3": 80, "table3-C4": 28,
    "table3-C5": 168, "table3-C6": 53, "table3-C7": 90,
}

# Every Table 3 count sits about 2M above an exact count at a 37000-token vocabulary (as if the
# effective vocabulary were ~41K), so the relative gap is widest for the smallest model with the
# smallest non-embedding share: row (C) N=2 comes out at 33.66M against the paper's 36 (-6.5%).
# It gets a looser bound; every other row must land within 5%.
TOLERANCE = {"table3-C1": 0.07}


def params_json(capsys, preset: str, vocab_size: int = 37000) -> dict:
    assert main(["params", "--preset", preset, "--vocab-size", str(vocab_size), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", sorted(TABLE3))
def test_parameter_count_matches_table3(capsys, preset):
    out = params_json(capsys, preset)
    paper = TABLE3[preset] * 1e6
    gap = (out["parameters"] - paper) / paper
    assert abs(gap) <= TOLERANCE.get(preset, 0.05), (
        f"{preset}: {out['parameters']:,} vs Table 3's {paper:,.0f} ({gap:+.1%})")


def closed_form(m: ModelConfig) -> int:
    """§3 counted by hand: tied embedding, encoder layers (attention, FFN, 2 LayerNorms),
    decoder layers (2 attentions, FFN, 3 LayerNorms), all Linear layers with biases."""
    d = m.d_model
    attention = d * m.h * m.d_k * 2 + m.h * m.d_k * 2 + d * m.h * m.d_v + m.h * m.d_v \
        + m.h * m.d_v * d + d
    ffn = d * m.d_ff + m.d_ff + m.d_ff * d + d
    norm = 2 * d
    return m.vocab_size * d + m.N * (attention + ffn + 2 * norm) \
        + m.N * (2 * attention + ffn + 3 * norm)


@pytest.mark.parametrize("preset", ["base", "big", "table3-A1", "table3-B1", "table3-C4"])
def test_parameter_count_equals_closed_form(capsys, preset):
    out = params_json(capsys, preset)
    assert out["parameters"] == closed_form(load_config(preset, ["model.vocab_size=37000"]).model)


def test_base_count_is_63_08_million_at_37000():
    # pins the exact figure so that a change to the architecture cannot pass unnoticed
    m = load_config("base").model
    assert m.vocab_size == 37000
    assert closed_form(m) == 63_082_496


def test_count_parameters_counts_a_real_model_like_the_meta_one():
    cfg = ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8, vocab_size=40)
    model = Transformer(cfg)
    assert count_parameters(model) == closed_form(cfg)
    with torch.device("meta"):
        assert count_parameters(Transformer(cfg)) == closed_form(cfg)


def test_params_json_output_keys(capsys):
    out = params_json(capsys, "base")
    assert {"preset", "vocab_size", "parameters"} <= set(out)
    assert out["preset"] == "base" and out["vocab_size"] == 37000
    assert isinstance(out["parameters"], int)
    assert params_json(capsys, "base", vocab_size=1000)["parameters"] == \
        out["parameters"] - 36000 * 512


def test_params_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "aiayn", "params", "--preset", "base", "--vocab-size", "37000",
         "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["preset"] == "base" and out["vocab_size"] == 37000
    assert out["parameters"] == 63_082_496


def test_params_unknown_preset_is_an_error(capsys):
    assert main(["params", "--preset", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert "no-such-preset" in err and "base" in err
