"""How a training process joins the process group: the backend rule, the refusal of NCCL
with more processes than GPUs, and the config fields that set both; the position a checkpoint
keeps as a global batch index, and what a resume on another number of processes may change;
``--resume auto``; how DDP is built."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from aiayn.config import Config, DataConfig, ModelConfig, TrainConfig, batch_tokens_per_process
from aiayn.data.batching import make_batch_arrays
from aiayn.errors import ConfigError, UserError
from aiayn.model import Transformer
from aiayn.training.distributed import (
    DistInfo,
    data_parallel,
    describe_data_parallel,
    init_distributed,
    resolve_backend,
    restart_warning,
    restore_rng_state,
)
from aiayn.training.run import keep_global_batch, resolve_resume
from aiayn.training.stream import global_batch_index, local_batch_index
from aiayn.training.update import check_same_update


def test_auto_is_nccl_on_cuda_and_gloo_on_a_cpu_and_gloo_may_share_a_gpu() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(UserError, match="needs CUDA devices"):
        resolve_backend("nccl", torch.device("cpu"))


def test_nccl_with_more_processes_than_gpus_is_refused_before_joining(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"2 processes on this machine but 1 GPU.*"
                                        r"train.dist_backend=gloo"):
        init_distributed(torch.device("cuda", 0), "auto", 60.0)
    assert not torch.distributed.is_initialized()


def test_the_backend_and_timeout_are_checked_config_fields() -> None:
    assert (TrainConfig().dist_backend, TrainConfig().dist_timeout_s) == ("auto", 1800.0)
    with pytest.raises(ConfigError, match="dist_backend"):
        TrainConfig(dist_backend="mpi")
    with pytest.raises(ConfigError, match="dist_timeout_s must be positive"):
        TrainConfig(dist_timeout_s=0)


# --- the global position: a resume on another number of processes --------------------------

def test_an_epochs_batches_are_one_list_for_any_split_of_an_update() -> None:
    """Dealt round-robin from one list (4 batches an update as 4 x 1 or 2 x 2), process r's
    k-th batch is the list's k x processes + r-th: a global position means the same batches."""
    rng = np.random.default_rng(0)
    src, tgt = rng.integers(2, 30, 301), rng.integers(2, 30, 301)

    def dealt(world: int) -> list[list[int]]:
        shards = [make_batch_arrays(src, tgt, 200, seed=3, epoch=1, num_shards=world,
                                    shard_index=r, multiple_of=4) for r in range(world)]
        return [shards[g % world][g // world].tolist() for g in range(len(shards[0]) * world)]

    four = dealt(4)
    assert dealt(2) == four and dealt(1) == four and len(four) % 4 == 0
    # without the common multiple, 2 shards may split fewer batches than 4 do
    assert any(len(make_batch_arrays(src, tgt, m, seed=3, num_shards=2)) * 2
               != len(make_batch_arrays(src, tgt, m, seed=3, num_shards=4)) * 4
               for m in range(60, 400, 7))
    with pytest.raises(ValueError, match="multiple_of=6 is not a multiple of num_shards=4"):
        make_batch_arrays(src, tgt, 200, num_shards=4, multiple_of=6)


def test_positions_convert_between_numbers_of_processes() -> None:
    assert global_batch_index(5, DistInfo(1, 4, 1)) == 20
    assert local_batch_index(20, DistInfo(0, 2, 0)) == 10
    with pytest.raises(ValueError, match="not a whole round of 4"):
        local_batch_index(10, DistInfo(0, 4, 0))


def _checkpoint(folder: Path, world: int, per_update: int) -> Path:
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"step": 2, "world_size": world,
                                                  "batches_per_update": per_update}))
    return folder


def test_a_resume_on_another_number_of_processes_keeps_the_batches_of_an_update(
        tmp_path: Path) -> None:
    cfg = Config(data=DataConfig(max_tokens=0, global_max_tokens=4096))
    lines: list[str] = []
    four = _checkpoint(tmp_path / "four", 4, 4)
    two = keep_global_batch(cfg, four, 2, lines.append)
    assert two.train.accum_steps == 2 and batch_tokens_per_process(two.data, 2, 2) == 1024
    assert "train.accum_steps 1 -> 2" in lines[0]
    assert keep_global_batch(cfg, four, 4, lines.append) is cfg  # same processes: as it was
    with pytest.raises(UserError, match=r"its updates hold 4 batches \(4 process\(es\) x 1 "
                                        r"accumulation step\(s\)\); 3 process\(es\) .* resume "
                                        r"with 1, 2, 4 process\(es\)"):
        keep_global_batch(cfg, four, 3, lines.append)
    # an accumulation given with --set that changes the update is refused, not overridden
    eight = cfg.replace(train=replace(cfg.train, accum_steps=4))
    with pytest.raises(UserError, match="would change the global batch"):
        keep_global_batch(eight, four, 2, lines.append)


