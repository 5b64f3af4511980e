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

:class:`WorkerPool` is the same layout kept alive for a server: it forks its children once,
before the server starts any thread, and each call hands one task to a free child.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import threading
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


class WorkerPool:
    """``workers`` forked one-thread processes that each run ``decode(task)`` for one task at
    a time, for as long as the pool is open: a server's decoding processes.

    Fork it before the process starts threads (a thread running at fork time may hold a lock
    the child then waits on forever): ``aiayn serve`` makes its pool before uvicorn starts.
    The children share the parent's model copy-on-write, ignore SIGINT and SIGTERM (the
    parent finishes the work in flight and then closes the pool), and end when the pool
    closes or the parent dies.

    :meth:`run` is thread-safe: up to ``workers`` threads can each run a task at once; one
    more waits for a free child.

    Args:
        decode: what one task does; runs in a child, with one torch thread. Tasks and results
            travel by pickle.
        workers: processes, >= 1.

    Raises:
        ValueError: ``workers`` < 1.
        aiayn.errors.ConfigError: this platform cannot fork.
    """

    def __init__(self, decode: Callable[[Any], T], workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a worker pool needs at least one process, got {workers}")
        if not fork_available():
            raise ConfigError("a worker pool needs fork, which this platform lacks; "
                              "use workers=1")
        ctx = mp.get_context("fork")
        self._free: queue.Queue = queue.Queue()
        self._procs: list = []
        self._lock = threading.Lock()
        self._live = 0
        self._closed = False

        def child(conn) -> None:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            torch.set_num_threads(1)
            while True:
                try:
                    task = conn.recv()
                except (EOFError, OSError):  # the parent is gone
                    return
                if task is None:
                    return
                try:
                    conn.send(("ok", decode(task)))
                except Exception as err:  # noqa: BLE001 - the parent raises it
                    text = traceback.format_exc()
                    try:
                        conn.send(("error", err, text))
                    except Exception:  # noqa: BLE001 - the error itself does not pickle
                        conn.send(("error", None, text))

        for w in range(workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=child, args=(theirs,), daemon=True,
                               name=f"aiayn-decode-{w}")
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._free.put((w, mine))
            self._live += 1

    @property
    def workers(self) -> int:
        """The children alive now (one that died is not replaced)."""
        return self._live

    def run(self, task: Any) -> T:
        """``decode(task)`` in a free child; blocks until it is done.

        Raises:
            Whatever ``decode`` raised in the child (the child's traceback is added as a note),
            or RuntimeError: the child died (its exit code; the pool goes on without it),
            every child has died, or the pool is closed.
        """
        while True:
            if self._closed:
                raise RuntimeError("the decode worker pool is closed")
            if self._live == 0:
                raise RuntimeError("every decode worker has died")
            try:
                w, conn = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        try:
            conn.send(task)
            reply = conn.recv()
        except (EOFError, OSError):
            proc = self._procs[w]
            proc.join(timeout=5)
            with self._lock:
                self._live -= 1
            conn.close()
            raise RuntimeError(f"decode worker {w} (pid {proc.pid}) died (exit code "
                               f"{proc.exitcode}); {self._live} remain") from None
        self._free.put((w, conn))
        if reply[0] == "ok":
            return reply[1]
        _, err, text = reply
        if isinstance(err, Exception):
            err.add_note(f"in decode worker {w}:\n{text}")
            raise err
        raise RuntimeError(f"decode worker {w} failed:\n{text}")

    def close(self) -> None:
        """End the children (after the task each is running) and wait for them; idempotent.
        Call it once no thread is in :meth:`run`."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                _, conn = self._free.get_nowait()
            except queue.Empty:
                break
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AUTO", "WorkerPool", "choose_workers", "fork_available", "run_in_workers"]
