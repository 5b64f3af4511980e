"""How a training process joins the process group: the backend rule, the refusal of NCCL
with more processes than GPUs, and the config fields that set both."""

from __future__ import annotations

import pytest
import torch

from aiayn.config import TrainConfig
from aiayn.errors import ConfigError, UserError
from aiayn.training.distributed import init_distributed, resolve_backend


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
