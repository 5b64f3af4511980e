"""``aiayn shortlist``: build a vocabulary shortlist for a model from its training data."""

from __future__ import annotations

import argparse
import json

HELP = ("Build a vocabulary shortlist (CTranslate2's vmap format) from a run's training data, "
        "for `aiayn translate --shortlist`: faster decoding that changes outputs.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="the run directory or checkpoint whose vocabulary and training data "
                        "to use (an ensemble's run directory, or any one member: they share "
                        "both)")
    p.add_argument("-o", "--output", required=True, metavar="FILE",
                   help="the vmap file to write (one line per source token: "
                        "SOURCE<TAB>TARGET TARGET ...)")
    p.add_argument("--first", type=int, default=300, metavar="N",
                   help="the N most frequent target tokens every sentence may produce")
    p.add_argument("--best", type=int, default=50, metavar="N",
                   help="each source token's N most likely translations (IBM Model 1)")
    p.add_argument("--iterations", type=int, default=5, help="IBM Model 1 EM iterations")
    p.add_argument("--max-sentences", type=int, default=200_000, metavar="N",
                   help="learn from the first N training pairs (0: all)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    import sys

    from aiayn.decoding.shortlist import build_shortlist
    from aiayn.errors import UserError
    from aiayn.fileio import check_output_file
    from aiayn.translator import Translator

    for name in ("first", "best", "max_sentences"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got "
                            f"{getattr(args, name)}")
    if args.iterations < 1:
        raise UserError(f"--iterations must be at least 1, got {args.iterations}")
    out = check_output_file(args.output)
    loaded = Translator.from_pretrained(args.checkpoint, device="cpu", precision="fp32")
    config, vocab = loaded.config, loaded.vocab
    log = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    shortlist = build_shortlist(config, vocab, first=args.first, best=args.best,
                                iterations=args.iterations, max_sentences=args.max_sentences,
                                progress=log)
    shortlist.save(out, vocab)
    V = len(shortlist.offsets) - 1
    result = {"output": str(out), "always": int(shortlist.always.numel()),
              "source_tokens": V, "targets_per_source_token":
              round(shortlist.targets.numel() / max(V, 1), 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"shortlist: {result['always']} tokens always, "
              f"{result['targets_per_source_token']} a source token on average -> {out}")
    return 0
