"""``aiayn plot``: training curves of a run as a PNG (:func:`aiayn.viz.curves.plot_run`)."""

from __future__ import annotations

import argparse

from aiayn.rundir import CURVES

HELP = "Plot loss, perplexity, validation BLEU and learning rate against steps (PNG)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory of `aiayn train`, or of `aiayn pipeline --ensemble N` "
                        "(one figure, each member's curves drawn over each other)")
    p.add_argument("-o", "--output", default=None, metavar="PNG",
                   help=f"image to write (default: RUN_DIR/{CURVES})")


def run(args: argparse.Namespace) -> int:
    from aiayn.viz.curves import plot_run

    if args.output:
        from aiayn.fileio import check_output_file

        check_output_file(args.output)
    print(plot_run(args.run_dir, args.output))
    return 0
