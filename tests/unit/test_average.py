"""aiayn average (§6.1) by update span: the paper's checkpoints were 10 minutes apart, about
1,400 base updates, so its last-5 average spanned about 5,600 updates; selecting by update
reproduces that on any machine, and the average records the span it covers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aiayn.checkpoint import read_meta, save_checkpoint
from aiayn.cli import main
from aiayn.config import Config, ModelConfig
from aiayn.data.vocab import Vocabulary
from aiayn.errors import UserError
from aiayn.model import Transformer
from aiayn.rundir import RunDir
from aiayn.training.average import parse_update_range, select_checkpoints, update_span

STEPS = RunDir("run").step  # checkpoints/step-N by update


def test_update_ranges_are_parsed_with_open_ends_and_refused_naming_the_text():
    assert parse_update_range("94000:100000") == (94000, 100000)
    assert parse_update_range("94000:") == (94000, None)
    assert parse_update_range(":5") == (None, 5)
    for bad in ("94000", "a:b", "5:4", "-1:3"):
        with pytest.raises(UserError, match=f"--updates {bad!r}"):
            parse_update_range(bad)


def test_the_base_presets_checkpoints_give_the_papers_last_five_by_updates():
    """base: a checkpoint every 1,400 updates (configs/base.toml), the last one at 100,000
    (max_steps, not a multiple of 1,400), the run keeping every one of them here."""
    every, end = 1400, 100_000
    steps = [STEPS(n) for n in range(every, end, every)] + [STEPS(end)]
    want = [STEPS(n) for n in (95200, 96600, 98000, 99400, 100000)]
    assert select_checkpoints(steps, last=5) == want
    assert select_checkpoints(steps, last_updates=5600) == want  # §6.1's span
    assert select_checkpoints(steps, updates=(94000, 100000)) == want
    assert select_checkpoints(steps, updates=(None, 2800)) == [STEPS(1400), STEPS(2800)]
    assert update_span(want) == {"first_update": 95200, "last_update": 100000,
                                 "span_updates": 4800}


def test_a_selection_needs_one_rule_and_a_checkpoint_in_its_span():
    steps = [STEPS(n) for n in (600, 1200, 1800)]
    with pytest.raises(UserError, match="give one of --last, --updates and --last-updates"):
        select_checkpoints(steps, last=2, last_updates=600)
    with pytest.raises(UserError, match="give one of"):
        select_checkpoints(steps)
    with pytest.raises(UserError, match="no checkpoint in that span; this run has updates "
                                        "600, 1200, 1800"):
        select_checkpoints(steps, updates=(1300, 1700))
    with pytest.raises(UserError, match="--last must be at least 1, got 0"):
        select_checkpoints(steps, last=0)
    assert select_checkpoints(steps, last_updates=0) == [STEPS(1800)]


def _run_with_checkpoints(run_dir: Path, updates: list[int]) -> None:
    """Step checkpoints of a two-layer model whose every weight is the checkpoint's index."""
    vocab = Vocabulary.learn(["a b c d e f", "b c d e f g"], 20)
    config = Config(name="avg", model=ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8,
                                                  vocab_size=len(vocab), max_len=16))
    model = Transformer(config.model)
    for i, n in enumerate(updates):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i))
        save_checkpoint(RunDir(run_dir).step(n), model, config, vocab, {"step": n})


def test_aiayn_average_by_updates_writes_the_mean_and_records_its_span(tmp_path, capsys):
    run = tmp_path / "run"
    _run_with_checkpoints(run, [1400, 2800, 4200, 5000])
    out = tmp_path / "avg"
    assert main(["average", str(run), "--updates", "2800:4200", "-o", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["averaged"] == ["step-00002800", "step-00004200"]
    assert (got["first_update"], got["last_update"], got["span_updates"]) == (2800, 4200, 1400)
    weights = load_file(str(out / "model.safetensors"))
    assert all(torch.all(t == 1.5) for t in weights.values())  # the mean of 1 and 2
    meta = read_meta(out)
    assert (meta["first_update"], meta["last_update"], meta["span_updates"]) == \
        (2800, 4200, 1400)
    assert main(["average", str(run), "--last-updates", "800", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "averaged 2 checkpoints, updates 4200 to 5000 (a span of 800)" in said
    assert read_meta(out)["span_updates"] == 800
    with pytest.raises(SystemExit) as exit_:  # argparse: one rule at a time
        main(["average", str(run), "--last", "2", "--last-updates", "800"])
    assert exit_.value.code == 2
