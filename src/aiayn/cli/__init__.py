"""The ``aiayn`` command line. Each subcommand lives in its own module of this package, which
defines ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; heavy imports (torch) happen
inside ``run`` so ``aiayn --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from aiayn import __version__
from aiayn.errors import UserError

# name -> module (in the order `aiayn --help` lists them)
COMMANDS = {
    "pipeline": "aiayn.cli.pipeline",
    "fetch": "aiayn.cli.fetch",
    "vocab": "aiayn.cli.vocab",
    "prepare": "aiayn.cli.prepare",
    "train": "aiayn.cli.train",
    "average": "aiayn.cli.average",
    "translate": "aiayn.cli.translate",
    "attention": "aiayn.cli.attention",
    "serve": "aiayn.cli.serve",
    "evaluate": "aiayn.cli.evaluate",
    "plot": "aiayn.cli.plot",
    "params": "aiayn.cli.params",
    "experiment": "aiayn.cli.experiment",
    "parse": "aiayn.cli.parse",
    "convert": "aiayn.cli.convert",
    "shortlist": "aiayn.cli.shortlist",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need' (Vaswani et al., 2017).",
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue  # a subcommand not built yet
        p = sub.add_parser(name, help=module.HELP, description=module.HELP,
                           formatter_class=_HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help text does not already name the default
    and there is one to name (not None, False or an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


#: Commands that decode many batches and then exit: they keep freed memory for reuse
#: (:func:`aiayn.devices.keep_freed_memory`). ``train`` does so where its process starts.
DECODING_COMMANDS = ("translate", "evaluate", "pipeline")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from aiayn.devices import keep_freed_memory, widen_onednn_cache

    widen_onednn_cache()  # a process the command line starts: before its first bf16 product
    if args.command in DECODING_COMMANDS:
        keep_freed_memory()  # each batch's logits and caches reuse the last one's pages
    try:
        return int(args._run(args) or 0)
    except (UserError, OSError) as err:
        # UserError: what the user gave (a file, an option, a config value) cannot be used;
        # OSError: a file that cannot be read or written (permissions, a full disk, a folder
        # where a file belongs); each message names the file or value
        if os.environ.get("AIAYN_DEBUG"):
            raise
        text = " ".join(str(err).split("\n"))
        print(f"aiayn {args.command}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aiayn {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:  # anything else is a bug in aiayn: keep its traceback
        traceback.print_exc()
        print(f"aiayn {args.command}: internal error: this is a bug in aiayn {__version__}, not "
              "a problem with your input; please report it with the traceback above and the "
              "command you ran", file=sys.stderr)
        return 1