def test_checkpoints_without_a_global_position_resume_on_their_own_number_only() -> None:
    old = {"world_size": 2}  # written before positions were global
    check_same_update(old, 2, 3)
    with pytest.raises(UserError, match="written by a run of 2 processes .* same number"):
        check_same_update(old, 4, 1, "ckpt")
    check_same_update({"world_size": 4, "batches_per_update": 4}, 2, 2)


# --- --resume auto --------------------------------------------------------------------------

def test_resume_auto_from_the_flag_or_the_setting(tmp_path: Path) -> None:
    auto = Config(train=TrainConfig(resume="auto"))
    assert resolve_resume(False, Config(), tmp_path) is False
    assert resolve_resume(True, None, tmp_path) is True
    assert resolve_resume("auto", Config(), tmp_path) == "auto"
    assert resolve_resume(False, auto, tmp_path) == "auto"
    with pytest.raises(UserError, match="--resume auto starts a fresh run .* --preset or "
                                        "--config"):
        resolve_resume("auto", None, tmp_path)
    with pytest.raises(ConfigError, match="resume"):
        TrainConfig(resume="always")


# --- DDP ------------------------------------------------------------------------------------

def test_ddp_sends_no_constant_buffer_and_states_its_bucket(tmp_path: Path) -> None:
    """One gloo process (a group of one): the wrapper's settings, as every process builds it."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                                         rank=0, world_size=1)
    try:
        tc = TrainConfig(ddp_bucket_mb=4.0)
        model = Transformer(ModelConfig(N=1, d_model=16, d_ff=32, h=2, d_k=8, d_v=8,
                                        vocab_size=20, max_len=16))
        assert any(True for _ in model.buffers())  # the sinusoid table, at least
        ddp = data_parallel(model, torch.device("cpu"), tc)
        assert not _syncs_buffers(ddp) and ddp.bucket_bytes_cap == 4 * 2**20
        normed = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        assert _syncs_buffers(data_parallel(normed, torch.device("cpu"), tc))
        line = describe_data_parallel(model, tc)
        assert line == ("DDP: gradients all-reduced uncompressed in buckets of 4 MiB, buffers "
                        "not broadcast (constant during training)")
        if torch.version.cuda is None:  # torch allows its bf16 hook only with CUDA and NCCL
            with pytest.raises(UserError, match="ddp_compression = 'bf16'.*NCCL"):
                data_parallel(model, torch.device("cpu"),
                              TrainConfig(ddp_compression="bf16"))
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(ConfigError, match="ddp_compression"):
        TrainConfig(ddp_compression="fp8")


def _syncs_buffers(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp`` sends buffers before every forward (named so since torch 2.13)."""
    return bool(getattr(ddp, "forward_sync_buffers", ddp.broadcast_buffers))


def test_a_warning_when_restarts_meet_a_shared_c10d_store(monkeypatch) -> None:
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # the static rendezvous: not affected
    assert restart_warning() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_warning()
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert restart_warning() is None
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    assert restart_warning() is None


def test_a_rank_the_saved_run_did_not_have_keeps_its_own_rng() -> None:
    torch.manual_seed(5)
    saved = {"rng": [{"cpu": torch.get_rng_state()}]}  # a run of one process
    torch.manual_seed(3007)
    restore_rng_state(saved, DistInfo(2, 4, 2), torch.device("cpu"))
    mine = torch.rand(3)
    torch.manual_seed(3007)
    assert torch.equal(mine, torch.rand(3))
    restore_rng_state(saved, DistInfo(0, 4, 0), torch.device("cpu"))
    torch.manual_seed(5)
    expected = torch.rand(3)
    restore_rng_state(saved, DistInfo(0, 4, 0), torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)
