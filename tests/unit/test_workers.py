"""aiayn.decoding.workers: how many processes decode, what a failing worker does, and the
server's pool of processes that stay alive."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from aiayn.decoding.workers import (WorkerPool, choose_workers, fork_available,
                                   run_in_workers)
from aiayn.errors import ConfigError

needs_fork = pytest.mark.skipif(not fork_available(), reason="needs fork")


@needs_fork
def test_auto_takes_one_process_per_thread_on_cpu_and_one_where_it_cannot_fork_or_sample():
    assert choose_workers("auto", "cpu", 10, threads=2) == 2
    assert choose_workers("auto", "cpu", 1, threads=2) == 1  # one batch: no second process
    assert choose_workers("auto", "cpu", 10, threads=1) == 1
    assert choose_workers("auto", "cpu", 10, threads=4, sampling=True) == 1
    assert choose_workers("auto", "cuda", 10, threads=4) == 1
    assert choose_workers("auto", "cpu", 10) == min(10, torch.get_num_threads())
    assert choose_workers(3, "cpu", 2) == 2


@pytest.mark.parametrize("value", [0, -1, "two", 1.5, True])
def test_a_bad_count_is_refused_naming_it(value):
    with pytest.raises(ConfigError, match="workers must be"):
        choose_workers(value, "cpu", 4)


def test_several_workers_are_refused_on_a_gpu_and_with_sampling():
    with pytest.raises(ConfigError, match="CPU only"):
        choose_workers(2, "cuda", 4)
    if fork_available():
        with pytest.raises(ConfigError, match="sampling"):
            choose_workers(2, "cpu", 4, sampling=True)


@needs_fork
def test_results_come_back_by_batch_and_finish_once_per_worker():
    seen: dict[int, int] = {}
    done = run_in_workers(lambda x: (x * x, torch.get_num_threads(), os.getpid()),
                          list(range(7)), 3, on_result=lambda b, r: seen.__setitem__(b, r),
                          finish=os.getpid)
    assert sorted(seen) == list(range(7))
    assert [seen[b][0] for b in range(7)] == [b * b for b in range(7)]
    assert {seen[b][1] for b in seen} == {1}  # one thread in each child
    pids = {seen[b][2] for b in seen}
    assert len(pids) == 3 and os.getpid() not in pids and set(done) == pids
    assert all(seen[b][2] == seen[b % 3][2] for b in seen)  # worker w takes w, w + 3, ...


@needs_fork
def test_a_worker_that_raises_gives_its_traceback_and_one_that_dies_its_exit_code():
    def fails(x):
        if x == 3:
            raise ValueError("batch three is bad")
        return x

    with pytest.raises(RuntimeError, match="(?s)decode worker 1 failed.*batch three is bad"):
        run_in_workers(fails, list(range(6)), 2, on_result=lambda b, r: None)

    def dies(x):
        if x == 2:
            os._exit(7)
        return x

    with pytest.raises(RuntimeError, match="decode worker 0 .* died \\(exit code 7\\)"):
        run_in_workers(dies, list(range(6)), 2, on_result=lambda b, r: None)


def _slow_square(x):
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
    time.sleep(0.3)
    return x * x, os.getpid(), torch.get_num_threads(), start, time.monotonic()


@needs_fork
def test_a_pool_runs_tasks_from_several_threads_at_once_in_its_processes():
    with WorkerPool(_slow_square, 2) as pool:
        assert pool.workers == 2
        out: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, pool.run(i)))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert [out[i][0] for i in range(4)] == [0, 1, 4, 9]
        assert {out[i][2] for i in out} == {1}  # one thread in each child
        pids = {out[i][1] for i in out}
        assert len(pids) == 2 and os.getpid() not in pids
        # two at once: some task of one child ran while a task of the other did
        spans = [(out[i][1], out[i][3], out[i][4]) for i in out]
        assert any(pa != pb and sa < eb and sb < ea
                   for pa, sa, ea in spans for pb, sb, eb in spans)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(1)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no pickling")


@needs_fork
def test_a_pool_raises_the_task_error_and_goes_on_without_a_worker_that_died():
    def task(x):
        if x == "bad":
            raise KeyError("bad input")
        if x == "odd":
            raise Unpicklable("cannot travel")
        if x == "die":
            os._exit(5)
        return x

    with WorkerPool(task, 2) as pool:
        with pytest.raises(KeyError, match="bad input") as err:
            pool.run("bad")
        assert any("in decode worker" in note for note in err.value.__notes__)
        with pytest.raises(RuntimeError, match="(?s)failed.*cannot travel"):
            pool.run("odd")
        assert pool.run("fine") == "fine"  # an error in a task leaves its worker alive
        with pytest.raises(RuntimeError, match="died \\(exit code 5\\); 1 remain"):
            pool.run("die")
        assert pool.workers == 1 and pool.run("still") == "still"
        with pytest.raises(RuntimeError, match="died"):
            pool.run("die")
        with pytest.raises(RuntimeError, match="every decode worker has died"):
            pool.run("fine")


def test_a_pool_needs_a_process():
    with pytest.raises(ValueError, match="at least one process, got 0"):
        WorkerPool(lambda x: x, 0)
