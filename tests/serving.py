"""Helpers for the server tests: a tiny random-weight checkpoint, and `aiayn serve` run in a
thread (in-process) or as a real process on 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.config import load_config
from aiayn.data.vocab import Vocabulary
from aiayn.model import Transformer

TEXTS = ["A man in a red shirt rides a bike.", "Two dogs play in the snow.",
         "Ein Mann in einem roten Hemd fährt Fahrrad.", "Zwei Hunde spielen im Schnee."] * 10


def tiny_checkpoint(path: Path) -> Path:
    """N=2, d_model 64, h=4, a 90-token BPE; outputs of at most 6 tokens keep decoding fast."""
    vocab = Vocabulary.learn(TEXTS, 90)
    cfg = load_config("tiny")
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=len(vocab), max_len=48),
        decode=dataclasses.replace(cfg.decode, max_len_a=0.5, max_len_b=6))
    torch.manual_seed(0)
    return save_checkpoint(path, Transformer(cfg.model), cfg, vocab)


@contextlib.contextmanager
def serve_in_thread(app):
    """Run ``app`` under uvicorn in a thread on a free loopback port; yields the base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(checkpoint: Path, *args: str, log: Path | None = None):
    """``aiayn serve`` as a child process on 127.0.0.1; yields (process, base URL). The
    process is stopped with SIGTERM (then SIGKILL) if the test did not stop it."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiayn", "serve", "--checkpoint", str(checkpoint),
         "--port", str(port), "--log-level", "warning", *args],
        stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_up(url, proc)
        except RuntimeError as err:
            if log:
                out.flush()
                raise RuntimeError(f"{err}; its log:\n{log.read_text()}") from None
            raise
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if log:
            out.close()


def wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"aiayn serve exited with {proc.returncode} before answering")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"aiayn serve did not answer {url}/health within {timeout_s} s")


def artifacts_dir() -> Path:
    """Where tests leave files for people to look at (screenshots, load-test figures):
    $AIAYN_TEST_ARTIFACTS, default test-artifacts/ at the repository root."""
    path = Path(os.environ.get("AIAYN_TEST_ARTIFACTS",
                               Path(__file__).resolve().parents[1] / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


