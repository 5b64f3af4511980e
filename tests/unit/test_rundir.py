"""aiayn.rundir: the run directory's one rule for which model a folder is (model_paths), the
generation record, and that no other module builds a path from a run's file names. Also the one
statement of which BLEU a run reports, as the selection's record writes it."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

import aiayn.rundir as rundir
from aiayn.config import DataConfig, DecodeConfig
from aiayn.errors import UserError
from aiayn.rundir import (GENERATION_CONFIG, NoModelError, RunDir, is_checkpoint, model_paths,
                          read_generation_config)

SRC = Path(__file__).resolve().parents[2] / "src" / "aiayn"


def fake_checkpoint(path: Path) -> Path:
    """A folder that is a checkpoint by its files (model_paths never reads the weights)."""
    path.mkdir(parents=True)
    for name in (rundir.WEIGHTS, rundir.CONFIG, rundir.TOKENIZER):
        (path / name).write_text("{}")
    assert is_checkpoint(path)
    return path


def trained_run(path: Path, *, steps=(10, 20), named=("averaged", "best", "ema"),
                finished: bool = True) -> RunDir:
    run = RunDir(path)
    for n in steps:
        fake_checkpoint(run.step(n))
    for name in named:
        fake_checkpoint(run / name)
    if finished:
        run.train_summary.write_text("{}")
    return run


def test_a_checkpoint_is_itself(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    assert model_paths(ckpt) == ([ckpt], {})
    assert model_paths(ckpt / rundir.WEIGHTS) == ([ckpt], {})


def test_a_finished_run_is_its_average_then_best(tmp_path):
    run = trained_run(tmp_path / "run")
    assert model_paths(run.path) == ([run.averaged], {})
    run_b = trained_run(tmp_path / "b", named=("best",))
    assert model_paths(run_b.path) == ([run_b.best], {})


def test_an_unfinished_run_is_its_newest_step_and_says_so(tmp_path):
    run = trained_run(tmp_path / "run", finished=False)
    said: list[str] = []
    assert model_paths(run.path, said.append) == ([run.step(20)], {})
    assert said == [f"{run.path}: training has not finished; loading its newest checkpoint, "
                    "step-00000020"]
    assert [p.name for p in run.steps()] == ["step-00000010", "step-00000020"]


def test_the_generation_record_wins(tmp_path):
    """ema recorded: every command that loads the run gets ema, not the averaged folder that
    the finished run also holds (the bug of issue 55, where convert took averaged)."""
    run = trained_run(tmp_path / "run")
    chosen = DecodeConfig(beam_size=1, alpha=0.0)
    path = run.write_generation([run.ema], chosen, weights="ema", precision="fp32")
    assert path == run.generation_config and path.name == GENERATION_CONFIG
    paths, record = model_paths(run.path)
    assert paths == [run.ema]
    assert record["decode"] == chosen and record["weights"] == "ema"


def test_an_ensemble_is_each_members_model(tmp_path):
    run = RunDir(tmp_path / "ens")
    run.path.mkdir()
    run.write_members(2)
    one = trained_run(run.member(1).path)
    two = trained_run(run.member(2).path, finished=False)
    said: list[str] = []
    assert model_paths(run.path, said.append) == ([one.averaged, two.step(20)], {})
    assert len(said) == 2 and f"no {GENERATION_CONFIG}" in said[1]
    assert run.runs()[1].path == two.path and run.member_log(2).name == "member-2.log"


def test_whose_run_a_checkpoint_is(tmp_path):
    """RunDir.of: the run, its named checkpoints, a step checkpoint and a file in one are the
    run's; an ensemble member's checkpoint is the member's run; a checkpoint on its own and a
    folder inside a checkpoint's parent that is no run are nobody's."""
    run = trained_run(tmp_path / "run")
    for path in (run.path, run.best, run.ema, run.averaged, run.step(10),
                 run.best / rundir.WEIGHTS, run.train_summary):
        assert RunDir.of(path).path == run.path, path
    ens = RunDir(tmp_path / "ens")
    ens.path.mkdir()
    ens.write_members(2)
    member = trained_run(ens.member(1).path)
    assert RunDir.of(member.averaged).path == member.path
    assert RunDir.of(ens.path).path == ens.path
    alone = fake_checkpoint(tmp_path / "alone" / "best")
    assert RunDir.of(alone) is None and RunDir.of(alone / rundir.WEIGHTS) is None
    assert RunDir.of(fake_checkpoint(run.path / "elsewhere" / "best")) is None
    assert not RunDir(run.best).is_run and run.is_run
    with pytest.raises(UserError, match="nosuch: no such file"):
        RunDir.of(tmp_path / "nosuch")


def test_what_is_no_model_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match="nosuch: no such file or directory"):
        model_paths(tmp_path / "nosuch")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoModelError, match="empty: not a checkpoint or a run directory"):
        model_paths(tmp_path / "empty")


def test_a_bad_generation_record_is_refused_by_name(tmp_path):
    run = trained_run(tmp_path / "run")
    with pytest.raises(ValueError, match="is not inside"):
        run.write_generation([fake_checkpoint(tmp_path / "elsewhere")], DecodeConfig())
    run.write_generation([run.ema], DecodeConfig())
    record = json.loads(run.generation_config.read_text())
    for bad, message in ((dict(record, members=["gone"]), "member 'gone' is not a checkpoint"),
                         (dict(record, precision="fp8"), "precision 'fp8' is not one of"),
                         (dict(record, format="x"), "not an aiayn generation record")):
        run.generation_config.write_text(json.dumps(bad))
        with pytest.raises(UserError, match=message):
            read_generation_config(run.path)


def test_load_checkpoint_takes_a_checkpoint_folder_only(tmp_path):
    from aiayn.checkpoint import load_checkpoint

    run = trained_run(tmp_path / "run")
    with pytest.raises(UserError, match="not a checkpoint folder"):
        load_checkpoint(run.path)


@pytest.mark.parametrize("dataset, preprocess, protocol", [
    ("multi30k", "lc-norm-tok", "multi30k"), ("multi30k", "none", "multi30k"),
    ("wmt14-en-de", "lc-norm-tok", "multi30k"), ("wmt14-en-de", "none", "sacrebleu"),
    ("files", "none", "sacrebleu")])
def test_the_record_names_the_protocol_corpus_bleu_scored(tmp_path, dataset, preprocess,
                                                         protocol):
    """The generation record's protocol is bleu_protocol's, the rule corpus_bleu scores by:
    a WMT run on lc-norm-tok text is scored in the Multi30k protocol, and says so."""
    from aiayn.evaluation.bleu import PROTOCOLS, bleu_protocol, corpus_bleu
    from aiayn.selection import Choice, record_choice

    data = DataConfig(dataset=dataset, preprocess=preprocess)
    assert bleu_protocol(data) == protocol
    assert corpus_bleu(["a b c d"], ["a b c d"], data)["protocol"] == protocol
    run = trained_run(tmp_path / "run")
    choice = Choice("ema", 0.6, [run.ema], [run.ema], {"ema": {"0.6": 1.0}}, None)
    record_choice(run.path, choice, DecodeConfig(), precision="fp32", data=data)
    record = read_generation_config(run.path)
    assert record["valid_protocol"] == PROTOCOLS[protocol]
    assert record["members"] == ["ema"] and record["decode"] == dataclasses.replace(
        DecodeConfig(), alpha=0.6) and record["valid_bleu"] == 1.0


def _file_names() -> set[str]:
    """The run directory's file and folder names, as rundir states them."""
    return {v for k, v in vars(rundir).items() if k.isupper() and isinstance(v, str)
            and k not in ("GENERATION_FORMAT", "STEP_PREFIX", "MEMBER_PREFIX")}


def test_only_rundir_builds_paths_from_a_runs_file_names():
    """``something / "metrics.jsonl"`` (or ``"step-…"``, ``"member-…"``) appears nowhere in
    src/aiayn but rundir.py: every other module asks RunDir (messages may name the files)."""
    names = _file_names()
    assert {"model.safetensors", "generation_config.json", "averaged", "ema"} <= names
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "rundir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                continue
            right = node.right
            text = right.value if isinstance(right, ast.Constant) else \
                "".join(v.value for v in right.values if isinstance(v, ast.Constant)) \
                if isinstance(right, ast.JoinedStr) else None
            if isinstance(text, str) and (text in names or text.startswith(("step-",
                                                                             "member-"))):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: / {text!r}")
    assert not found, "paths built from a run's file names outside rundir.py:\n" + \
        "\n".join(found)
