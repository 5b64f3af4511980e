"""``aiayn attention``: draw the attention weights of one translation (paper Figures 3-5)."""

from __future__ import annotations

import argparse
import json
import sys

from aiayn.errors import UserError
from aiayn.precision import DECODE_PRECISIONS

HELP = ("Draw the attention weights of one translation as the paper's Figures 3-5 do (lines "
        "between two columns of tokens) or as heat maps; --json writes the weights.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="PATH",
                   help="checkpoint directory, or a run directory (the model its pipeline "
                        "chose; else its averaged, best or newest checkpoint); an ensemble "
                        "shows its first member's attention over the ensemble's translation")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="SENTENCE", help="the source sentence")
    src.add_argument("-i", "--input", metavar="FILE",
                     help="a UTF-8 text file (.gz ok); with --line, which line to take")
    p.add_argument("--line", type=int, default=1, metavar="N",
                   help="with -i: the line to take, counting from 1")
    p.add_argument("--target", default=None, metavar="SENTENCE",
                   help="force this translation (default: the model's own beam-search output)")
    p.add_argument("--kind", choices=("encoder", "decoder", "cross"), default="encoder",
                   help="encoder self-attention, masked decoder self-attention, or "
                        "encoder-decoder attention")
    p.add_argument("--layer", type=int, default=None, metavar="L",
                   help="layer, counting from 1 (default: the last; the paper's figures show "
                        "layer 5 of 6)")
    p.add_argument("--head", default="all", metavar="H|all",
                   help="head, counting from 1, or 'all' (one colour per head)")
    p.add_argument("--style", choices=("lines", "heatmap"), default="lines",
                   help="lines: the paper's two columns of tokens; heatmap: one map per head")
    p.add_argument("-o", "--output", default=None, metavar="FILE.png", help="image to write")
    p.add_argument("--json", action="store_true",
                   help="print every layer and head of the kind (weights, shapes, tokens) as "
                        "one JSON object on standard output")
    p.add_argument("--beam", type=int, default=None, metavar="K",
                   help="beam size of the translation (default: the checkpoint's, 4 as §6.1)")
    p.add_argument("--alpha", type=float, default=None,
                   help="length penalty (default: the checkpoint's decode.alpha)")
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument("--precision", choices=DECODE_PRECISIONS, default=None,
                   help="as aiayn translate's (default: what a finished run recorded, "
                        "else fp32)")


def _source(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    from aiayn.evaluation.bleu import read_lines

    lines = read_lines(args.input)
    if not 1 <= args.line <= len(lines):
        raise UserError(f"--line {args.line}: {args.input} has {len(lines)} line(s)")
    return lines[args.line - 1]


def _heads(value: str, h: int) -> list[int]:
    if value == "all":
        return list(range(h))
    try:
        head = int(value)
    except ValueError:
        raise UserError(f"--head must be a number from 1 to {h} or 'all', got {value!r}") \
            from None
    if not 1 <= head <= h:
        raise UserError(f"--head {head} does not exist: the model has h={h} heads (1 … {h})")
    return [head - 1]


def run(args: argparse.Namespace) -> int:
    if args.output is None and not args.json:
        raise UserError("nothing to write: give -o FILE.png, --json, or both")
    if args.output is not None and not args.output.lower().endswith(".png"):
        raise UserError(f"-o {args.output}: the image is written as PNG, name it *.png")
    source = _source(args)
    from aiayn.cli.translate import load_translator
    from aiayn.viz.plot import draw_heatmaps, draw_lines

    translator = load_translator(args, "attention")
    config = translator.config
    N, h = config.model.N, config.model.h
    layer = N if args.layer is None else args.layer
    if not 1 <= layer <= N:
        raise UserError(f"--layer {layer} does not exist: the model has N={N} layers (1 … {N})")
    heads = _heads(args.head, h)
    # the text the model was trained on (e.g. lowercased and Moses-tokenized), as translate reads
    source = translator.preprocess([source], warn=translator.warn)[0]
    target = None if args.target is None else \
        translator.preprocess([args.target], "tgt", warn=translator.warn)[0]
    maps = translator.attention(source, target, beam_size=args.beam, alpha=args.alpha,
                                preprocessed=True)
    if args.output is not None:
        draw = draw_lines if args.style == "lines" else draw_heatmaps
        draw(maps, args.kind, layer - 1, heads, args.output)
        print(f"aiayn attention: wrote {args.output} ({args.kind}, layer {layer}, "
              f"target: {maps.target_text!r})", file=sys.stderr)
    if args.json:
        data = {"source": source, **maps.to_json(kinds=(args.kind,))}
        sys.stdout.write(json.dumps(data, ensure_ascii=False) + "\n")
    return 0
