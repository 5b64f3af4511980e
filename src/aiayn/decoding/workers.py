"""Decode on several CPU cores as several one-thread processes over one model.

A decoding step is many small products (a batch of 32 sentences × 4 beams is 128 rows), which
split badly over threads: on two cores one process of two threads decoded ``base`` beam 4 at
36.3 sentences/s where two forked one-thread processes over the same model gave 58.7
(``docs/benchmarks.md``, "Round 4"). CTranslate2 advises the same layout for throughput
(``inter_threads``). :func:`run_in_workers` is that layout: the parent forks ``workers``
children after the model is ready (they share its memory copy-on-write), child w decodes
batches w, w + workers, ... on one thread each, and sends each batch's result back as it
finishes. Each batch is decoded exactly as one process decodes it, so the output is the same.

It runs on CPU, where ``fork`` exists (Linux, macOS), and never for sampling (each child would
draw from a copy of one random state). :func:`choose_workers` states the choice.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any, TypeVar

import torch

from aiayn.errors import ConfigError

T = TypeVar("T")

#: The values ``workers`` takes besides a positive count.
AUTO = "auto"


def fork_available() -> bool:
    """Whether this platform can fork a process that shares the parent's memory."""
    return "fork" in mp.get_all_start_methods()


def choose_workers(requested: int | str, device: torch.device | str, batches: int, *,
                   sampling: bool = False, threads: int | None = None) -> int:
    """How many processes decode ``batches`` batches.

    Args:
        requested: a count >= 1, or ``"auto"``: on CPU with fork and without sampling, one
            process per torch thread (``torch.get_num_threads()``, or ``threads``), at most
            one per batch; else 1.
        device: where the models are; workers > 1 run on CPU only.
        batches: the batches to decode (a worker with no batch is not started).
        sampling: the search samples (one process keeps the draws reproducible).

    Returns:
        The number of processes, >= 1; 1 means decode in this process.

    Raises:
        aiayn.errors.ConfigError: a count < 1 or not a count, or a count > 1 asked for on a
            GPU, without fork, or with sampling (naming the value).
    """
    device = torch.device(device)
    if requested == AUTO:
        if device.type != "cpu" or sampling or not fork_available():
            return 1
        requested = threads or torch.get_num_threads()
    elif isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ConfigError(f"workers must be a count >= 1 or 'auto', got {requested!r}")
    elif requested > 1:
        why = ("it runs on CPU only" if device.type != "cpu" else
               "sampling runs in one process" if sampling else
               "this platform cannot fork" if not fork_available() else None)
        if why:
            raise ConfigError(f"workers={requested}: {why}; use workers=1 or 'auto'")
    return max(1, min(requested, batches))


def run_in_workers(decode: Callable[[Any], T], batches: Sequence[Any], workers: int, *,
                   on_result: Callable[[int, T], None],
                   finish: Callable[[], Any] | None = None) -> list[Any]:
    """Run ``decode(batches[b])`` for every b in ``workers`` forked one-thread processes.

    Child w takes batches w, w + workers, ...; each result is pickled back to the parent
    as soon as it is made and handed to ``on_result(b, result)`` there (in the order they
    arrive), so a progress bar moves as batches finish.

    Args:
        decode: what one batch does; runs in a child, with one torch thread.
        batches: the batches (the children see them through fork, unpickled).
        workers: processes, >= 2 (:func:`choose_workers`).
        on_result: called in the parent with each batch's index and result.
        finish: called once in each child after its last batch; its picklable result is
            returned in the list (one per worker, in worker order), e.g. counters.

    Returns:
        What ``finish`` returned in each child (``None`` each without it).

    Raises:
        RuntimeError: a child raised (its traceback is in the message) or died (its exit
            code); the other children are stopped.
    """
    ctx = mp.get_context("fork")
    conns, procs = [], []

    def child(w: int, conn) -> None:
        try:
            torch.set_num_threads(1)
            for b in range(w, len(batches), workers):
                conn.send(("batch", b, decode(batches[b])))
            conn.send(("done", w, finish() if finish is not None else None))
        except BaseException:  # sent to the parent, which raises it with this text
            conn.send(("error", w, traceback.format_exc()))
        finally:
            conn.close()

    try:
        for w in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=child, args=(w, send), daemon=True)
            proc.start()
            send.close()  # the child holds its end; EOF here means it is gone
            conns.append(recv)
            procs.append(proc)
        finished: list[Any] = [None] * workers
        live = dict(zip(conns, range(workers)))
        while live:
            for conn in wait(list(live)):
                w = live[conn]
                try:
                    kind, key, payload = conn.recv()
                except EOFError:
                    procs[w].join()
                    raise RuntimeError(f"decode worker {w} (pid {procs[w].pid}) died "
                                       f"(exit code {procs[w].exitcode})") from None
                if kind == "batch":
                    on_result(key, payload)
                elif kind == "done":
                    finished[w] = payload
                    del live[conn]
                else:
                    raise RuntimeError(f"decode worker {w} failed:\n{payload}")
        return finished
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()


__all__ = ["AUTO", "choose_workers", "fork_available", "run_in_workers"]
