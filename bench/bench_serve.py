"""Loopback load on ``aiayn serve``: requests/s and latency percentiles of ``POST /translate``
(one sentence per request, many clients at once, so the server's batching does the work),
beside ``GET /health`` on the same server as the peer (what HTTP alone costs on this machine).

    AIAYN_DATA_DIR=../shared/data python bench/bench_serve.py --checkpoint runs/multi30k-en-de \\
        --requests 2000 --concurrency 32 --json

Traffic goes to 127.0.0.1 only. Needs httpx (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import json

from aiayn.serve.loadtest import run_load, serve_child

SENTENCES = ["A man in a blue shirt is standing on a ladder cleaning windows.",
             "Two young children are playing in the sand at the beach.",
             "A woman with a large purse is walking by a gate.",
             "A group of people are sitting at a table in a restaurant."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint or run folder to serve")
    p.add_argument("--requests", type=int, default=2000, help="requests per endpoint")
    p.add_argument("--concurrency", type=int, default=32, help="clients at once")
    p.add_argument("--beam", type=int, default=None, help="default: the checkpoint's")
    p.add_argument("--time-limit-s", type=float, default=300,
                   help="seconds each endpoint's run may take at most")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("serve_args", nargs="*", help="extra `aiayn serve` options (after --)")
    args = p.parse_args()
    with serve_child(args.checkpoint, *args.serve_args) as (_, base):
        body = {"lines": [SENTENCES[0]]}
        if args.beam is not None:
            body["beam"] = args.beam
        run_load(base + "/translate", body, requests=args.concurrency * 2,
                 concurrency=args.concurrency)  # warm-up
        rows = {}
        for name, url, b in (("health", base + "/health", None),
                             ("translate", base + "/translate", body)):
            report = run_load(url, b, requests=args.requests, concurrency=args.concurrency,
                              time_limit_s=args.time_limit_s)
            rows[name] = {**report.__dict__, "summary": report.summary()}
            if not args.json:
                print(f"{name:10s} {report.summary()}", flush=True)
        rows["translate_vs_health"] = round(
            rows["translate"]["requests_per_s"] / rows["health"]["requests_per_s"], 3)
        if args.json:
            print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
