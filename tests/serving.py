"""Helpers for the server tests: a tiny random-weight checkpoint, and `aiayn serve` run in a
thread (in-process) or as a real process on 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import threading
import time
from pathlib import Path

import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.config import load_config
from aiayn.data.vocab import Vocabulary
from aiayn.serve.loadtest import serve_child
from aiayn.model import Transformer

TEXTS = ["A man in a red shirt rides a bike.", "Two dogs play in the snow.",
         "Ein Mann in einem roten Hemd fährt Fahrrad.", "Zwei Hunde spielen im Schnee."] * 10


def tiny_checkpoint(path: Path, preprocess: str = "none") -> Path:
    """N=2, d_model 64, h=4, a 90-token BPE; outputs of at most 6 tokens keep decoding fast.
    ``preprocess``: the model's ``data.preprocess`` (its vocabulary is learned on that text)."""
    from aiayn.data.text import preprocess_lines

    cfg = load_config("tiny")
    vocab = Vocabulary.learn(preprocess_lines(TEXTS, "en", preprocess), 90)
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=len(vocab), max_len=48),
        data=dataclasses.replace(cfg.data, preprocess=preprocess),
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


@contextlib.contextmanager
def serve_process(checkpoint: Path, *args: str, log: Path | None = None):
    """``aiayn serve`` as a child process on 127.0.0.1 (:func:`aiayn.serve.loadtest.serve_child`);
    yields (process, base URL). With ``log``, its output goes there and a failed start shows it."""
    out = open(log, "wb") if log else subprocess.DEVNULL
    try:
        with serve_child(checkpoint, *args, stdout=out) as (proc, url):
            yield proc, url
    except RuntimeError as err:
        if not log or "aiayn serve" not in str(err):
            raise
        out.flush()
        raise RuntimeError(f"{err}; its log:\n{log.read_text()}") from None
    finally:
        if log:
            out.close()


def artifacts_dir() -> Path:
    """Where tests leave files for people to look at (screenshots, load-test figures):
    $AIAYN_TEST_ARTIFACTS, default test-artifacts/ at the repository root."""
    path = Path(os.environ.get("AIAYN_TEST_ARTIFACTS",
                               Path(__file__).resolve().parents[1] / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


