"""One test per defect of issue 14's list: each failed before its fix."""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from damage import swap_two_tokens
from rel_helpers import cli, copy_run, small_config, tree_hashes, within
from safetensors.torch import load_file

from aiayn.checkpoint import list_checkpoints, load_checkpoint
from aiayn.config import load_config
from aiayn.errors import DataError


def assert_one_clear_line(res, command: str, *names: str) -> None:
    assert res.code == 2, (res.code, res.err, res.exception)
    lines = [line for line in res.err.splitlines() if line.strip()]
    assert len(lines) == 1, res.err
    assert lines[0].startswith(f"aiayn {command}: error: "), lines[0]
    assert "Traceback" not in res.err
    for name in names:
        assert str(name) in lines[0], (name, lines[0])


# --- aiayn average -o deletes what it did not create --------------------------------------------

def test_average_refuses_an_output_it_did_not_create(trained_run: Path, tmp_path: Path) -> None:
    run = copy_run(trained_run, tmp_path / "run")
    stray = tmp_path / "notes.txt"
    stray.write_text("my notes\n")
    before = tree_hashes(run, stray)
    step = list_checkpoints(run)[0]
    for target in (run, step, stray, run / "best"):
        res = cli(["average", str(run), "-o", str(target)])
        assert_one_clear_line(res, "average", target)
        assert tree_hashes(run, stray) == before, target
    # an earlier average may be replaced, and a new path is created
    assert cli(["average", str(run), "-o", str(run / "averaged")]).code == 0
    assert cli(["average", str(run), "--last", "2", "-o", str(tmp_path / "avg2")]).code == 0
    assert load_checkpoint(tmp_path / "avg2")[1].model.N == 1


# --- train --resume with a change of shape ------------------------------------------------------

def test_resume_with_a_shape_change_is_refused_before_anything_is_written(
        trained_run: Path, tmp_path: Path) -> None:
    run = copy_run(trained_run, tmp_path / "run")
    before = tree_hashes(run)
    for change in ("model.N=3", "model.d_model=64", "model.vocab_size=99"):
        res = cli(["train", "--run-dir", str(run), "--resume", "--no-progress", "--set", change])
        assert_one_clear_line(res, "train", change.split("=")[0])
        assert tree_hashes(run) == before
    res = cli(["train", "--run-dir", str(run), "--resume", "--no-progress", "--device", "cpu",
               "--set", "train.max_steps=7"])
    assert res.code == 0, res.err + res.exception
    assert json.loads((run / "config.json").read_text())["train"]["max_steps"] == 7


# --- no batch at all: fail at once --------------------------------------------------------------

def test_training_without_any_batch_fails_at_once(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "data")
    empty_src, empty_tgt = tmp_path / "e.src", tmp_path / "e.tgt"
    empty_src.write_text("")
    empty_tgt.write_text("\n\n")
    config_file = tmp_path / "empty.json"
    config_file.write_text(cfg.replace(data=replace(cfg.data, train_src=str(empty_src),
                                                    train_tgt=str(empty_tgt))).to_json())
    with within(60):
        res = cli(["train", "--config", str(config_file), "--run-dir", str(tmp_path / "r1"),
                   "--no-progress"])
    assert_one_clear_line(res, "train", empty_src)
    config_file.write_text(cfg.to_json())
    with within(60):
        res = cli(["train", "--config", str(config_file), "--run-dir", str(tmp_path / "r2"),
                   "--no-progress", "--set", "data.max_len=3"])
    assert_one_clear_line(res, "train", "data.max_len")


# --- non-finite numbers -------------------------------------------------------------------------

@pytest.mark.parametrize("override", ["train.lr_scale=nan", "train.lr_scale=inf",
                                      "model.layer_norm_eps=nan", "train.time_budget_s=inf",
                                      "decode.alpha=nan", "model.P_drop=nan",
                                      "train.clip_norm=-inf"])
def test_non_finite_config_values_are_rejected(override: str) -> None:
    with pytest.raises(ValueError, match=override.split("=")[0].split(".")[1]):
        load_config("tiny", [override])
    res = cli(["params", "--preset", "tiny", "--set", override])
    assert_one_clear_line(res, "params", override.split("=")[1])


