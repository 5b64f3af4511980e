"""The multi-process path on a prepared corpus (issue 56, part 5), with gloo on the CPU: 1, 2
and 4 processes.

- Each epoch's batches over all ranks are the kept pairs, each once; the ranks' shares are
  disjoint and of equal counts (what every rank's :class:`~aiayn.training.stream.EpochStream`
  deals itself, at 1, 2 and 4 processes).
- world 1 × accum 4 = world 2 × accum 2 = world 4 × accum 1: the same losses, step for step
  (1e-5 relative), each update the same 4 batches.
- A SIGTERM to torchrun mid-epoch, then ``--resume``: the same losses, step for step, as the
  uninterrupted run, and the same final weights.
- Two torchrun "nodes" of two processes (c10d rendezvous on 127.0.0.1) give the losses of one
  node of four; two nodes that do not share the run folder stop at once, saying so.
- A worker killed (SIGKILL) mid-epoch under ``torchrun --max-restarts 1 ... --resume auto``:
  the job restarts by itself and ends with the uninterrupted run's losses and weights.
- A run of 4 processes resumed on 2 under ``data.global_max_tokens``: the same global batches,
  so the losses after the resume are the 4-process run's.

CI time: the task's files, vocabulary and prepared folder are made once for the module
(:func:`task`), and the uninterrupted runs that several tests compare with are trained once
(:func:`four`: 4 processes, for three tests; :func:`two`: 2 processes for 40 updates, for two);
each test then runs only what it interrupts, resumes or compares.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_training import task_config, train_losses  # tests/integration is on sys.path

from aiayn.checkpoint import list_checkpoints, load_training_state
from aiayn.config import Config
from aiayn.data.prepared import PreparedCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.training.distributed import DistInfo
from aiayn.training.stream import EpochStream

STEPS = 6


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AIAYN_DEBUG", None)
    return env


@dataclass(frozen=True)
class Task:
    """The module's task: its config on the raw training files (``raw``), the same on their
    prepared folder (``prepared``) and the vocabulary's folder, all made once (:func:`task`).
    Runs read them and write only their own run folders."""

    raw: Config
    prepared: Config
    vocab: Path


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    """A task config (gloo-sized model, a checkpoint every 2 updates) on its training files,
    their vocabulary and their prepared folder (made by ``aiayn prepare`` in a process)."""
    folder = tmp_path_factory.mktemp("task")
    cfg = task_config(folder, max_steps=STEPS, checkpoint_every_steps=2, lr_scale=1.0)
    src = Path(cfg.data.train_src).read_text().splitlines()
    tgt = Path(cfg.data.train_tgt).read_text().splitlines()
    Vocabulary.learn(src + tgt, 40).save(folder / "vocab")
    res = subprocess.run([sys.executable, "-m", "aiayn", "prepare", "--src", cfg.data.train_src,
                          "--tgt", cfg.data.train_tgt, "--vocab", str(folder / "vocab"), "-o",
                          str(folder / "prepared"), "--max-len", str(cfg.data.max_len),
                          "--json"], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = replace(cfg.data, train_src=None, train_tgt=None, prepared=str(folder / "prepared"))
    return Task(cfg, cfg.replace(data=data), folder / "vocab")


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
            "--master-port", str(28500 + (os.getpid() * 7 + n) % 1000)]


def _train_args(tmp_path: Path, task: Task, cfg: Config, run: str) -> list[str]:
    """``-m aiayn train`` of ``cfg`` (written beside) into ``tmp_path/run``."""
    config = tmp_path / f"{run}.json"
    config.write_text(cfg.to_json())
    return ["-m", "aiayn", "train", "--config", str(config), "--run-dir", str(tmp_path / run),
            "--vocab", str(task.vocab), "--no-progress", "--device", "cpu"]


def _train(tmp_path: Path, task: Task, cfg: Config, world: int, run: str, *extra: str) -> Path:
    res = subprocess.run([*_torchrun(world), *_train_args(tmp_path, task, cfg, run), *extra],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return tmp_path / run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes(per_node: int, args: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """One torchrun "node" for each of ``args`` (its ``-m aiayn train ...``), all on this
    machine, meeting through a c10d rendezvous on 127.0.0.1; their results."""
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes",
                               str(len(args)), "--nproc-per-node", str(per_node), "--node-rank",
                               str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{port}", "--rdzv-id", "nodes", "--local-addr",
                               "127.0.0.1", *node_args],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for node, node_args in enumerate(args)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in
            zip(procs, outs)]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def test_each_epoch_deals_every_kept_pair_once_in_equal_disjoint_shares(task: Task) -> None:
    cfg, vocab = task.prepared, Vocabulary.load(task.vocab)
    corpus = PreparedCorpus.open(cfg.data.prepared)
    for world in (1, 2, 4):
        for epoch in (0, 1):
            shares = [EpochStream(cfg, vocab, corpus, None, DistInfo(rank, world, rank))
                      .batch_arrays(epoch) for rank in range(world)]
            assert len({len(s) for s in shares}) == 1, (world, [len(s) for s in shares])
            every = np.concatenate([b for share in shares for b in share])
            assert sorted(every.tolist()) == list(range(len(corpus))), (world, epoch)
            for a in range(world):  # disjoint: no pair in two ranks' batches
                for b in range(a + 1, world):
                    assert not set(np.concatenate(shares[a]).tolist()) & \
                        set(np.concatenate(shares[b]).tolist())


def _assert_same_run(cut: Path, whole: Path, steps: int) -> None:
    """The interrupted-then-resumed run ``cut`` logged the uninterrupted run ``whole``'s loss at
    every one of ``steps`` steps and ended on its weights (float32 sums in another order: 1e-5)."""
    resumed, uninterrupted = train_losses(cut), train_losses(whole)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, steps + 1))
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), step
    w_whole, w_cut = _weights(whole, steps), _weights(cut, steps)
    for key in w_whole:
        torch.testing.assert_close(w_cut[key], w_whole[key], rtol=1e-5, atol=1e-6)


@dataclass(frozen=True)
class Baseline:
    """An uninterrupted run that several tests compare with: its config and run folder."""

    cfg: Config
    run: Path


@pytest.fixture(scope="module")
def four(task: Task, tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """4 processes x 1 batch an update for STEPS updates, a checkpoint every 2. The update is
    stated as ``data.global_max_tokens`` = 4 x m (``data.max_tokens`` 0: derived), so the same
    config gives 1 process x 4 accumulation steps and 2 x 2 each batch's m tokens too, and a
    resume on fewer processes keeps the global batch. m is the largest batch size up to the
    task's ``data.max_tokens`` whose batch count 4 divides: then 1, 2 and 4 processes deal the
    same batches (otherwise the shards split some batches to make a multiple of their count)."""
    from aiayn.data.batching import make_batch_arrays

    cfg = task.prepared
    corpus = PreparedCorpus.open(cfg.data.prepared)

    def count(max_tokens: int) -> int:
        return len(make_batch_arrays(corpus.src_lengths(), corpus.tgt_lengths(), max_tokens,
                                     seed=cfg.train.seed))

    per = next(m for m in range(cfg.data.max_tokens, 256, -8) if count(m) % 4 == 0)
    cfg = cfg.replace(data=replace(cfg.data, max_tokens=0, global_max_tokens=4 * per))
    return Baseline(cfg, _train(tmp_path_factory.mktemp("four"), task, cfg, 4, "four"))


@pytest.mark.slow
def test_world_times_accumulation_is_one_update(task: Task, four: Baseline,
                                                tmp_path: Path) -> None:
    runs = {world: _train(tmp_path, task, four.cfg.replace(
                train=replace(four.cfg.train, accum_steps=4 // world)), world, f"w{world}")
            for world in (1, 2)}
    runs[4] = four.run
    losses = {world: train_losses(run) for world, run in runs.items()}
    per = four.cfg.data.global_max_tokens // 4
    for world, run in runs.items():  # each batch the same m tokens: only the split differs
        saved = json.loads((run / "config.json").read_text())
        assert (saved["data"]["max_tokens"], saved["train"]["accum_steps"]) == (per, 4 // world)
    assert sorted(losses[1]) == list(range(1, STEPS + 1))
    for world in (2, 4):
        assert sorted(losses[world]) == sorted(losses[1])
        for step, loss in losses[1].items():
            assert losses[world][step] == pytest.approx(loss, rel=1e-5), (world, step)
        # (the weights are not compared element by element: where a gradient is near zero,
        # the other order of the same sums can flip its sign, and Adam then moves that
        # element by about lr the other way: 4e-4 at most here, in 3 of 64 bias elements)
    assert losses[1][STEPS] < losses[1][1]


def _logged_updates(metrics: Path) -> int:
    """The train records in a run's metrics log so far (a line still being written skipped)."""
    if not metrics.is_file():
        return 0
    count = 0
    for line in metrics.read_text().splitlines():
        try:
            count += json.loads(line).get("kind") == "train"
        except ValueError:
            pass
    return count


