"""The multi-process path on a prepared corpus (issue 56, part 5), with gloo on the CPU: 1, 2
and 4 processes.

- Each epoch's batches over all ranks are the kept pairs, each once; the ranks' shares are
  disjoint and of equal counts (what every rank's :class:`~aiayn.training.stream.EpochStream`
  deals itself, at 1, 2 and 4 processes).
- world 1 × accum 4 = world 2 × accum 2 = world 4 × accum 1: the same losses, step for step
  (1e-5 relative), each update the same 4 batches.
- A SIGTERM to torchrun mid-epoch, then ``--resume``: the same losses, step for step, as the
  uninterrupted run, and the same final weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_training import task_config, train_losses  # tests/integration is on sys.path

from aiayn.checkpoint import list_checkpoints, load_training_state
from aiayn.data.prepared import PreparedCorpus
from aiayn.data.vocab import Vocabulary
from aiayn.training.distributed import DistInfo
from aiayn.training.stream import EpochStream

STEPS = 6


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AIAYN_DEBUG", None)
    return env


def _prepared(tmp_path: Path):
    """A task config (gloo-sized model) on a prepared folder of its training files, and the
    vocabulary."""
    cfg = task_config(tmp_path, max_steps=STEPS, checkpoint_every_steps=2, lr_scale=1.0)
    corpus_src, corpus_tgt = cfg.data.train_src, cfg.data.train_tgt
    src = Path(corpus_src).read_text().splitlines()
    tgt = Path(corpus_tgt).read_text().splitlines()
    vocab = Vocabulary.learn(src + tgt, 40)
    vocab.save(tmp_path / "vocab")
    res = subprocess.run([sys.executable, "-m", "aiayn", "prepare", "--src", corpus_src,
                          "--tgt", corpus_tgt, "--vocab", str(tmp_path / "vocab"), "-o",
                          str(tmp_path / "prepared"), "--max-len", str(cfg.data.max_len),
                          "--json"], env=_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    data = replace(cfg.data, train_src=None, train_tgt=None, prepared=str(tmp_path / "prepared"))
    return cfg.replace(data=data), vocab


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
            "--master-port", str(28500 + (os.getpid() * 7 + n) % 1000)]


def _train(tmp_path: Path, cfg, world: int, run: str, *extra: str) -> Path:
    config = tmp_path / f"{run}.json"
    config.write_text(cfg.to_json())
    run_dir = tmp_path / run
    res = subprocess.run([*_torchrun(world), "-m", "aiayn", "train", "--config", str(config),
                          "--run-dir", str(run_dir), "--vocab", str(tmp_path / "vocab"),
                          "--no-progress", "--device", "cpu", *extra],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return run_dir


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def test_each_epoch_deals_every_kept_pair_once_in_equal_disjoint_shares(tmp_path: Path) -> None:
    cfg, vocab = _prepared(tmp_path)
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


@pytest.mark.slow
def test_world_times_accumulation_is_one_update(tmp_path: Path) -> None:
    from aiayn.data.batching import make_batch_arrays

    cfg, _ = _prepared(tmp_path)
    corpus = PreparedCorpus.open(cfg.data.prepared)

    def count(max_tokens: int) -> int:
        return len(make_batch_arrays(corpus.src_lengths(), corpus.tgt_lengths(), max_tokens,
                                     seed=cfg.train.seed))

    # a batch size whose batch count 4 divides: then 1, 2 and 4 processes deal the same batches
    # (otherwise the shards split some batches to make a multiple of their count)
    max_tokens = next(m for m in range(cfg.data.max_tokens, 256, -8) if count(m) % 4 == 0)
    cfg = cfg.replace(data=replace(cfg.data, max_tokens=max_tokens))
    runs = {world: _train(tmp_path, cfg.replace(train=replace(cfg.train,
                                                              accum_steps=4 // world)),
                          world, f"w{world}")
            for world in (1, 2, 4)}
    losses = {world: train_losses(run) for world, run in runs.items()}
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


@pytest.mark.slow
def test_sigterm_mid_epoch_then_resume_continues_the_same_run(tmp_path: Path) -> None:
    cfg, _ = _prepared(tmp_path)
    steps = 40
    cfg = cfg.replace(train=replace(cfg.train, max_steps=steps, checkpoint_every_steps=0))
    whole = _train(tmp_path, cfg, 2, "whole")
    config = tmp_path / "cut.json"
    config.write_text(cfg.to_json())
    cut = tmp_path / "cut"
    proc = subprocess.Popen([*_torchrun(2), "-m", "aiayn", "train", "--config", str(config),
                             "--run-dir", str(cut), "--vocab", str(tmp_path / "vocab"),
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
    assert 5 <= max(stopped) < steps, text  # stopped mid-run, by the signal
    assert "stop_reason=signal SIGTERM" in text, text
    (checkpoint,) = list_checkpoints(cut)
    assert json.loads((checkpoint / "meta.json").read_text())["reason"] == "signal SIGTERM"
    position = load_training_state(checkpoint)
    epoch_batches = len(EpochStream(cfg, Vocabulary.load(tmp_path / "vocab"),
                                    PreparedCorpus.open(cfg.data.prepared), None,
                                    DistInfo(0, 2, 0)).batch_arrays(position["epoch"]))
    assert 0 < position["batch_in_epoch"] < epoch_batches, (position, epoch_batches)  # mid-epoch
    res = subprocess.run([*_torchrun(2), "-m", "aiayn", "train", "--run-dir", str(cut),
                          "--resume", "--no-progress", "--device", "cpu"],
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    resumed, uninterrupted = train_losses(cut), train_losses(whole)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, steps + 1))
    for step, loss in uninterrupted.items():
        assert resumed[step] == pytest.approx(loss, rel=1e-5), step
    w_whole, w_cut = _weights(whole, steps), _weights(cut, steps)
    for key in w_whole:
        torch.testing.assert_close(w_cut[key], w_whole[key], rtol=1e-5, atol=1e-6)
