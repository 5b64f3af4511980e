"""bench/gpu_check.sh: its logic on any machine, and every check end to end on a CPU (--quick),
so that the script runs the first time a GPU is lent; the CUDA branch of the precision choice
with torch's CUDA queries stood in for."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn.config import load_config
from aiayn.precision import choose_precision

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_plan_refuses_cuda_without_a_gpu_and_names_the_device(tmp_path: Path) -> None:
    gc = _gpu_check()
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        gc.make_plan("cuda", False, sys.executable, tmp_path, gpus=0)
    with pytest.raises(ValueError, match="'tpu'"):
        gc.make_plan("tpu", False, sys.executable, tmp_path, gpus=1)


def test_on_cuda_the_plan_trains_in_bf16_with_one_nccl_process_per_gpu(tmp_path: Path) -> None:
    gc = _gpu_check()
    plan = gc.make_plan("cuda", False, "py", tmp_path, gpus=4)
    assert (plan.nproc, plan.backend, plan.precision) == (4, "nccl", "bf16")
    args = plan.train_args(tmp_path / "r", 300)
    assert args[:3] == ["train", "--preset", "multi30k"]
    assert "train.precision=bf16" in args and "train.max_steps=300" in args
    assert "--device" in args and args[args.index("--device") + 1] == "cuda"
    assert plan.torchrun("-m", "aiayn")[:5] == ["py", "-m", "torch.distributed.run",
                                                "--standalone", "--nproc_per_node=4"]
    cpu = gc.make_plan("cpu", True, "py", tmp_path, gpus=0)
    assert (cpu.nproc, cpu.backend, cpu.precision) == (2, "gloo", "auto")
    assert cpu.train_args(tmp_path / "r", 20)[:3] == ["train", "--preset", "tiny"]


def test_on_one_gpu_nccl_across_devices_is_said_not_exercised_and_gloo_shares_the_gpu(
        tmp_path: Path) -> None:
    gc = _gpu_check()
    plan = gc.make_plan("cuda", False, "py", tmp_path, gpus=1)
    lines: list[str] = []
    ran: list[list[str]] = []

    def run(cmd: list[str], timeout_s: float) -> str:
        ran.append(cmd)
        return '{"steps": 50, "target_tokens": 1000, "elapsed_s": 2.0}'

    gc.CHECK_FUNCTIONS = {**gc.CHECK_FUNCTIONS, "ddp_gloo": lambda p, r: gc.check_ddp_gloo(p, run)}
    results = gc.run_checks(plan, ["collective", "torchrun", "ddp_gloo"], lines.append)
    assert results["collective"]["ok"] is None and "NCCL across devices" in \
        results["collective"]["not_exercised"]
    assert lines[0].startswith("check collective: not exercised (one GPU")
    assert lines[1].startswith("check torchrun: not exercised")
    assert results["ddp_gloo"]["ok"] is True and results["ddp_gloo"]["device"] == "cuda:0"
    cmd = ran[-1]
    assert "--nproc_per_node=2" in cmd and "train.dist_backend=gloo" in cmd
    assert cmd[cmd.index("--device") + 1] == "cuda:0"


def test_last_json_takes_the_summary_after_the_log_lines() -> None:
    gc = _gpu_check()
    text = 'aiayn train: 10 pairs\n{"steps": 3}\nnot json {\n{"steps": 4, "x": [1]}\n'
    assert gc.last_json(text) == {"steps": 4, "x": [1]}
    with pytest.raises(ValueError, match="no JSON line"):
        gc.last_json("aiayn train: nothing\n{broken\n")


def test_a_failing_check_is_reported_with_its_log_and_the_others_still_run(
        tmp_path: Path) -> None:
    gc = _gpu_check()
    plan = gc.make_plan("cpu", True, sys.executable, tmp_path, gpus=0)
    gc.CHECK_FUNCTIONS = {**gc.CHECK_FUNCTIONS,
                          "bad": lambda plan, run: run([sys.executable, "-c", "import sys; "
                                                        "sys.exit('boom')"], 30),
                          "good": lambda plan, run: {"echo": run(["echo", "hi"], 30).strip()}}
    lines: list[str] = []
    results = gc.run_checks(plan, ["bad", "good"], lines.append)
    assert results["bad"]["ok"] is False and "boom" in results["bad"]["error"]
    assert results["good"] == {"ok": True, "seconds": results["good"]["seconds"], "echo": "hi"}
    assert lines[0].startswith("check bad: FAILED") and str(tmp_path / "bad.log") in lines[0]
    assert "boom" in (tmp_path / "bad.log").read_text()
    assert lines[1].startswith('check good: ok  {"echo": "hi"}')


def test_auto_precision_on_cuda_follows_the_compute_capability(monkeypatch) -> None:
    """Not torch.cuda.is_bf16_supported(), true on a V100 since torch 2.4 (emulated bf16)."""
    model = load_config("multi30k").model
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    got = choose_precision("auto", "cuda", model)
    assert (got.chosen, got.fp32_gflops) == ("bf16", None) and "Fake GPU" in got.reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    assert choose_precision("auto", "cuda", model).chosen == "fp16"
    assert choose_precision("auto", "cuda", model, training=False).chosen == "fp32"
    assert choose_precision("bf16-weights", "cuda", model).chosen == "bf16-weights"


def test_the_throughput_check_trains_base_from_a_prepared_corpus_over_every_gpu(
        tmp_path: Path, monkeypatch) -> None:
    """2,000 updates of base from a prepared WMT-shaped corpus, under torchrun with NCCL on
    two GPUs; without newstest2013 (the corpus's lengths) it is said, not passed."""
    gc = _gpu_check()
    plan = gc.make_plan("cuda", False, "py", tmp_path, gpus=2)
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path / "nothing"))
    with pytest.raises(gc.NotExercised, match="newstest2013"):
        gc.check_throughput(plan, lambda cmd, timeout_s: "")
    (tmp_path / "data" / "wmt14-en-de").mkdir(parents=True)
    (tmp_path / "data" / "wmt14-en-de" / "newstest2013.en").write_text("a b\n")
    monkeypatch.setenv("AIAYN_DATA_DIR", str(tmp_path / "data"))
    ran: list[list[str]] = []

    def run(cmd: list[str], timeout_s: float) -> str:
        ran.append(cmd)
        return json.dumps({"steps": 2000, "target_tokens": 2000 * 25000, "elapsed_s": 200.0,
                           "precision": {"chosen": "bf16"}}) if "train" in cmd else ""

    got = gc.check_throughput(plan, run)
    assert (got["updates"], got["processes"], got["backend"]) == (2000, 2, "nccl")
    assert (got["tokens_per_s"], got["ms_per_update"]) == (250000, 100.0)
    assert [c[c.index("-m") + 1] if "-m" in c else Path(c[1]).name for c in ran] == \
        ["make_synthetic_wmt.py", "aiayn", "aiayn", "torch.distributed.run"]
    assert ran[1][3:5] == ["vocab", "--src"] and "37000" in ran[1]
    train = ran[-1]
    assert "--nproc_per_node=2" in train and train[train.index("--preset") + 1] == "base"
    assert "train.max_steps=2000" in train
    assert f"data.prepared={tmp_path / 'throughput' / 'prepared'}" in train


