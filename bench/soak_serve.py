"""Soak ``aiayn serve``: a steady loopback load for minutes, watching the server's memory, then
SIGTERM with requests in flight.

    python bench/soak_serve.py --minutes 10 --json > soak.json

1. Starts ``aiayn serve`` as a child process on a free port of 127.0.0.1
   (:func:`aiayn.serve.loadtest.serve_child`) on ``--checkpoint``, or on a small random-weight
   checkpoint it makes (longer inputs than the tests' tiny one, so requests of every size fit).
2. Load: ``--clients`` threads, each with its own keep-alive connection, send requests one after
   another (with ``--think-ms`` between them) until the time is up: ``POST /translate`` of 1 to 4
   lines of 10 to 500 characters, beam 1 to 4, some with n-best 2; one request in
   ``--attention-every`` is ``POST /attention``, with or without a target. Every request has a
   timeout; the whole run is bounded in time and in count (``--max-requests``).
   The first ``--warmup-s`` seconds are a warm-up: counted apart, and the server's RSS
   (``VmRSS`` of /proc/PID/status, sampled every ``--sample-s``) at its end is the baseline.
3. SIGTERM: ``--inflight`` long requests (4 lines of ``--sigterm-chars`` characters, beam 4;
   each with its own alpha, so they are decoded as separate batches, one after another, and
   stay in flight), the signal once
   the server counts them all (``GET /info``), then every one of them must be answered 200 and
   the server must exit 0 (uvicorn's graceful shutdown, ``--graceful-timeout-s``).

It fails (exit status 1, saying why) when any answer is not 200 or 429, a request gets no answer
(connection error or timeout), the RSS after the warm-up grows more than ``--max-rss-growth-mib``
above the baseline, the server logs an error, or the SIGTERM phase loses a request or does not
exit 0. Figures go to stdout (``--json``: as JSON, the text then goes to stderr).

Traffic goes to 127.0.0.1 only. Needs httpx (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from aiayn.serve.loadtest import percentile, serve_child

WORDS = ["a", "man", "in", "red", "shirt", "rides", "bike", "two", "dogs", "play", "the", "snow",
         "woman", "with", "large", "purse", "is", "walking", "by", "gate", "children", "are",
         "sitting", "at", "table", "restaurant"]
ACCEPTED = (200, 429)
MIB = 1 << 20


def make_checkpoint(path: Path) -> Path:
    """A random-weight model like the tests' tiny one (N=2, d_model 64, h=4), with a vocabulary
    learned on ``WORDS`` and a positional table long enough for 240-character lines. Its output
    bias rules out </s>, so that every translation runs to the length limit (0.5 x the input +
    10 tokens): a request's cost follows its size, as with a trained model, rather than
    whenever a random model happens to stop."""
    import torch

    from aiayn.checkpoint import save_checkpoint
    from aiayn.config import load_config
    from aiayn.data.vocab import Vocabulary
    from aiayn.model import Transformer

    rng = random.Random(0)
    texts = [" ".join(rng.choices(WORDS, k=12)).capitalize() + "." for _ in range(200)]
    vocab = Vocabulary.learn(texts, 200)
    cfg = load_config("tiny")
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=len(vocab), max_len=512,
                                       final_logits_bias=True),
        decode=dataclasses.replace(cfg.decode, max_len_a=0.5, max_len_b=10))
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    with torch.no_grad():
        model.final_logits_bias[vocab.eos_id] = -1e4
    return save_checkpoint(path, model, cfg, vocab)


def sentence(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return (" ".join(words)[: chars - 1].rstrip() + ".").capitalize()


def make_request(rng: random.Random, attention_every: int) -> tuple[str, dict]:
    """(path, JSON body) of one request of the mix."""
    if rng.randrange(attention_every) == 0:
        body: dict = {"source": sentence(rng, rng.randint(10, 60))}
        if rng.random() < 0.5:
            body["target"] = sentence(rng, rng.randint(10, 60))
        else:
            body["beam"] = rng.randint(1, 4)
        return "/attention", body
    beam = rng.randint(1, 4)
    body = {"lines": [sentence(rng, rng.choice((10, 30, 60, 120, 240, 500)))
                      for _ in range(rng.randint(1, 4))], "beam": beam}
    if beam >= 2 and rng.random() < 0.25:
        body["nbest"] = 2
    return "/translate", body


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (bytes), threads and open file descriptors of process ``pid``."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
            elif key == "Threads":
                out["threads"] = int(value)
    out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


@dataclasses.dataclass
class Tally:
    """What one phase of the load saw (guarded by ``lock``)."""

    sent: int = 0
    statuses: Counter = dataclasses.field(default_factory=Counter)
    by_path: dict = dataclasses.field(default_factory=dict)
    dropped: Counter = dataclasses.field(default_factory=Counter)
    latencies_ms: list = dataclasses.field(default_factory=list)
    unexpected: list = dataclasses.field(default_factory=list)  # first few odd answers

    def summary(self, seconds: float) -> dict:
        lat = sorted(self.latencies_ms)
        return {"requests": self.sent, "seconds": round(seconds, 1),
                "requests_per_s": round(self.sent / seconds, 1) if seconds else None,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "by_path": {p: {str(k): v for k, v in sorted(c.items())}
                            for p, c in sorted(self.by_path.items())},
                "dropped": sum(self.dropped.values()), "dropped_by_error": dict(self.dropped),
                "latency_ms": {"p50": _ms(percentile(lat, 0.5) if lat else None),
                               "p95": _ms(percentile(lat, 0.95) if lat else None),
                               "p99": _ms(percentile(lat, 0.99) if lat else None),
                               "max": _ms(lat[-1] if lat else None)},
                "unexpected": self.unexpected}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run_load(url: str, *, clients: int, warmup_s: float, soak_s: float, think_s: float,
             request_timeout_s: float, max_requests: int, attention_every: int, seed: int,
             pid: int, sample_s: float, log=print) -> dict:
    """The load and the RSS samples; returns the figures of the warm-up and the soak."""
    lock = threading.Lock()
    tallies = {"warmup": Tally(), "soak": Tally()}
    samples: list[dict] = []
    start = time.monotonic()
    warm_end, end = start + warmup_s, start + warmup_s + soak_s
    budget = iter(range(max_requests))
    stop = threading.Event()

    def client(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        with httpx.Client(base_url=url, timeout=request_timeout_s) as http:
            while not stop.is_set() and time.monotonic() < end:
                with lock:
                    if next(budget, None) is None:
                        return
                path, body = make_request(rng, attention_every)
                t0 = time.monotonic()
                phase = tallies["warmup" if t0 < warm_end else "soak"]
                try:
                    r = http.post(path, json=body)
                except httpx.HTTPError as err:
                    with lock:
                        phase.sent += 1
                        phase.dropped[type(err).__name__] += 1
                    continue
                ms = (time.monotonic() - t0) * 1000
                with lock:
                    phase.sent += 1
                    phase.statuses[r.status_code] += 1
                    phase.by_path.setdefault(path, Counter())[r.status_code] += 1
                    phase.latencies_ms.append(ms)
                    if r.status_code not in ACCEPTED and len(phase.unexpected) < 10:
                        phase.unexpected.append({"path": path, "body": body,
                                                 "status": r.status_code,
                                                 "answer": r.text[:300]})
                if think_s:
                    time.sleep(think_s)

    def sample(phase: str) -> dict:
        s = {"t_s": round(time.monotonic() - start, 1), "phase": phase, **proc_status(pid)}
        samples.append(s)
        return s

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(clients)]
    for t in threads:
        t.start()
    baseline = None
    next_log = warm_end + 60
    try:
        sample("warmup")
        while time.monotonic() < end and any(t.is_alive() for t in threads):
            now = time.monotonic()
            if baseline is None and now >= warm_end:
                baseline = sample("start")  # the baseline: right after the warm-up
            elif now >= next_log:
                s = sample("soak")
                with lock:
                    sent = tallies["soak"].sent
                    dropped = sum(tallies["soak"].dropped.values())
                log(f"  {(now - warm_end) / 60:4.1f} min: {sent} requests, {dropped} dropped, "
                    f"RSS {s['VmRSS'] / MIB:.1f} MiB")
                next_log += 60
            elif not samples or now - start - samples[-1]["t_s"] >= sample_s:
                sample("warmup" if baseline is None else "soak")
            time.sleep(min(0.2, max(0.0, min(end, warm_end if baseline is None else end) - now)))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=request_timeout_s + 5)
    if baseline is None:
        baseline = sample("start")
    last = sample("end")
    after = [s for s in samples if s["phase"] in ("start", "soak", "end")]
    rss_max = max(s["VmRSS"] for s in after)
    return {
        "warmup": tallies["warmup"].summary(warmup_s),
        "soak": tallies["soak"].summary(max(1e-9, time.monotonic() - warm_end)),
        "clients_still_running": sum(t.is_alive() for t in threads),
        "rss_mib": {"start": round(baseline["VmRSS"] / MIB, 1),
                    "max": round(rss_max / MIB, 1), "end": round(last["VmRSS"] / MIB, 1),
                    "growth_end": round((last["VmRSS"] - baseline["VmRSS"]) / MIB, 1),
                    "growth_max": round((rss_max - baseline["VmRSS"]) / MIB, 1),
                    "first_sample": round(samples[0]["VmRSS"] / MIB, 1),
                    "hwm": round(last["VmHWM"] / MIB, 1)},
        "threads": {"start": baseline["threads"], "end": last["threads"]},
        "fds": {"start": baseline["fds"], "end": last["fds"]},
        "samples": [{"t_s": s["t_s"], "phase": s["phase"],
                     "rss_mib": round(s["VmRSS"] / MIB, 1), "threads": s["threads"],
                     "fds": s["fds"]} for s in samples],
    }


def sigterm_phase(url: str, proc: subprocess.Popen, *, inflight: int, chars: int,
                  graceful_timeout_s: float, request_timeout_s: float, seed: int) -> dict:
    """``inflight`` long requests (4 lines of ``chars`` characters, beam 4, each with its own
    alpha, so that they are decoded one batch after another on the model's one thread and stay
    in flight), SIGTERM once the server counts them all, then their answers and the server's
    exit status."""
    rng = random.Random(seed)
    bodies = [{"lines": [sentence(rng, chars) for _ in range(4)], "beam": 4,
               "alpha": round(0.5 + 0.01 * i, 2)} for i in range(inflight)]
    results: list[dict] = [{} for _ in range(inflight)]
    ready = threading.Barrier(inflight + 1)

    def one(i: int) -> None:
        res = results[i]
        with httpx.Client(timeout=request_timeout_s) as http:
            ready.wait()
            res["sent"] = time.monotonic()
            try:
                r = http.post(url + "/translate", json=bodies[i])
                res["status"] = r.status_code
                if r.status_code == 200:
                    res["lines"] = len(r.json()["translations"])
                else:
                    res["answer"] = r.text[:300]
            except httpx.HTTPError as err:
                res["error"] = type(err).__name__
            res["done"] = time.monotonic()

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(inflight)]
    for t in threads:
        t.start()
    seen = 0
    with httpx.Client(timeout=2) as http:
        ready.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen = http.get(url + "/info").json()["load"]["requests_in_flight"]
            if seen >= inflight or all(not t.is_alive() for t in threads):
                break
            time.sleep(0.005)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=graceful_timeout_s + request_timeout_s)
    try:
        rc = proc.wait(timeout=graceful_timeout_s + 30)
    except subprocess.TimeoutExpired:
        rc = None
    exited = time.monotonic()
    in_flight = [r for r in results if r.get("sent", 1e18) <= signalled
                 and r.get("done", 1e18) > signalled]
    try:
        httpx.get(url + "/health", timeout=2)
        still_listening = True
    except httpx.TransportError:
        still_listening = False

    def outcome(r: dict) -> str:
        return str(r.get("status", r.get("error", "no answer")))

    return {
        "requests": inflight,
        "server_in_flight_at_signal": seen,
        "in_flight_at_signal": len(in_flight),
        "answered_before_signal": sum(1 for r in results if r.get("done", 1e18) <= signalled),
        "statuses_of_in_flight": dict(Counter(outcome(r) for r in in_flight)),
        "statuses_all": dict(Counter(outcome(r) for r in results)),
        "last_answer_after_signal_s": round(max((r["done"] for r in results if "done" in r),
                                                default=signalled) - signalled, 3),
        "exit_code": rc,
        "exit_after_signal_s": round(exited - signalled, 3) if rc is not None else None,
        "still_listening_after_exit": still_listening,
        "unexpected": [r.get("answer") for r in results if "answer" in r][:5],
    }


def verdict(report: dict, max_growth_mib: float) -> list[str]:
    """Why the soak failed; empty when it passed."""
    why = []
    for phase in ("warmup", "soak"):
        p = report["load"][phase]
        odd = {k: v for k, v in p["statuses"].items() if int(k) not in ACCEPTED}
        if odd:
            why.append(f"{phase}: answers other than 200/429: {odd}")
        if p["dropped"]:
            why.append(f"{phase}: {p['dropped']} requests got no answer: {p['dropped_by_error']}")
    if report["load"]["soak"]["requests"] == 0:
        why.append("no request was sent after the warm-up")
    growth = report["load"]["rss_mib"]["growth_max"]
    if growth > max_growth_mib:
        why.append(f"RSS grew {growth} MiB after the warm-up (bound {max_growth_mib} MiB)")
    if report["load"]["clients_still_running"]:
        why.append(f"{report['load']['clients_still_running']} client threads did not finish")
    if report["server_log_errors"]:
        why.append(f"the server logged {len(report['server_log_errors'])} error lines")
    s = report["sigterm"]
    if s is None:
        why.append("the SIGTERM phase did not run")
        return why
    if s["in_flight_at_signal"] == 0:
        why.append("SIGTERM: no request was in flight at the signal (the phase proved nothing)")
    if set(s["statuses_all"]) != {"200"}:
        why.append(f"SIGTERM: requests in flight were not all answered 200: {s['statuses_all']}")
    if s["exit_code"] != 0:
        why.append(f"SIGTERM: the server exited with {s['exit_code']}, not 0")
    if s["still_listening_after_exit"]:
        why.append("SIGTERM: something still answers on the server's port after it exited")
    return why


def text_report(r: dict) -> str:
    load, s = r["load"], r["sigterm"]
    soak, warm, rss = load["soak"], load["warmup"], load["rss_mib"]
    lat = soak["latency_ms"]
    lines = [
        (f"aiayn serve soak: {r['minutes']} min after a {r['warmup_s']} s warm-up, "
         f"{r['clients']} clients, checkpoint {r['checkpoint']}"),
        f"  warm-up: {warm['requests']} requests, {warm['statuses']}, dropped {warm['dropped']}",
        (f"  soak:    {soak['requests']} requests ({soak['requests_per_s']}/s), "
         f"{soak['statuses']}, dropped {soak['dropped']}"),
        f"           by path {soak['by_path']}",
        (f"  latency: p50 {lat['p50']} ms, p95 {lat['p95']} ms, p99 {lat['p99']} ms, "
         f"max {lat['max']} ms"),
        (f"  RSS:     start {rss['start']} MiB (after warm-up; {rss['first_sample']} MiB before "
         f"it), max {rss['max']}, end {rss['end']}, growth {rss['growth_end']} at the end, "
         f"{rss['growth_max']} at most (bound {r['max_rss_growth_mib']} MiB)"),
        (f"  threads {load['threads']['start']} -> {load['threads']['end']}, open fds "
         f"{load['fds']['start']} -> {load['fds']['end']}"),
    ]
    if s:
        lines.append(
            f"  SIGTERM: {s['requests']} long requests, {s['in_flight_at_signal']} in flight at "
            f"the signal (server counted {s['server_in_flight_at_signal']}), "
            f"{s['answered_before_signal']} answered before it; in flight: "
            f"{s['statuses_of_in_flight']}; last answer {s['last_answer_after_signal_s']} s "
            f"after the signal; exit {s['exit_code']} after {s['exit_after_signal_s']} s")
    lines.append("  PASS" if r["passed"] else "  FAIL: " + "; ".join(r["failures"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="checkpoint or run folder to serve (default: a small "
                   "random-weight one made for the soak)")
    p.add_argument("--minutes", type=float, default=10.0, help="soak length after the warm-up")
    p.add_argument("--warmup-s", type=float, default=20.0,
                   help="seconds of load before the RSS baseline")
    p.add_argument("--clients", type=int, default=4, help="client threads")
    p.add_argument("--think-ms", type=float, default=10.0,
                   help="pause of each client between its requests")
    p.add_argument("--attention-every", type=int, default=10,
                   help="one request in N is POST /attention")
    p.add_argument("--max-requests", type=int, default=1_000_000,
                   help="stop sending after this many requests in all")
    p.add_argument("--request-timeout-s", type=float, default=30.0,
                   help="a request with no answer by then is dropped")
    p.add_argument("--sample-s", type=float, default=5.0, help="RSS sampling interval")
    p.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                   help="fail when the RSS rises more than this above its value after the "
                        "warm-up")
    p.add_argument("--inflight", type=int, default=10,
                   help="long requests in flight when SIGTERM is sent")
    p.add_argument("--sigterm-chars", type=int, default=900,
                   help="characters of each of the 4 lines of those requests (within the "
                        "server's --max-chars and the model's max_len)")
    p.add_argument("--graceful-timeout-s", type=float, default=30.0,
                   help="the server's --graceful-timeout-s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    p.add_argument("serve_args", nargs="*", help="extra `aiayn serve` options (after --)")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.inflight < 1 or args.warmup_s < 0:
        p.error("--minutes must be > 0, --clients and --inflight >= 1, --warmup-s >= 0")
    out = sys.stderr if args.json else sys.stdout

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="aiayn-soak-") as tmp:
        checkpoint = args.checkpoint or str(make_checkpoint(Path(tmp) / "ckpt"))
        log_path = Path(tmp) / "serve.log"
        report: dict = {"minutes": args.minutes, "warmup_s": args.warmup_s,
                        "clients": args.clients, "think_ms": args.think_ms,
                        "checkpoint": args.checkpoint or "(random-weight, made for the soak)",
                        "max_rss_growth_mib": args.max_rss_growth_mib, "sigterm": None}
        with open(log_path, "wb") as server_log, serve_child(
                checkpoint, "--precision", "fp32", "--graceful-timeout-s",
                str(args.graceful_timeout_s), *args.serve_args, stdout=server_log) as (proc, url):
            log(f"aiayn serve (pid {proc.pid}) on {url}: {args.warmup_s} s warm-up, then "
                f"{args.minutes} min of load from {args.clients} clients")
            report["load"] = run_load(
                url, clients=args.clients, warmup_s=args.warmup_s, soak_s=args.minutes * 60,
                think_s=args.think_ms / 1000, request_timeout_s=args.request_timeout_s,
                max_requests=args.max_requests, attention_every=args.attention_every,
                seed=args.seed, pid=proc.pid, sample_s=args.sample_s, log=log)
            log(f"SIGTERM with {args.inflight} long requests in flight")
            report["sigterm"] = sigterm_phase(
                url, proc, inflight=args.inflight, chars=args.sigterm_chars,
                graceful_timeout_s=args.graceful_timeout_s,
                request_timeout_s=args.request_timeout_s, seed=args.seed)
        server_text = log_path.read_text(errors="replace")
        report["server_log_errors"] = [line for line in server_text.splitlines()
                                       if "ERROR" in line or "Traceback" in line][:20]
        report["server_log_tail"] = server_text.splitlines()[-15:]
    report["failures"] = verdict(report, args.max_rss_growth_mib)
    report["passed"] = not report["failures"]
    print(text_report(report), file=out, flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
