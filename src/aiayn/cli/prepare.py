"""``aiayn prepare``: binarize a training corpus once (token ids in memory-mappable arrays),
for ``aiayn train --set data.prepared=DIR`` (aiayn.data.prepared)."""

from __future__ import annotations

import argparse
import json

from aiayn.config import PREPROCESS_MODES, DataConfig

HELP = ("Encode aligned training files with a vocabulary into a prepared folder of "
        "memory-mapped token ids (chunked: memory flat in corpus size); train with "
        "--set data.prepared=DIR. Running it again with unchanged inputs reuses the folder; "
        "a prepare that keeps no pair is refused.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", required=True, metavar="FILE",
                   help="source text, one sentence per line (plain or .gz)")
    p.add_argument("--tgt", required=True, metavar="FILE", help="target text, line-aligned")
    p.add_argument("--vocab", required=True, metavar="PATH",
                   help="the vocabulary (tokenizer.json or its folder, from `aiayn vocab`)")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="the prepared folder (written under a temporary name, renamed when "
                        "complete; a prepare of the same folder meanwhile waits, then reuses "
                        "it; an interrupted prepare's leftovers are removed)")
    p.add_argument("--src-lang", default=DataConfig.src_lang,
                   help="source language (data.src_lang)")
    p.add_argument("--tgt-lang", default=DataConfig.tgt_lang,
                   help="target language (data.tgt_lang)")
    p.add_argument("--preprocess", default=DataConfig.preprocess, choices=PREPROCESS_MODES,
                   help="data.preprocess of the runs that will train on it")
    p.add_argument("--max-len", type=int, default=DataConfig.max_len,
                   help="drop pairs whose source or target + EOS exceed this many tokens "
                        "(data.max_len)")
    p.add_argument("--max-ratio", type=float, default=0.0,
                   help="drop pairs whose longer side has more than this times the shorter "
                        "side's tokens (fairseq's WMT14 cleaning: 1.5); 0: keep all")
    p.add_argument("--limit", type=int, default=0,
                   help="only the first N non-empty pairs (data.train_limit); 0: all")
    p.add_argument("--chunk-pairs", type=int, default=50_000,
                   help="pairs encoded at once (memory grows with it)")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")


def run(args: argparse.Namespace) -> int:
    from aiayn.data.prepared import Settings, prepare
    from aiayn.data.vocab import Vocabulary
    from aiayn.errors import UserError
    from aiayn.fileio import check_output_dir

    if args.chunk_pairs < 1:
        raise UserError(f"--chunk-pairs must be positive, got {args.chunk_pairs}")
    try:
        settings = Settings(args.src_lang, args.tgt_lang, args.preprocess, args.max_len,
                            args.max_ratio, args.limit)
    except ValueError as err:
        raise UserError(str(err)) from None
    check_output_dir(args.output, "-o")
    vocab = Vocabulary.load(args.vocab)
    corpus = prepare(args.src, args.tgt, vocab, args.output, settings,
                     chunk_pairs=args.chunk_pairs,
                     log=None if args.json else (lambda msg: print(msg, flush=True)))
    if args.json:
        print(json.dumps(corpus.manifest))
    return 0
