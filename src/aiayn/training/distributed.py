"""What training needs across processes (``torchrun``): where this process stands, joining the
process group, the check that every node sees one run folder, the DDP wrapper, sums over
processes, the main process's decisions shared with all, one precision for all, and every
process's RNG state for exact resumption. With one process every function here is a no-op or a
local computation."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
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
    local_world_size: int = 1  # processes on this machine (torchrun's LOCAL_WORLD_SIZE)
    node: int = 0  # this machine among the others (torchrun's GROUP_RANK)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def nodes(self) -> int:
        """Machines in the run (torchrun starts as many processes on each)."""
        return max(1, self.world_size // max(1, self.local_world_size))

    @classmethod
    def from_env(cls) -> DistInfo:
        env = os.environ
        world = int(env.get("WORLD_SIZE", 1))
        return cls(int(env.get("RANK", 0)), world, int(env.get("LOCAL_RANK", 0)),
                   int(env.get("LOCAL_WORLD_SIZE", world)), int(env.get("GROUP_RANK", 0)))


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


def restart_warning() -> str | None:
    """A line for the run's start when ``torchrun --max-restarts`` meets a c10d rendezvous
    whose store the workers share with the agent (torch's default since 2.5): a restarted
    group then reads the dead group's addresses and fails to connect (gloo's "connectFullMesh
    failed ... Connection refused", NCCL's "connect returned Connection refused"; pytorch
    issues 135712 and 167288, still so in torch 2.13). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in torchrun's environment gives each attempt a store of its own; the static rendezvous
    (``--master-addr``/``--master-port``, run id "none") is not affected."""
    env = os.environ
    if (int(env.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
            and env.get("TORCHELASTIC_RUN_ID", "none") != "none"
            and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
        return ("warning: torchrun --max-restarts with a c10d rendezvous: a restart fails to "
                "connect unless torchrun runs with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch "
                "issue 135712); export it before torchrun")
    return None


NODE_MARKERS = ".aiayn-nodes"  # in the run folder, only while the check runs


def check_shared_run_dir(run_dir: str | Path, info: DistInfo) -> None:
    """Check that every node sees one ``run_dir`` (a shared filesystem), before anything is
    written there: the main process restores and writes the checkpoints for all, and every
    process resumes from them. A collective: every process calls it; a no-op on one node.

    The first process of each node writes a marker (a random name) in
    ``run_dir/.aiayn-nodes``; after a barrier each of them looks for every node's marker, and
    all stop together, with one line, when one is missing. The markers are removed again (the
    folder too, and ``run_dir`` when the check created it and it is still empty).

    Raises:
        UserError: a node does not see another's marker, or cannot write in ``run_dir``
            (naming the nodes, their host names and ``run_dir``).
    """
    if info.nodes == 1 or not dist.is_initialized():
        return
    run_dir = Path(run_dir)
    folder = run_dir / NODE_MARKERS
    created = not run_dir.exists()
    host = socket.gethostname()
    marker, problem = f"node-{info.node}-{secrets.token_hex(8)}", ""
    if info.local_rank == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / marker).write_text(host, encoding="utf-8")
        except OSError as err:
            problem = f"node {info.node} ({host}) cannot write in {run_dir}: {err}"
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, (info.local_rank, info.node, host, marker, problem))
    firsts = [(node, their_host, name) for local, node, their_host, name, _ in everyone
              if local == 0]
    problems = [p for *_, p in everyone if p]
    if info.local_rank == 0 and not problems:
        seen = set(os.listdir(folder)) if folder.is_dir() else set()
        lost = [f"node {node} ({their_host})" for node, their_host, name in firsts
                if name not in seen]
        if lost:
            problem = (f"--run-dir {run_dir} is not shared by the nodes: node {info.node} "
                       f"({host}) does not see what {', '.join(lost)} wrote there; every node "
                       "must see the one run folder (put it on a shared filesystem: NFS, "
                       "Lustre, ...)")
    verdicts: list[Any] = [None] * info.world_size
    dist.all_gather_object(verdicts, problem)
    if info.local_rank == 0:
        (folder / marker).unlink(missing_ok=True)
    dist.barrier()  # every marker read and removed before the folder goes
    if info.local_rank == 0:
        with contextlib.suppress(OSError):  # another node's copy of a shared folder went first
            folder.rmdir()
            if created and not any(run_dir.iterdir()):
                run_dir.rmdir()
    dist.barrier()  # nothing is removed once any process goes on
    problems += [v for v in verdicts if v]
    if problems:
        raise UserError(problems[0])


def _trained_buffers(model: torch.nn.Module) -> bool:
    """Whether training changes some buffer of ``model``: running statistics of normalization
    layers (the Transformer has none)."""
    return any(getattr(m, "track_running_stats", False) for m in model.modules())


def data_parallel(model: torch.nn.Module, device: torch.device,
                  tc: Any) -> torch.nn.parallel.DistributedDataParallel:
    """``model`` wrapped in DistributedDataParallel for this run (``tc``: its
    :class:`~aiayn.config.TrainConfig`), the one place DDP is built.

    - Buffers are sent from rank 0 before every forward only when training changes them
      (running statistics of normalization layers). The Transformer has none: its buffers
      (the sinusoid table of §3.5, the output-vocabulary bias) are set before training, the
      same on every process (computed from the config and the training data all read), so
      nothing is sent.
    - Gradients are all-reduced in buckets of ``tc.ddp_bucket_mb`` MiB (torch's default 25),
      overlapping the backward.
    - ``tc.ddp_compression = "bf16"`` sends them as bf16 (torch's ``bf16_compress_hook``):
      half the bytes, at bf16's 8-bit mantissa in the sum.

    Raises:
        UserError: bf16 compression on a build of torch without CUDA and NCCL 2.10+ (torch
            refuses the hook there).
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    sync = _trained_buffers(model)
    # torch 2.13 renamed the per-forward part of broadcast_buffers (the start's sync stays)
    buffers = ({"forward_sync_buffers": sync}
               if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else {"broadcast_buffers": sync})
    ddp = DistributedDataParallel(model,
                                  device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=tc.ddp_bucket_mb, **buffers)
    if tc.ddp_compression == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        try:
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        except TypeError as err:
            raise UserError(f"train.ddp_compression = 'bf16': {err} (torch's bf16_compress_hook); "
                            "set train.ddp_compression=none") from None
    return ddp


def describe_data_parallel(model: torch.nn.Module, tc: Any) -> str:
    """One line for the run's start: how DDP shares the gradients and buffers
    (:func:`data_parallel`)."""
    buffers = ("buffers broadcast every forward (running statistics)" if _trained_buffers(model)
               else "buffers not broadcast (constant during training)")
    sent = "compressed to bf16" if tc.ddp_compression == "bf16" else "uncompressed"
    return (f"DDP: gradients all-reduced {sent} in buckets of {tc.ddp_bucket_mb:g} MiB, "
            f"{buffers}")


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


def main_choice(value: str, info: DistInfo) -> str:
    """The main process's ``value``, for every process (a collective; one broadcast)."""
    if info.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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
    checkpoints of earlier versions, rank 0's CPU state under ``torch_rng``). A rank the
    saved run did not have (a resume on more processes) keeps the state it was seeded with."""
    if "rng" in saved:
        if info.rank >= len(saved["rng"]):
            return
        mine = saved["rng"][info.rank]
        torch.set_rng_state(mine["cpu"])
        if "cuda" in mine and device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], device)
    else:
        torch.set_rng_state(saved["torch_rng"])
