"""Real processes killed at random moments, and a real file-size limit during checkpoint writes.

- kill -9: ``aiayn train`` writes a checkpoint after every update and prunes to the last two,
  so most of its time goes to writing and pruning; it is killed (SIGKILL) at a random moment,
  then resumed, 20 times. After every kill each listed checkpoint loads, its folder name, its
  meta.json and its training state agree on the step, and the resume loads the newest one.
- disk full: a process whose file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes fail with
  EFBIG as on a full disk) is too small for the weights; ``aiayn train --resume`` and
  ``aiayn average`` over an earlier average then fail with one line, and every earlier
  checkpoint stays byte-for-byte intact, with no leftovers.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rel_helpers import small_config, tree_hashes

from aiayn.checkpoint import list_checkpoints, load_checkpoint, load_training_state

pytestmark = pytest.mark.slow  # many training processes started and killed

TRIALS = 10


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AIAYN_DEBUG", None)
    return env


def _aiayn(argv: list[str], log: Path, fsize_limit: int | None = None) -> subprocess.Popen:
    """``aiayn ARGV`` as a real process, its output in ``log``. ``fsize_limit``: its
    RLIMIT_FSIZE, with SIGXFSZ ignored so that a write past it fails as on a full disk."""
    code = "from aiayn.cli import main; import sys; sys.exit(main(sys.argv[1:]))"
    if fsize_limit is not None:
        code = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize_limit}, {fsize_limit})); "
                + code)
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-c", code, *argv], env=_env(), stdout=out,
                                stderr=subprocess.STDOUT)


def _check_run(run: Path) -> int:
    """Every listed checkpoint is whole and consistent; returns the newest step."""
    found = list_checkpoints(run)
    assert found, "no complete checkpoint"
    for path in found:
        step = int(path.name.split("-")[1])
        assert json.loads((path / "meta.json").read_text())["step"] == step
        assert load_training_state(path)["step"] == step
    load_checkpoint(found[-1])
    return int(found[-1].name.split("-")[1])


def _newest_step(run: Path) -> int:
    found = list_checkpoints(run)
    return int(found[-1].name.split("-")[1]) if found else -1


def test_kill_9_at_random_moments(tmp_path: Path) -> None:
    cfg = small_config(tmp_path / "data", max_steps=100_000, checkpoint_every_steps=1,
                       keep_last=2, eval_every_steps=100_000, eval_bleu_sentences=0,
                       log_every_steps=100_000)
    config_file = tmp_path / "config.json"
    config_file.write_text(cfg.to_json())
    run = tmp_path / "run"
    rng = random.Random(14)
    newest = -1
    leftovers_seen = 0
    for trial in range(TRIALS):
        args = ["--config", str(config_file)] if trial == 0 else ["--resume"]
        log = tmp_path / f"trial-{trial}.log"
        proc = _aiayn(["train", *args, "--run-dir", str(run), "--no-progress", "--device",
                       "cpu"], log)
        ready = "process(es)" if trial == 0 else "resumed from"
        deadline = time.monotonic() + 120
        while ready not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.01)
        start = -1
        if trial > 0:
            resumed = next(x for x in log.read_text().splitlines() if "resumed from" in x)
            m = re.search(r"step-(\d+) \(step (\d+)\)", resumed)
            assert m and int(m[1]) == int(m[2]) >= newest, (resumed, newest)
            start = int(m[2])
        while _newest_step(run) <= start:  # training runs: a checkpoint per update from here
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)  # kill -9
        assert proc.wait() == -signal.SIGKILL
        hidden = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] + \
            [p for p in run.iterdir() if p.name.startswith(".best")]
        leftovers_seen += bool(hidden)
        newest = _check_run(run)
    assert newest > 0
    # some kills landed inside a write or a prune (their leftovers were cleaned on resume)
    assert leftovers_seen >= 1, "no kill hit a checkpoint write; the test proves little"
    print(f"{leftovers_seen} of {TRIALS} kills left a half-written or half-pruned checkpoint")


def test_a_full_disk_during_checkpoint_writes_keeps_the_previous_ones(
        trained_run: Path, tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    weights = (list_checkpoints(run)[-1] / "model.safetensors").stat().st_size
    limit = weights // 2  # config, vocabulary and metrics fit; the weights do not
    assert limit > (run / "tokenizer.json").stat().st_size
    checkpoints = [*list_checkpoints(run), run / "best", run / "averaged"]
    before = tree_hashes(*checkpoints)
    codes, logs = [], []
    for n, argv in enumerate([["train", "--run-dir", str(run), "--resume", "--no-progress",
                               "--device", "cpu", "--set", "train.max_steps=8"],
                              ["average", str(run), "--last", "2"]]):
        log = tmp_path / f"{n}.log"
        codes.append(_aiayn(argv, log, fsize_limit=limit).wait(timeout=300))
        logs.append(log.read_text())
    assert codes == [2, 2], logs
    errors = [line for text in logs for line in text.splitlines() if "error" in line]
    assert [line.split(":")[0] for line in errors] == ["aiayn train", "aiayn average"], logs
    assert all("File too large" in line for line in errors), errors
    assert not any("Traceback" in text for text in logs)
    assert tree_hashes(*checkpoints) == before
    hidden = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".")] + \
        [p.name for p in run.iterdir() if p.name.startswith((".best", ".averaged"))]
    assert hidden == []
    _check_run(run)
