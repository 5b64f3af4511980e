"""``aiayn average``: average the last K checkpoints of a run (§6.1)."""

from __future__ import annotations

import argparse
import json

HELP = "Average the last K checkpoints of a run into one model (§6.1: 5 for base, 20 for big)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `aiayn train`")
    p.add_argument("--last", type=int, default=5, metavar="K",
                   help="how many of the newest checkpoints to average")
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="checkpoint directory to write (default: RUN_DIR/averaged)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from aiayn.errors import UserError
    from aiayn.rundir import RunDir
    from aiayn.training.average import average_checkpoints

    if args.last < 1:
        raise UserError(f"--last must be at least 1, got {args.last}")
    run = RunDir(args.run_dir)
    found = run.steps()
    if not found:
        raise UserError(f"no checkpoints in {run.checkpoints}")
    chosen = found[-args.last:]
    out = average_checkpoints(chosen, args.output or run.averaged)
    result = {"output": str(out), "averaged": [p.name for p in chosen],
              "requested": args.last}
    if args.json:
        print(json.dumps(result))
    else:
        note = "" if len(chosen) == args.last else f" (only {len(chosen)} exist)"
        print(f"averaged {len(chosen)} checkpoints{note}: {', '.join(result['averaged'])} "
              f"-> {out}")
    return 0