def test_the_nonfinite_guard_never_saves_non_finite_weights(tmp_path: Path) -> None:
    from aiayn.data.batching import encode_corpus
    from aiayn.data.vocab import Vocabulary
    from aiayn.training.loop import StopTraining, Trainer
    from aiayn.data.splits import load_split

    cfg = small_config(tmp_path / "data", max_steps=50, max_nonfinite=3)
    corpus = load_split(cfg.data, "train")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 40)
    cfg = cfg.replace(model=replace(cfg.model, vocab_size=len(vocab)))
    trainer = Trainer(cfg, tmp_path / "run", vocab, encode_corpus(vocab, corpus, 32),
                      progress=False)
    with torch.no_grad():
        trainer.model.encoder[0].ffn.W_1.weight[0, 0] = float("nan")
    with pytest.raises(StopTraining) as info:
        trainer.fit()
    assert "non-finite" in str(info.value) and "no checkpoint" in str(info.value)
    for path in (tmp_path / "run").rglob("model.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(str(path)).values()), path


# --- decoding options go through DecodeConfig's checks --------------------------------------------

@pytest.mark.parametrize("option", [["--alpha", "nan"], ["--alpha", "-1"],
                                    ["--max-len-b", "-3"], ["--max-len-a", "inf"],
                                    ["--beam", "0"], ["--batch-size", "0"],
                                    ["--sample", "--temperature", "nan"]])
def test_decoding_options_are_validated(trained_run: Path, tmp_path: Path, option) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a b c\n")
    res = cli(["translate", "--checkpoint", str(trained_run), "-i", str(src), *option])
    assert_one_clear_line(res, "translate", option[-1])
    assert res.out == ""


# --- vocab on nothing -----------------------------------------------------------------------------

@pytest.mark.parametrize("content", ["", "\n\n  \n\t\n"])
def test_vocab_refuses_files_without_text(tmp_path: Path, content: str) -> None:
    src, tgt = tmp_path / "a.txt", tmp_path / "b.txt"
    src.write_text(content)
    tgt.write_text(content)
    res = cli(["vocab", "--src", str(src), "--tgt", str(tgt), "-o", str(tmp_path / "v")])
    assert_one_clear_line(res, "vocab", src)
    assert not (tmp_path / "v").exists()


# --- the vocabulary fingerprint travels with the weights ------------------------------------------

def test_a_swapped_vocabulary_is_refused_without_meta_json(trained_run: Path,
                                                           tmp_path: Path) -> None:
    ckpt = copy_run(list_checkpoints(trained_run)[-1], tmp_path / "ckpt")
    (ckpt / "meta.json").unlink()
    load_checkpoint(ckpt)
    swap_two_tokens(ckpt)
    with pytest.raises(DataError, match="not the one the model was trained with"):
        load_checkpoint(ckpt)


# --- leftovers of killed writes and prunes ------------------------------------------------------

def test_leftovers_of_kills_are_cleaned_and_the_swap_window_is_closed(
        trained_run: Path, tmp_path: Path) -> None:
    from aiayn.checkpoint import recover_run_dir

    run = copy_run(trained_run, tmp_path / "run")
    ckpts = run / "checkpoints"
    newest = list_checkpoints(run)[-1]
    # a killed write, a killed prune (half the files gone), a killed swap of best/
    (ckpts / ".step-00000008.tmp-abc123").mkdir()
    (ckpts / ".step-00000008.tmp-abc123" / "model.safetensors").write_bytes(b"partial")
    half = ckpts / "step-00000001"
    half.mkdir()
    (half / "config.json").write_text("{}")
    os.replace(run / "best", run / ".best.old-4242")
    recover_run_dir(run)
    assert sorted(p.name for p in ckpts.iterdir()) == \
        ["step-00000002", "step-00000004", "step-00000006"]
    assert load_checkpoint(run / "best")[1].model.N == 1
    assert not list(run.glob(".best.*"))
    # and a resume starts from the newest complete checkpoint
    res = cli(["train", "--run-dir", str(run), "--resume", "--no-progress", "--device", "cpu",
               "--set", "train.max_steps=7"])
    assert res.code == 0, res.err + res.exception
    assert newest.name == "step-00000006"
    assert list_checkpoints(run)[-1].name == "step-00000007"


def test_pruning_renames_before_it_deletes(trained_run: Path, tmp_path: Path) -> None:
    """A prune killed half-way leaves no step-N folder that is not a whole checkpoint."""
    import shutil

    from aiayn.checkpoint import prune_checkpoints

    run = copy_run(trained_run, tmp_path / "run")
    seen: list[str] = []
    real_rmtree = shutil.rmtree

    def watching_rmtree(path, *a, **k):
        seen.append(Path(path).name)  # what a kill during this deletion would leave half-done
        return real_rmtree(path, *a, **k)

    shutil.rmtree = watching_rmtree
    try:
        prune_checkpoints(run, keep_last=1)
    finally:
        shutil.rmtree = real_rmtree
    assert len(seen) == 2 and not any(name.startswith("step-") for name in seen), seen
    assert [p.name for p in list_checkpoints(run)] == ["step-00000006"]


# --- the pipeline stops after a signal ----------------------------------------------------------

def test_a_signal_stops_the_pipeline_after_the_checkpoint(data_dir: Path, tmp_path: Path) -> None:
    import signal

    run_dir = tmp_path / "run"

    def send_term() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=send_term, daemon=True).start()
    with within(240):
        res = cli(["pipeline", "--preset", "tiny", "--run-dir", str(run_dir), "--no-progress",
                   "--set", "data.train_limit=2000", "--set", "train.max_steps=100000",
                   "--set", "train.eval_every_steps=100000"])
    assert res.code == 128 + signal.SIGTERM, (res.code, res.out, res.err, res.exception)
    assert "--resume" in res.err
    assert len(list_checkpoints(run_dir)) == 1
    assert not (run_dir / "averaged").exists() and not (run_dir / "results.json").exists()


