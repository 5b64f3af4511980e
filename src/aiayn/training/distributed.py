"""What training needs across processes (``torchrun``): where this process stands, joining the
process group, sums over processes, the main process's decisions shared with all, one
precision for all, and every process's RNG state for exact resumption. With one process every
function here is a no-op or a local computation."""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aiayn.errors import UserError
from aiayn.precision import Precision


@dataclass
class DistInfo:
    """Where this process stands among ``world_size`` (1 when not under torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls) -> DistInfo:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def resolve_backend(backend: str, device: torch.device) -> str:
    """The process group's backend for ``backend`` ("auto", "nccl" or "gloo") on ``device``:
    "auto" is NCCL on CUDA and gloo on a CPU.

    Raises:
        UserError: NCCL asked for on a CPU.
    """
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError("train.dist_backend = 'nccl' needs CUDA devices; on a CPU use 'gloo' "
                        "(or 'auto')")
    return backend


def init_distributed(device: torch.device, backend: str = "auto",
                     timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group torchrun describes; the one place that does
    (:func:`aiayn.training.run.run_training` calls it before anything else). A no-op for a
    single process or when already joined.

    Args:
        device: this process's training device.
        backend: ``train.dist_backend``: "auto" (NCCL on CUDA, gloo on a CPU), "nccl" or
            "gloo" (gloo also lets several processes share one GPU, which NCCL refuses).
        timeout_s: ``train.dist_timeout_s``, how long a collective waits before the run fails.

    Raises:
        UserError: NCCL with more processes on this machine than GPUs, or on a CPU.
    """
    info = DistInfo.from_env()
    if info.world_size > 1 and not dist.is_initialized():
        chosen = resolve_backend(backend, device)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if chosen == "nccl" and local > torch.cuda.device_count():
            raise UserError(f"{local} processes on this machine but {torch.cuda.device_count()} "
                            "GPU(s): NCCL needs a GPU for each process; start fewer "
                            "(--nproc-per-node) or share the GPUs through gloo with --set "
                            "train.dist_backend=gloo")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and object collectives use the current device
        dist.init_process_group(backend=chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return info


def sum_over_processes(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """``values`` summed over every process (all of them call it), as floats (float64 on the
    wire: token counts and loss sums stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if info.world_size > 1:
        dist.all_reduce(t)
    return t.tolist()


def main_decides(info: DistInfo, device: torch.device, elapsed_s: float,
                 *decisions: bool) -> tuple[float, tuple[bool, ...]]:
    """The main process's training seconds and decisions, shared with all in one broadcast on
    the training device (NCCL reduces and broadcasts only tensors on the GPU)."""
    if info.world_size == 1:
        return elapsed_s, tuple(bool(d) for d in decisions)
    values = torch.tensor([elapsed_s, *(1.0 if d else 0.0 for d in decisions)],
                          dtype=torch.float64, device=device)
    dist.broadcast(values, src=0)
    got = values.tolist()
    return got[0], tuple(bool(f) for f in got[1:])


def agree_precision(mine: Precision, info: DistInfo, device: torch.device) -> Precision:
    """One precision for every process: each measured its own CPU, and bf16 is used only if
    every one chose it (a rank that found bf16 slower makes them all fp32)."""
    if info.world_size == 1 or mine.requested != "auto":
        return mine
    flag = torch.tensor([0.0 if mine.chosen == "fp32" else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() == 0.0 and mine.chosen != "fp32":
        return dataclasses.replace(mine, chosen="fp32", reason=mine.reason + "; another "
                                   "process found bf16 slower, so every process runs fp32")
    return mine


def rng_states(info: DistInfo, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Each process's CPU (and CUDA) RNG state, by rank: the dropout masks' generators
    (batching has its own seed). A collective: every process calls it."""
    mine = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(device)
    if info.world_size == 1:
        return [mine]
    states: list[Any] = [None] * info.world_size
    dist.all_gather_object(states, mine)
    return states


def restore_rng_state(saved: dict[str, Any], info: DistInfo, device: torch.device) -> None:
    """This process's RNG state from a training state saved by :func:`rng_states` (or, from
    checkpoints of earlier versions, rank 0's CPU state under ``torch_rng``)."""
    if "rng" in saved:
        mine = saved["rng"][info.rank]
        torch.set_rng_state(mine["cpu"])
        if "cuda" in mine and device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], device)
    else:
        torch.set_rng_state(saved["torch_rng"])
