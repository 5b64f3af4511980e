"""The serving batcher (:mod:`aiayn.serve.batcher`) on its own, with a plain function for the
model: batch windows, settings never mixed, the queue limit, and what shutdown does to a
request that is waiting in a window."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from aiayn.serve.batcher import Batcher, QueueFullError, ShuttingDownError


def upper(lines: list[str], key) -> list[str]:
    return [f"{key}:{line.upper()}" for line in lines]


def run(coro_fn, **limits):
    """Run ``coro_fn(batcher)`` on a fresh event loop with a started batcher; returns its result."""
    async def main():
        with ThreadPoolExecutor(max_workers=1) as executor:
            batcher = Batcher(upper, executor=executor, **limits)
            batcher.start()
            try:
                return await coro_fn(batcher)
            finally:
                await batcher.stop()
    return asyncio.run(main())


def test_requests_in_one_window_share_a_batch_and_settings_never_mix():
    async def go(b):
        return await asyncio.gather(b.submit(["a"], 1), b.submit(["b", "c"], 1),
                                    b.submit(["d"], 2))
    (r1, n1), (r2, n2), (r3, n3) = run(go, max_batch_lines=8, max_wait_s=0.5,
                                       max_queue_lines=16)
    assert (r1, r2, r3) == (["1:A"], ["1:B", "1:C"], ["2:D"])
    assert (n1, n2, n3) == (3, 3, 1)


def test_a_full_queue_refuses_and_a_stopped_batcher_refuses():
    async def go(b):
        first = asyncio.ensure_future(b.submit(["a", "b"], 0))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="2 lines are waiting"):
            await b.submit(["c"], 0)
        await b.stop()  # finishes the queued request before it returns
        with pytest.raises(ShuttingDownError):
            await b.submit(["d"], 0)
        return await first
    assert run(go, max_batch_lines=8, max_wait_s=30, max_queue_lines=2) == (["0:A", "0:B"], 2)


def test_flush_answers_a_request_waiting_in_its_window_at_once():
    # The window is 60 s; without flush the request would still be waiting at the 10 s limit.
    async def go(b):
        waiting = asyncio.ensure_future(b.submit(["a"], 0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        b.flush()
        first = await asyncio.wait_for(waiting, 10)
        # after a flush new requests run as they come: no window, still accepted
        second = await asyncio.wait_for(b.submit(["b"], 0), 10)
        return first, second
    assert run(go, max_batch_lines=8, max_wait_s=60, max_queue_lines=16) == \
        ((["0:A"], 1), (["0:B"], 1))



def test_with_concurrency_two_batches_run_at_once_and_requests_gather_meanwhile():
    running, peak = [0], [0]
    lock = threading.Lock()

    def slow(lines, key):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return upper(lines, key)

    async def main():
        with ThreadPoolExecutor(max_workers=2) as executor:
            b = Batcher(slow, executor=executor, max_batch_lines=2, max_wait_s=0,
                        max_queue_lines=16, concurrency=2)
            b.start()
            try:
                first = []
                for x in "ab":  # each starts alone, in a slot of its own
                    first.append(asyncio.ensure_future(b.submit([x], 0)))
                    await asyncio.sleep(0.05)
                rest = [asyncio.ensure_future(b.submit([x], 0)) for x in "cde"]
                return await asyncio.gather(*first, *rest), b.batches_run
            finally:
                await b.stop()

    results, batches = asyncio.run(main())
    assert [r for r, _ in results] == [["0:A"], ["0:B"], ["0:C"], ["0:D"], ["0:E"]]
    assert peak[0] == 2
    # a and b ran alone (a slot each); c, d, e gathered while both were busy: c+d, then e
    assert [n for _, n in results] == [1, 1, 2, 2, 1] and batches == 4


def test_a_batcher_needs_a_slot():
    with pytest.raises(ValueError, match="concurrency=0"):
        Batcher(upper, executor=None, max_batch_lines=1, max_wait_s=0, max_queue_lines=1,
                concurrency=0)
