"""``aiayn serve``: an HTTP server (FastAPI + uvicorn) with a JSON API and a page at ``/``."""

from __future__ import annotations

import argparse
import signal
import sys

from aiayn.errors import UserError
from aiayn.precision import DECODE_PRECISIONS

HELP = ("Serve a checkpoint over HTTP: POST /translate (batched), POST /attention, GET /health, "
        "GET /info, and a page at / to translate and look at every head's attention.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aiayn.cli.translate import workers_value
    from aiayn.serve.limits import ServeLimits

    d = ServeLimits()
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="PATH",
                   help="checkpoint directory, or a run directory (the model its pipeline "
                        "chose on the validation set, ensemble and all; else its averaged, "
                        "best or newest checkpoint); several paths make an ensemble")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--precision", choices=DECODE_PRECISIONS, default=None,
                   help="as aiayn translate's (default: what a finished run recorded, "
                        "else fp32)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for decoding (default: torch's choice)")
    p.add_argument("--shortlist", default=None, metavar="VMAP",
                   help="as aiayn translate's: a vocabulary shortlist (`aiayn shortlist`); "
                        "faster, changes outputs (off by default)")
    p.add_argument("--workers", type=workers_value, default="auto", metavar="N",
                   help="decode /translate batches in N one-thread processes over the one "
                        "model, forked at start, up to N batches at once (the same answers); "
                        "auto: one per torch thread on CPU (default: auto)")
    g = p.add_argument_group("limits (a request over one is refused with 413, 422 or 429)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="request body size; more gets 413")
    g.add_argument("--max-lines", type=int, default=d.max_lines,
                   help="lines per request; more gets 413")
    g.add_argument("--max-chars", type=int, default=d.max_chars,
                   help="characters per line or sentence; more gets 413")
    g.add_argument("--max-attention-tokens", type=int, default=d.max_attention_tokens,
                   help="subword tokens of an /attention source or target; more gets 413")
    g.add_argument("--max-concurrent", type=int, default=d.max_concurrent,
                   help="requests answered at once; one more gets 429")
    g.add_argument("--max-queue-lines", type=int, default=d.max_queue_lines,
                   help="lines waiting for a batch; more get 429")
    g.add_argument("--max-batch-lines", type=int, default=d.max_batch_lines,
                   help="lines decoded together")
    g.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                   help="how long a request waits for others to share its batch")
    g.add_argument("--max-beam", type=int, default=d.max_beam,
                   help="the largest beam a request may ask for; more gets 422")
    p.add_argument("--graceful-timeout-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, how long requests in flight may take to finish")
    p.add_argument("--keep-alive-s", type=float, default=75.0,
                   help="how long an idle keep-alive connection stays open (seconds). Longer "
                        "than uvicorn's 5 s, so that a client reusing a connection rarely "
                        "meets the server closing it (the request would fail unanswered); "
                        "behind a proxy, keep it above the proxy's idle timeout")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from aiayn.cli.translate import load_translator
    from aiayn.serve.app import ServeLimits, create_app

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1 … 65535, got {args.port}")
    if not args.keep_alive_s > 0:
        raise UserError(f"--keep-alive-s must be a positive number of seconds, "
                         f"got {args.keep_alive_s}")
    limits = ServeLimits(
        max_body_bytes=args.max_body_bytes, max_lines=args.max_lines, max_chars=args.max_chars,
        max_attention_tokens=args.max_attention_tokens, max_concurrent=args.max_concurrent,
        max_queue_lines=args.max_queue_lines, max_batch_lines=args.max_batch_lines,
        max_wait_ms=args.max_wait_ms, max_beam=args.max_beam)
    if args.threads:
        torch.set_num_threads(args.threads)
    translator = load_translator(args, "serve")
    app = create_app(translator, limits)
    path = " + ".join(translator.source)
    workers = app.state.workers
    print(f"aiayn serve: {path} on http://{args.host}:{args.port}/, decoding in "
          f"{'this process' if workers == 1 else f'{workers} one-thread processes'} "
          "(Ctrl-C or SIGTERM stops after the requests in flight)", file=sys.stderr, flush=True)
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, lets requests in flight finish
    # (up to the graceful timeout), then runs the app's shutdown, which drains the batcher.
    # The batcher's windows close at the signal, so a request in flight is decoded at once
    # rather than when its window (--max-wait-ms) would have closed.
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            app.state.begin_shutdown()

    server = Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        timeout_graceful_shutdown=args.graceful_timeout_s,
        timeout_keep_alive=args.keep_alive_s, access_log=False))
    # uvicorn re-raises the signal it caught once it has shut down, to the handler that was
    # there before; for SIGTERM that is this no-op, so a clean stop exits with status 0
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not server.started:
        raise UserError(f"could not serve on {args.host}:{args.port} (see the log above)")
    print("aiayn serve: stopped", file=sys.stderr)
    return 0
