"""``aiayn average``: average the last K checkpoints of a run, or those of a span of updates
(§6.1)."""

from __future__ import annotations

import argparse
import json

HELP = ("Average the last K checkpoints of a run, or those of a span of updates, into one model "
        "(§6.1: the last 5 for base, 20 for big).")
DEFAULT_LAST = 5  # §6.1, base


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `aiayn train`")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--last", type=int, default=None, metavar="K",
                       help=f"how many of the newest checkpoints to average (default "
                            f"{DEFAULT_LAST})")
    which.add_argument("--updates", default=None, metavar="FIRST:LAST",
                       help="the checkpoints of updates FIRST to LAST, both included (either "
                            "may be left out), such as 94000:100000")
    which.add_argument("--last-updates", type=int, default=None, metavar="U",
                       help="the checkpoints of the last U updates (step >= newest - U): "
                            "5600 is §6.1's base average (5 checkpoints 1,400 updates apart), "
                            "11400 big's (20, 600 apart)")
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="checkpoint directory to write (default: RUN_DIR/averaged)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from aiayn.errors import UserError
    from aiayn.rundir import RunDir
    from aiayn.training.average import (average_checkpoints, parse_update_range,
                                        select_checkpoints, update_span)

    last = args.last
    if last is None and args.updates is None and args.last_updates is None:
        last = DEFAULT_LAST
    updates = None if args.updates is None else parse_update_range(args.updates)
    run = RunDir(args.run_dir)
    found = run.steps()
    if not found:
        raise UserError(f"no checkpoints in {run.checkpoints}")
    chosen = select_checkpoints(found, last=last, updates=updates,
                                last_updates=args.last_updates)
    out = average_checkpoints(chosen, args.output or run.averaged)
    span = update_span(chosen)
    result = {"output": str(out), "averaged": [p.name for p in chosen], **span}
    if last is not None:
        result["requested"] = last
    if args.json:
        print(json.dumps(result))
    else:
        note = "" if last is None or len(chosen) == last else f" (only {len(chosen)} exist)"
        where = (f", updates {span['first_update']} to {span['last_update']} (a span of "
                 f"{span['span_updates']})" if span else "")
        print(f"averaged {len(chosen)} checkpoints{note}{where}: "
              f"{', '.join(result['averaged'])} -> {out}")
    return 0