# The checks that no other test runs on a CPU. The rest run the same code as tests of their
# own (torchrun and ddp_gloo: tests/integration/test_distributed_prepared.py and
# test_training.py; main_job: test_pipeline.py; bench_train and bench_decode: the benches);
# `bash bench/gpu_check.sh --device cpu --quick` runs all ten (about 140 s on 2 cores).
CPU_CHECKS = ["train", "collective", "wmt_step", "fp16", "throughput"]


@pytest.mark.slow
def test_the_checks_no_other_test_covers_run_end_to_end_on_a_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu",
                           "--quick", "--json", "--out", str(tmp_path), "--only", *CPU_CHECKS],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    checks = json.loads(lines[-1])["checks"]
    assert list(checks) == CPU_CHECKS
    assert set(CPU_CHECKS) < set(_gpu_check().CHECKS)
    assert all(c["ok"] for c in checks.values())
    assert [line.split(":")[0] for line in lines if line.startswith("check ")] == \
        [f"check {name}" for name in checks]
    assert checks["train"]["steps"] == 20
    assert checks["collective"]["world_size"] == 2
    assert checks["wmt_step"]["600"]["aiayn_ms"] > 0
    assert checks["fp16"]["loss_scale"] > 0 and checks["fp16"]["capability"] is None
    assert checks["throughput"]["updates"] == 20
