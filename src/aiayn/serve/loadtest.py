"""A bounded load generator for ``aiayn serve`` (used by the load test and
``bench/bench_serve.py``): ``requests`` POSTs from ``concurrency`` clients, each request with a
deadline, the whole run with a time limit. Only loopback addresses are accepted as targets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit


@contextlib.contextmanager
def serve_child(checkpoint: str | Path, *args: str, stdout: int | object | None = None,
                start_timeout_s: float = 120.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """``aiayn serve --checkpoint CHECKPOINT ARGS`` as a child process on a free port of
    127.0.0.1, yielding (process, base URL) once ``GET /health`` answers 200. On leaving, a
    child still running gets SIGTERM (the graceful shutdown), then SIGKILL after 20 s.

    ``stdout``: where its output goes (``subprocess.Popen``'s argument; stderr follows it).
    Raises:
        RuntimeError: the child exited, or did not answer within ``start_timeout_s`` seconds.
    """
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiayn", "serve", "--checkpoint", str(checkpoint),
         "--port", str(port), "--log-level", "warning", *args],
        stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"aiayn serve exited with {proc.returncode} before answering")
            if time.monotonic() > deadline:
                raise RuntimeError(f"aiayn serve did not answer {url}/health within "
                                   f"{start_timeout_s} s")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(frozen=True)
class LoadReport:
    """What a load run saw.

    Attributes:
        requests: sent; ``statuses``: how many got each HTTP status; ``errors``: how many got
            no answer (connection error or per-request timeout), by exception name.
        seconds: wall time of the whole run; ``requests_per_s``: answered requests / seconds.
        p50_ms, p95_ms, p99_ms, max_ms: latency percentiles of the answered requests.
    """

    requests: int
    concurrency: int
    statuses: dict[int, int]
    errors: dict[str, int]
    seconds: float
    requests_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> str:
        codes = ", ".join(f"{n} x {code}" for code, n in sorted(self.statuses.items()))
        return (f"{self.requests} requests from {self.concurrency} clients in {self.seconds:.1f} "
                f"s: {self.requests_per_s:.0f} requests/s; latency p50 {self.p50_ms:.0f} ms, "
                f"p95 {self.p95_ms:.0f} ms, p99 {self.p99_ms:.0f} ms, max {self.max_ms:.0f} ms; "
                f"{codes}" + (f"; no answer: {self.errors}" if self.errors else ""))


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ascending ``sorted_values``, nearest rank; NaN when
    empty."""
    if not sorted_values:
        return float("nan")
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def run_load(url: str, body: dict | None, *, requests: int = 2000, concurrency: int = 32,
             request_timeout_s: float = 30.0, time_limit_s: float = 120.0) -> LoadReport:
    """POST ``body`` (JSON) to ``url`` ``requests`` times from ``concurrency`` clients (GET
    when ``body`` is None).

    Raises:
        ValueError: ``url`` is not on 127.0.0.1 / localhost / ::1, or bad counts.
        TimeoutError: the whole run took longer than ``time_limit_s``.
    """
    host = urlsplit(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the load generator only targets loopback addresses, got {host!r}")
    if requests < 1 or concurrency < 1:
        raise ValueError(f"requests and concurrency must be >= 1, got {requests}, "
                         f"{concurrency}")
    return asyncio.run(asyncio.wait_for(
        _run(url, body, requests, concurrency, request_timeout_s), time_limit_s))


async def _run(url, body, requests, concurrency, request_timeout_s) -> LoadReport:
    import httpx

    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    latencies: list[float] = []
    todo = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=request_timeout_s) as client:
        async def client_loop() -> None:
            for _ in todo:
                start = time.perf_counter()
                try:
                    r = await (client.get(url) if body is None else client.post(url, json=body))
                except httpx.HTTPError as err:
                    errors[type(err).__name__] += 1
                    continue
                latencies.append((time.perf_counter() - start) * 1000)
                statuses[r.status_code] += 1

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    latencies.sort()
    return LoadReport(requests, concurrency, dict(statuses), dict(errors), seconds,
                      len(latencies) / seconds, percentile(latencies, 0.5),
                      percentile(latencies, 0.95), percentile(latencies, 0.99),
                      latencies[-1] if latencies else float("nan"))