# --- one clear line instead of a traceback --------------------------------------------------------

def test_existing_files_where_folders_are_written(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "data")
    config_file = tmp_path / "c.json"
    config_file.write_text(cfg.to_json())
    a_file = tmp_path / "occupied"
    a_file.write_text("keep me\n")
    res = cli(["train", "--config", str(config_file), "--run-dir", str(a_file), "--no-progress"])
    assert_one_clear_line(res, "train", a_file)
    src = tmp_path / "data" / "train.src"
    res = cli(["vocab", "--src", str(src), "--tgt", str(src), "-o", str(a_file)])
    assert_one_clear_line(res, "vocab", a_file)
    assert a_file.read_text() == "keep me\n"


def test_unwritable_or_folder_outputs_are_refused_before_decoding(
        trained_run: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("a b c\n")
    for target in (tmp_path, Path("/proc/aiayn-cannot-write/out.txt"),
                   tmp_path / "missing-folder" / "out.txt"):
        res = cli(["translate", "--checkpoint", str(trained_run), "-i", str(src),
                   "-o", str(target)])
        assert_one_clear_line(res, "translate", target)


def test_cuda_without_a_gpu(trained_run: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    src = tmp_path / "in.txt"
    src.write_text("a b c\n")
    res = cli(["translate", "--checkpoint", str(trained_run), "-i", str(src), "--device",
               "cuda"])
    assert_one_clear_line(res, "translate", "cuda")
    res = cli(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--device",
               "cuda:1"])
    assert_one_clear_line(res, "train", "cuda:1")
    assert not (tmp_path / "r").exists()
    res = cli(["translate", "--checkpoint", str(trained_run), "-i", str(src), "--device",
               "gpu"])
    assert_one_clear_line(res, "translate", "gpu")


def test_a_truncated_checkpoint_given_to_average(trained_run: Path, tmp_path: Path) -> None:
    run = copy_run(trained_run, tmp_path / "run")
    weights = list_checkpoints(run)[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    res = cli(["average", str(run), "--last", "3"])
    assert_one_clear_line(res, "average", weights)


def test_bad_config_files_are_named(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"N": 2,')
    res = cli(["params", "--preset", str(broken)])
    assert_one_clear_line(res, "params", broken, "line 1")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    res = cli(["params", "--preset", str(listed)])
    assert_one_clear_line(res, "params", listed)
    res = cli(["train", "--config", str(broken), "--run-dir", str(tmp_path / "r")])
    assert_one_clear_line(res, "train", broken)


def test_evaluate_with_empty_files(tmp_path: Path) -> None:
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("")
    ref.write_text("")
    res = cli(["evaluate", "--hyp", str(hyp), "--ref", str(ref)])
    assert_one_clear_line(res, "evaluate", hyp)


def test_a_folder_where_a_file_is_expected(trained_run: Path, tmp_path: Path) -> None:
    res = cli(["evaluate", "--hyp", str(tmp_path), "--ref", str(tmp_path)])
    assert_one_clear_line(res, "evaluate", tmp_path, "is a directory")
    res = cli(["translate", "--checkpoint", str(trained_run), "-i", str(tmp_path)])
    assert_one_clear_line(res, "translate", tmp_path, "is a directory")
    res = cli(["vocab", "--src", str(tmp_path), "--tgt", str(tmp_path), "-o",
               str(tmp_path / "v")])
    assert_one_clear_line(res, "vocab", tmp_path, "is a directory")
    assert math.isfinite(1.0)