LONG = 40  # the updates of the 2-process runs that are interrupted mid-run


@pytest.fixture(scope="module")
def two(task: Task, tmp_path_factory: pytest.TempPathFactory) -> Baseline:
    """2 processes for LONG updates, a checkpoint every 2, started with ``--resume auto`` in
    an empty folder (it starts afresh): what the interrupted runs must end as. (How often a
    run checkpoints does not change its updates: the resumed runs of the SIGTERM test, which
    checkpoint only when stopped, must end as this one too.)"""
    cfg = task.prepared.replace(train=replace(task.prepared.train, max_steps=LONG))
    return Baseline(cfg, _train(tmp_path_factory.mktemp("two"), task, cfg, 2, "whole",
                                "--resume", "auto"))


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_continues_the_same_run(task: Task, two: Baseline,
                                                               tmp_path: Path) -> None:
    cfg = two.cfg.replace(train=replace(two.cfg.train, checkpoint_every_steps=0))
    config = tmp_path / "cut.json"
    config.write_text(cfg.to_json())
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*_torchrun(2), "-m", "aiayn", "train", "--config", str(config),
                             "--run-dir", str(cut), "--vocab", str(task.vocab),
                             "--no-progress", "--device", "cpu"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        # five updates logged: train records only (the log also holds a precision record, so
        # counting its lines stopped the run at step 4 now and then)
        if _logged_updates(cut / "metrics.jsonl") >= 5:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it to both processes
    out, _ = proc.communicate(timeout=120)
    text = out.decode(errors="replace")
    stopped = train_losses(cut)
    assert 5 <= max(stopped) < LONG, text  # stopped mid-run, by the signal
    assert "stop_reason=signal SIGTERM" in text, text
    (checkpoint,) = list_checkpoints(cut)
    assert json.loads((checkpoint / "meta.json").read_text())["reason"] == "signal SIGTERM"
    position = load_training_state(checkpoint)
    epoch_batches = len(EpochStream(cfg, Vocabulary.load(task.vocab),
                                    PreparedCorpus.open(cfg.data.prepared), None,
                                    DistInfo(0, 2, 0)).batch_arrays(position["epoch"]))
    assert 0 < position["batch_in_epoch"] < epoch_batches, (position, epoch_batches)  # mid-epoch
    res = subprocess.run([*_torchrun(2), "-m", "aiayn", "train", "--run-dir", str(cut),
                          "--resume", "--no-progress", "--device", "cpu"],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    _assert_same_run(cut, two.run, LONG)


@pytest.mark.slow
def test_two_nodes_of_two_give_the_losses_of_one_node_of_four(task: Task, four: Baseline,
                                                             tmp_path: Path) -> None:
    one = train_losses(four.run)
    args = _train_args(tmp_path, task, four.cfg, "two")
    for res in _nodes(2, [args, args]):
        assert res.returncode == 0, res.stdout
    two = train_losses(tmp_path / "two")
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step, loss in one.items():
        assert two[step] == pytest.approx(loss, rel=1e-5), step
    assert not (tmp_path / "two" / ".aiayn-nodes").exists()  # the shared-folder check's markers


@pytest.mark.slow
def test_nodes_that_do_not_share_the_run_folder_stop_with_one_line(task: Task,
                                                                   tmp_path: Path) -> None:
    """Each "node" is given its own folder as --run-dir, as two machines without a shared
    filesystem would each see their own disk under one path. Every process stops with the
    line of the main process's node (which node that is, the rendezvous decides)."""
    cfg = task.raw  # the check comes before the data is read
    results = _nodes(1, [_train_args(tmp_path, task, cfg, "node0"),
                         _train_args(tmp_path, task, cfg, "node1")])
    lines = set()
    for res in results:
        assert res.returncode != 0, res.stdout
        lines |= {x for x in res.stdout.splitlines() if "is not shared by the nodes" in x}
        assert "Traceback" not in res.stdout.split("is not shared")[0], res.stdout
    (line,) = lines  # one line, the same on both nodes
    assert line.startswith("aiayn train: error: --run-dir ") and "shared filesystem" in line
    assert any(f"--run-dir {tmp_path / f'node{k}'} is not shared by the nodes: node" in line
               for k in (0, 1)), line
    for node in (0, 1):  # nothing left behind: no marker, no run folder the check created
        assert not (tmp_path / f"node{node}").exists()


def _worker(parent: int, rank: int) -> int | None:
    """The pid of torchrun ``parent``'s worker of global ``rank`` in its first attempt."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = dict(item.split("=", 1) for item in
                       (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in item)
        except (OSError, IndexError, ValueError):
            continue  # gone, or not ours
        if ppid == parent and env.get("RANK") == str(rank) \
                and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return int(entry.name)
    return None


@pytest.mark.slow
def test_a_killed_worker_restarts_the_job_which_ends_as_the_uninterrupted_run(
        task: Task, two: Baseline, tmp_path: Path) -> None:
    cut = tmp_path / "cut"
    log = tmp_path / "cut.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", "--max-restarts", "1",
                                 "--monitor-interval", "0.2",
                                 *_train_args(tmp_path, task, two.cfg, "cut"), "--resume", "auto"],
                                # torch 2.13's c10d rendezvous needs it for restarts
                                env=dict(_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                stdout=out, stderr=subprocess.STDOUT)
        deadline, killed = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None and killed is None:
            # mid-epoch, after a checkpoint: the restart resumes from it
            if _logged_updates(cut / "metrics.jsonl") >= 5 and list_checkpoints(cut):
                pid = _worker(proc.pid, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed = _logged_updates(cut / "metrics.jsonl")
            time.sleep(0.05)
        proc.wait(timeout=180)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text
    assert killed is not None and killed < LONG, text  # killed mid-run, by the test
    assert "aiayn train: resumed from" in text, text  # by the restarted workers, by themselves
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in text  # no warning: it is set
    _assert_same_run(cut, two.run, LONG)


@pytest.mark.slow
def test_a_resume_on_fewer_processes_keeps_the_global_batch(four: Baseline,
                                                            tmp_path: Path) -> None:
    """4 processes x 1 batch (the :func:`four` run), resumed from step 2 on 2 processes: the
    resume makes it 2 x 2 (train.accum_steps), the same 4 batches an update from the same
    global position, so the losses of steps 3.. are the 4-process run's. The tolerance is the
    float32 one of test_world_times_accumulation_is_one_update: the same gradient sums in
    another order (two local, then two processes, against four processes)."""
    per = four.cfg.data.global_max_tokens // 4
    position = load_training_state(four.run / "checkpoints" / "step-00000002")
    assert position["global_batch_in_epoch"] == 8 and position["batches_per_update"] == 4
    two = tmp_path / "two"
    shutil.copytree(four.run, two)
    for path in list_checkpoints(two)[1:]:  # as it was at step 2
        shutil.rmtree(path)
    res = subprocess.run([*_torchrun(2), "-m", "aiayn", "train", "--run-dir", str(two),
                          "--resume", "--no-progress", "--device", "cpu"],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("resuming a run of 4 process(es) on 2: train.accum_steps 1 -> 2, so that an update "
            "holds the same 4 batches") in res.stdout, res.stdout
    assert f"global batch 2 process(es) x 2 accumulation step(s) x {per} tokens" in res.stdout
    saved = json.loads((two / "config.json").read_text())
    assert (saved["train"]["accum_steps"], saved["data"]["max_tokens"]) == (2, per)
    resumed, uninterrupted = train_losses(two), train_losses(four.run)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, STEPS + 1))
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), step


def test_resume_auto_starts_afresh_then_continues(task: Task, tmp_path: Path) -> None:
    """One process, in this one: ``--resume auto`` over a folder an attempt left without a
    checkpoint (its metrics lines go), then over the finished run (it continues)."""
    from aiayn.training.run import run_training

    cfg = task.raw.replace(train=replace(task.raw.train, max_steps=2, checkpoint_every_steps=2))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 99.0})
                                       + "\n")
    lines: list[str] = []
    run_training(cfg, run, vocab_path=task.vocab, resume="auto", progress=False,
                 log=lines.append)
    assert any("--resume auto: no checkpoint in" in line for line in lines), lines
    assert any("1 metrics.jsonl line(s) of an attempt" in line for line in lines), lines
    first = train_losses(run)
    assert sorted(first) == [1, 2] and first[1] != 99.0
    lines.clear()
    run_training(cfg, run, vocab_path=task.vocab, resume="auto", progress=False,
                 overrides=["train.max_steps=4"], log=lines.append)
    assert any("resumed from" in line and "(step 2)" in line for line in lines), lines
    again = train_losses(run)
    assert sorted(again) == [1, 2, 3, 4] and again[1] == first[1]
