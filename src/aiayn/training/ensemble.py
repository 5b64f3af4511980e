"""Train the members of an ensemble side by side, one process each.

An ensemble (not in the paper) averages the next-token probabilities of models trained apart
(:class:`aiayn.decoding.search.EnsembleStep`). On a CPU of few cores, N processes of
``cores / N`` threads each use the cores better than one process of all of them: two
one-thread processes on this project's 2-core machine made 1.2 times the updates of one
two-thread process (the README's "Results"). So a time budget can train N models at once.

An ensemble's run directory (its layout: :mod:`aiayn.rundir`) holds the shared config (each
member's differs only in ``train.seed``), the one vocabulary (learned once, given to every
member), and each member's own run directory and log.

Member K trains with ``train.seed + K - 1`` (member 1 has the seed of a single run, but fewer
threads, so under a time budget it makes fewer updates than that run).

Each member is this module run as a program, ``python -m aiayn.training.ensemble`` (see
:func:`member_main`): the library's own entry point for one run, which calls
:func:`aiayn.training.run.run_training` as ``aiayn train`` does, without going up through the
command line (``tests/unit/test_layers.py`` reads such launches as imports).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiayn.errors import UserError
from aiayn.rundir import RunDir

STOP_TIMEOUT_S = 300.0  # seconds a member gets to save its checkpoint and exit after SIGTERM


def member_dirs(run_dir: str | Path, n: int) -> list[Path]:
    """The run directories of members 1 … n (:meth:`aiayn.rundir.RunDir.member_dirs`)."""
    return RunDir(run_dir).member_dirs(n)


def members_found(run_dir: str | Path) -> int:
    """How many members the ensemble in ``run_dir`` has; 0: not an ensemble's run directory
    (:meth:`aiayn.rundir.RunDir.members_found`)."""
    return RunDir(run_dir).members_found()


def check_new_run(run_dir: str | Path, n: int) -> None:
    """Refuse a new run of ``n`` models (1: a single run) in ``run_dir`` that would write its
    config and vocabulary over an earlier ensemble's, or an ensemble over a run's checkpoints.

    Raises:
        UserError: naming what ``run_dir`` holds and the ``--resume`` that continues it.
    """
    from aiayn.checkpoint import list_checkpoints

    found = members_found(run_dir)
    if found or any(list_checkpoints(d) for d in member_dirs(run_dir, n)):
        raise UserError(f"{run_dir} already holds an ensemble of {found or n}: add --resume "
                        f"--ensemble {found or n} to continue it, or choose another --run-dir")
    if n > 1 and list_checkpoints(run_dir):
        raise UserError(f"{run_dir} already holds a run's checkpoints: add --resume to continue "
                        "it, or choose another --run-dir")


def _last_step(member: Path) -> int | None:
    """The newest training step in the member's metrics (None before the first)."""
    path = RunDir(member).metrics
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _stopped_by_signal(returncode: int | None) -> bool:
    """A member's exit that a forwarded SIGINT or SIGTERM explains (before its training loop
    caught signals): killed by it, or Python's 128 + signal number."""
    numbers = {int(signal.SIGINT), int(signal.SIGTERM)}
    return returncode is not None and (-returncode in numbers or returncode - 128 in numbers)


