"""Dynamic batching: requests that arrive together are decoded as one batch.

The first waiting request opens a window of ``max_wait_s``; the batch is run when the window
closes or as soon as ``max_batch_lines`` lines are waiting, whichever comes first (on shutdown,
:meth:`Batcher.flush` closes every window at once). Requests with
different search settings (beam, alpha, n-best) are never mixed: the oldest request's settings
pick the batch, and the others wait for the next one. Batches run on worker threads, so the
event loop stays free to accept requests: at most ``concurrency`` at once (1: one model in this
process, never used by two batches at once; more: one batch per process of a
:class:`aiayn.decoding.workers.WorkerPool`). While every slot is busy, requests gather, and
the next batch takes what waits as soon as a slot frees.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


class QueueFullError(Exception):
    """More lines are waiting than the queue holds (the server answers 429)."""


class ShuttingDownError(Exception):
    """The batcher no longer accepts work (the server answers 503)."""


@dataclass
class _Job:
    lines: list[str]
    key: Hashable
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    """Collects ``submit``-ted lines into batches for ``run_batch(lines, key) -> results``.

    Args:
        run_batch: called on the worker thread with the lines of one batch (in arrival order)
            and the shared key; returns one result per line.
        max_batch_lines: lines decoded together at most (a request is never split).
        max_wait_s: how long the first waiting request waits for others to join its batch.
        max_queue_lines: lines allowed to wait; a request that would exceed it is refused.
        executor: the threads ``run_batch`` runs on (at least ``concurrency`` of them).
        concurrency: batches decoded at once, >= 1.
    """

    def __init__(self, run_batch: Callable[[list[str], Any], list[Any]], *,
                 max_batch_lines: int, max_wait_s: float, max_queue_lines: int,
                 executor: ThreadPoolExecutor, concurrency: int = 1) -> None:
        if (max_batch_lines < 1 or max_queue_lines < 1 or max_wait_s < 0
                or concurrency < 1):
            raise ValueError(f"bad batcher limits: max_batch_lines={max_batch_lines}, "
                             f"max_queue_lines={max_queue_lines}, max_wait_s={max_wait_s}, "
                             f"concurrency={concurrency}")
        self.run_batch = run_batch
        self.concurrency = concurrency
        self.max_batch_lines = max_batch_lines
        self.max_wait_s = max_wait_s
        self.max_queue_lines = max_queue_lines
        self.executor = executor
        self._jobs: deque[_Job] = deque()
        self._queued_lines = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._flushing = False
        self.batches_run = 0

    @property
    def queued_lines(self) -> int:
        return self._queued_lines

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._worker())

    def flush(self) -> None:
        """Close every batch window now: what waits is decoded at once, and from then on each
        request runs as soon as the model is free. New requests are still accepted (those in
        flight when a shutdown begins must be answered; :meth:`stop` refuses them).

        Safe to call from a signal handler or another thread: ``aiayn serve`` calls it on
        SIGTERM/SIGINT, so that a shutdown does not wait up to ``max_wait_s`` for a window.
        """
        loop = self._task.get_loop() if self._task is not None else None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._flush_now)

    def _flush_now(self) -> None:
        self._flushing = True
        self._wakeup.set()

    async def stop(self) -> None:
        """Refuse new work, finish every request already queued, then end the worker."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    async def submit(self, lines: list[str], key: Hashable) -> tuple[list[Any], int]:
        """Queue ``lines`` and wait for their results.

        Returns:
            (one result per line, the number of lines in the batch they were decoded in).

        Raises:
            QueueFullError: the queue would hold more than ``max_queue_lines`` lines.
            ShuttingDownError: :meth:`stop` was called.
        """
        if self._closing:
            raise ShuttingDownError("the server is shutting down")
        if self._queued_lines + len(lines) > self.max_queue_lines:
            raise QueueFullError(
                f"the queue is full: {self._queued_lines} lines are waiting and this request "
                f"adds {len(lines)} (at most {self.max_queue_lines} may wait); retry later")
        job = _Job(lines, key, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        self._queued_lines += len(lines)
        self._wakeup.set()
        return await job.future

    def _take_batch(self) -> list[_Job]:
        key = self._jobs[0].key
        batch, lines, rest = [], 0, deque()
        while self._jobs:
            job = self._jobs.popleft()
            if job.key == key and (not batch or lines + len(job.lines) <= self.max_batch_lines):
                batch.append(job)
                lines += len(job.lines)
            else:
                rest.append(job)
        self._jobs = rest + self._jobs  # the others keep their places, oldest first
        self._queued_lines -= lines
        return batch

    async def _worker(self) -> None:
        slots = asyncio.Semaphore(self.concurrency)
        running: set[asyncio.Task] = set()
        while True:
            if not self._jobs:
                if self._closing:
                    if running:
                        await asyncio.gather(*running)
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await slots.acquire()  # requests keep gathering while every slot is busy
            deadline = self._jobs[0].arrived + self.max_wait_s
            while (not self._closing and not self._flushing
                   and self._queued_lines < self.max_batch_lines
                   and (left := deadline - time.monotonic()) > 0):
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), left)
                except TimeoutError:
                    break
            task = asyncio.get_running_loop().create_task(self._run(self._take_batch()))
            running.add(task)
            task.add_done_callback(lambda t: (running.discard(t), slots.release()))

    async def _run(self, batch: list[_Job]) -> None:
        lines = [line for job in batch for line in job.lines]
        try:
            results = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.run_batch, lines, batch[0].key)
        except Exception as err:  # every waiting request learns of the failure
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(err)
            return
        self.batches_run += 1
        start = 0
        for job in batch:
            if not job.future.done():  # a client that went away cancels its future
                job.future.set_result((results[start : start + len(job.lines)], len(lines)))
            start += len(job.lines)
