"""``aiayn pipeline --ensemble auto`` (issue 57): the shape comes from a throughput probe of real
updates on this machine, is said at start and recorded; a budget too short for any model is
refused with its minimum; a probe that cannot run falls back to the stated default shape."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from aiayn.cli import main
from aiayn.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _corpus(tmp_path: Path) -> list[str]:
    spec = importlib.util.spec_from_file_location("synthetic_corpus",
                                                  ROOT / "bench" / "synthetic_corpus.py")
    synthetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synthetic)
    src, tgt = synthetic.write_corpus(tmp_path, 300, types=2000, data_dir="")
    dev = synthetic.write_corpus(tmp_path, 20, stem="dev", seed=2, types=2000, data_dir="")
    test = synthetic.write_corpus(tmp_path, 25, stem="test", seed=3, types=2000, data_dir="")
    sets = ["data.dataset=files", f"data.train_src={src}", f"data.train_tgt={tgt}",
            f"data.valid_src={dev[0]}", f"data.valid_tgt={dev[1]}", "data.vocab_size=300",
            "train.checkpoint_every_steps=0", "train.checkpoint_every_s=3",
            "train.eval_every_steps=100000"]
    return ["--preset", "tiny", "--test-src", str(test[0]), "--test-tgt", str(test[1]),
            *[a for s in sets for a in ("--set", s)]]


@pytest.mark.slow
@pytest.mark.whole_machine  # its probe times updates on every core
def test_auto_shape_is_probed_said_and_recorded(tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    # tiny as a preset that writes a checkpoint every 60 s, and not the helper's 3 s set by hand:
    # rule 5 sizes the interval to the budget
    args = _corpus(tmp_path)
    at = args.index("train.checkpoint_every_s=3")
    del args[at - 1:at + 1]
    preset = tmp_path / "presets" / "tiny.toml"
    preset.parent.mkdir()
    text = (ROOT / "src" / "aiayn" / "configs" / "tiny.toml").read_text(encoding="utf-8")
    assert "checkpoint_every_s = 0\n" in text
    preset.write_text(text.replace("checkpoint_every_s = 0\n", "checkpoint_every_s = 60\n"),
                      encoding="utf-8")
    args[args.index("tiny")] = str(preset)
    code = main(["pipeline", "--ensemble", "auto", "--time-budget-min", "0.25",
                 "--run-dir", str(run_dir), "--no-progress", "--average", "1", *args])
    assert code == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "[0/4] probe (" in line]
    assert len(said) == 1 and "shape: " in said[0], out
    results = json.loads((run_dir / "results.json").read_text())
    shape = results["shape"]
    assert shape == json.loads((run_dir / "shape.json").read_text())
    assert shape["members"] in (1, 2) and shape["preset"] == str(preset)  # the file, kept
    assert {c["members"] for c in shape["candidates"]} <= {1, 2}
    assert all(c["updates_per_s"] > 0 and c["tokens_per_update"] > 0
               for c in shape["candidates"])
    # the run is the shape chosen: its members, and the warmup sized to the projection
    assert results.get("ensemble", 1) == shape["members"]
    config = json.loads(((run_dir / "member-1") if shape["members"] > 1 else run_dir)
                        .joinpath("config.json").read_text())
    assert config["train"]["warmup_steps"] == shape["warmup_steps"]
    from aiayn.budget import checkpoint_every_for
    every = checkpoint_every_for(15.0, load_config(str(preset)).train.checkpoint_every_s)
    assert 0 < every < 60
    assert config["train"]["checkpoint_every_s"] == shape["checkpoint_every_s"] == every
    assert f"a checkpoint every {every:g} s" in out


def test_a_budget_too_short_is_refused_with_its_minimum(tmp_path: Path, capsys) -> None:
    code = main(["pipeline", "--ensemble", "auto", "--time-budget-min", "0.001",
                 "--run-dir", str(tmp_path / "run"), "--no-progress", *_corpus(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "too few to train a model" in err and "give at least" in err, err
    assert "minutes (--time-budget-min)" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_probe_that_cannot_run_falls_back_to_the_stated_default(tmp_path: Path) -> None:
    from aiayn.budget import MEMBER_PRESET
    from aiayn.training.probe import choose_for_budget

    said: list[str] = []
    choice = choose_for_budget([], 3600, tmp_path / "no-vocabulary", said.append, cores=2)
    assert (choice.members, choice.preset) == (2, MEMBER_PRESET)
    assert choice.reason.startswith("the probe could not run (a probe process failed")
    assert any("the default shape" in line for line in said)