def _parent_death_signal():
    """A function for ``preexec_fn`` that asks Linux to send the member SIGTERM when the job
    dies, even by SIGKILL, so that no member trains on alone (None elsewhere). Looked up here,
    in the parent: the forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def train_members(
    config: Any,
    run_dir: str | Path,
    n: int,
    *,
    resume: bool = False,
    overrides: list[str] | None = None,
    device: str | None = None,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    report_every_s: float = 300.0,
) -> list[dict[str, Any]]:
    """Train ``n`` members of ``config`` at once into ``RUN/member-K`` and wait for them.

    Each member is a process of :func:`member_main` with ``threads`` threads (default: this
    process's torch threads // n, at least 1) in its own session. SIGINT and SIGTERM sent to
    this process are passed on (SIGHUP as SIGTERM), so every member writes its checkpoint and
    stops, and its summary's ``stop_reason`` starts with "signal", as a single run's does; a
    member that the signal stopped before its training began, or that was not started yet,
    gets a summary of 0 updates with that stop reason. Each member also gets SIGTERM if this
    process dies (Linux).

    Args:
        config: the shared :class:`~aiayn.config.Config`; with ``resume``, ``RUN/config.json``
            when it exists.
        resume: members with a checkpoint continue from it; the others start anew.
        overrides: ``--set`` values for every member (e.g. a longer budget on a resume).
        report_every_s: seconds between progress lines (each member's newest step).

    Returns:
        Each member's ``train_summary.json``, with ``run_dir``, ``seed`` and ``threads``
        added, in order.

    Raises:
        UserError: n < 2; a member that failed (its log's last lines are quoted; the others
            are stopped with SIGTERM first).
    """
    import torch

    from aiayn.checkpoint import list_checkpoints
    from aiayn.config import load_config
    from aiayn.data.splits import load_split
    from aiayn.data.vocab import learn_vocabulary
    from aiayn.fileio import write_json_atomic

    if n < 2:
        raise UserError(f"an ensemble needs at least 2 members, got {n}")
    run_dir = Path(run_dir)
    dirs = member_dirs(run_dir, n)
    if not resume:
        check_new_run(run_dir, n)
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = RunDir(run_dir)
    if resume and layout.config.is_file():
        config = load_config(str(layout.config))
    else:
        write_json_atomic(layout.config, config.to_dict())
        layout.write_members(n)  # written before the first member starts
    vocab_path = layout.tokenizer
    if not (resume and vocab_path.is_file()):  # learned once: every member shares it
        if config.data.prepared:  # the one the token ids were made with
            from aiayn.data.prepared import PreparedCorpus

            PreparedCorpus.open(config.data.prepared).load_vocabulary().save(run_dir)
        else:
            corpus = load_split(config.data, "train")
            log(f"aiayn pipeline: learning the shared vocabulary ({config.data.vocab_size} "
                f"{config.data.vocab_kind}) for {n} ensemble members")
            learn_vocabulary(corpus, config.data).save(run_dir)
    threads = threads or max(1, torch.get_num_threads() // n)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    procs: list[subprocess.Popen] = []
    logs = [layout.member_log(k) for k in range(1, n + 1)]
    seed0 = config.train.seed
    stopped_by: list[int] = []  # the signal that asked the members to stop, once one came

    def forward(signum, _frame):
        if not stopped_by:
            stopped_by.append(signum)
        if signum not in (signal.SIGINT, signal.SIGTERM):  # SIGHUP: a member saves on SIGTERM
            signum = signal.SIGTERM
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # the members run in sessions of their own (a terminal's Ctrl-C reaches this process only,
    # and is passed on once), so the handlers go in before the first member starts
    die_with_parent = _parent_death_signal()
    caught = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP")
                                                else [])
    old = {sig: signal.signal(sig, forward) for sig in caught}
    try:
        for k, (member, log_path) in enumerate(zip(dirs, logs), 1):
            if stopped_by:  # a signal came while the members were starting: start no more
                break
            cmd = [sys.executable, "-m", "aiayn.training.ensemble", "--run-dir", str(member)]
            if resume and list_checkpoints(member):
                cmd += ["--resume"]
            else:
                cmd += ["--config", str(layout.config), "--vocab", str(vocab_path),
                        "--set", f"train.seed={seed0 + k - 1}"]
            cmd += [a for o in overrides or [] for a in ("--set", o)]
            if device:
                cmd += ["--device", device]
            with log_path.open("a", encoding="utf-8") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True,
                                              preexec_fn=die_with_parent))
        log(f"aiayn pipeline: training {n} ensemble members at once, {threads} thread(s) "
            f"each (seeds {seed0}-{seed0 + n - 1}); logs in " + ", ".join(map(str, logs)))
        last_report = time.monotonic()
        while any(p.poll() is None for p in procs):
            failed = [k for k, p in enumerate(procs) if p.poll() not in (None, 0)
                      and not (stopped_by and _stopped_by_signal(p.returncode))]
            if failed:
                k = failed[0]
                raise UserError(f"ensemble member {k + 1} failed (exit {procs[k].returncode}); "
                                f"the others were stopped. The end of {logs[k]}:\n"
                                f"{_tail(logs[k])}")
            time.sleep(1.0)
            if time.monotonic() - last_report >= report_every_s:
                last_report = time.monotonic()
                log("aiayn pipeline: " + ", ".join(
                    f"member {k}: step {_last_step(d) or 0}" for k, d in enumerate(dirs, 1)))
    finally:  # on any way out, no member is left running: each saves and stops on SIGTERM
        if any(p.poll() is None for p in procs):
            forward(signal.SIGTERM, None)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # a member that does not stop is not waited for
                p.kill()
                p.wait()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    summaries = []
    for k, member in enumerate(dirs, 1):
        p = procs[k - 1] if k <= len(procs) else None
        path = RunDir(member).train_summary
        if stopped_by and (p is None or p.returncode != 0 or not path.is_file()):
            # stopped before its training loop began (or never started): nothing trained
            summaries.append({"stop_reason": f"signal {signal.Signals(stopped_by[0]).name}",
                              "steps": _last_step(member) or 0, "epochs": 0, "elapsed_s": 0.0,
                              "target_tokens": 0, "parameters": 0, "run_dir": str(member),
                              "seed": seed0 + k - 1, "threads": threads})
            continue
        if p is None or p.returncode != 0 or not path.is_file():
            raise UserError(f"ensemble member {k} failed (exit {p and p.returncode}); the end "
                            f"of {logs[k - 1]}:\n{_tail(logs[k - 1])}")
        summary = json.loads(path.read_text(encoding="utf-8"))
        summary.update(run_dir=str(member), seed=seed0 + k - 1, threads=threads)
        summaries.append(summary)
    return summaries


def member_main(argv: list[str] | None = None) -> int:
    """One ensemble member's process (``python -m aiayn.training.ensemble``): train the run in
    ``--run-dir`` with :func:`aiayn.training.run.run_training`, printing its log and, at the
    end, the summary line ``aiayn train`` prints. Exit status as the command line's: 0, 2 for
    a :class:`~aiayn.errors.UserError` or ``OSError`` (one line), 130 on SIGINT before the
    training loop catches it."""
    import argparse

    from aiayn.config import load_config
    from aiayn.devices import widen_onednn_cache
    from aiayn.training.run import run_training, summary_line

    p = argparse.ArgumentParser(prog="python -m aiayn.training.ensemble",
                                description="Train one ensemble member (train_members runs it).")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--config", default=None, help="the ensemble's config.json (a new member)")
    p.add_argument("--vocab", default=None, help="the shared vocabulary")
    p.add_argument("--set", action="append", default=[], help="section.field=value")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    widen_onednn_cache()  # a process of its own: before its first bf16 product
    try:
        config = None if args.resume else load_config(args.config, args.set)
        summary = run_training(config, args.run_dir, vocab_path=args.vocab,
                               resume=args.resume, overrides=args.set if args.resume else None,
                               device=args.device, progress=False,
                               log=lambda msg: print(msg, flush=True))
    except (UserError, OSError) as err:
        print(f"aiayn train: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aiayn train: interrupted", file=sys.stderr)
        return 130
    print(summary_line(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(member_main())
