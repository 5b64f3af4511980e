"""``aiayn vocab``: learn one shared source-target subword vocabulary, §5.1."""

from __future__ import annotations

import argparse
import json
import time

from aiayn.errors import UserError
from aiayn.rundir import TOKENIZER

HELP = ("Learn a shared source-target subword vocabulary (BPE as for EN-DE, or word-pieces as "
        f"for EN-FR, §5.1) and save it as DIR/{TOKENIZER}.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", metavar="FILE",
                   help="source text, one sentence per line (plain or .gz); or a TSV file of "
                        "source<TAB>target pairs when --tgt is not given")
    p.add_argument("--tgt", metavar="FILE", help="target text, line-aligned with --src")
    p.add_argument("--dataset", choices=("multi30k", "wmt14-en-de"),
                   help="a named dataset instead of --src/--tgt")
    p.add_argument("--split", default="train", help="split of --dataset")
    p.add_argument("--src-lang", default="en", help="source language of --dataset")
    p.add_argument("--tgt-lang", default="de", help="target language of --dataset")
    p.add_argument("--size", type=int, default=8000,
                   help="vocabulary size in tokens, the 4 special tokens included")
    p.add_argument("--kind", choices=("bpe", "wordpiece"), default="bpe",
                   help="subword model: bpe (§5.1 EN-DE) or wordpiece (§5.1 EN-FR)")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help=f"directory to write {TOKENIZER} into (created if needed)")
    p.add_argument("--keep-empty", action="store_true",
                   help="learn from pairs with an empty side too (by default they are dropped "
                        "and counted)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from aiayn.data.corpus import load_dataset, load_files
    from aiayn.data.vocab import Vocabulary

    if args.dataset and (args.src or args.tgt):
        raise UserError("give either --dataset or --src/--tgt, not both")
    if not args.dataset and not args.src:
        raise UserError("nothing to learn from: give --src FILE --tgt FILE, --src PAIRS.tsv, "
                         "or --dataset multi30k")
    if args.tgt and not args.src:
        raise UserError("--tgt needs --src")
    from aiayn.fileio import check_output_dir

    check_output_dir(args.output, "-o")
    t0 = time.perf_counter()
    if args.dataset:
        corpus = load_dataset(args.dataset, args.split, args.src_lang, args.tgt_lang,
                              drop_empty=not args.keep_empty)
    else:
        corpus = load_files(args.src, args.tgt, drop_empty=not args.keep_empty)
    t_read = time.perf_counter() - t0
    texts = corpus.src + corpus.tgt
    if not any(text.strip() for text in texts):
        source = args.src + (f" and {args.tgt}" if args.tgt else "") if args.src else corpus.name
        raise UserError(f"{source}: no text to learn a vocabulary from ({len(corpus)} pairs, "
                        f"{corpus.dropped_empty} empty ones dropped)")
    t1 = time.perf_counter()
    vocab = Vocabulary.learn(texts, args.size, args.kind)
    t_learn = time.perf_counter() - t1
    path = vocab.save(args.output)
    t2 = time.perf_counter()
    check = vocab.round_trip(texts, examples=3)
    t_check = time.perf_counter() - t2
    result = {
        "path": str(path), "kind": vocab.kind, "size": len(vocab), "requested_size": args.size,
        "corpus": corpus.name, "pairs": len(corpus), "dropped_empty": corpus.dropped_empty,
        "round_trip_exact": check.exact, "round_trip_total": check.total,
        "round_trip_rate": check.rate, "fingerprint": vocab.fingerprint,
        "read_s": round(t_read, 3), "learn_s": round(t_learn, 3),
        "round_trip_s": round(t_check, 3), "total_s": round(time.perf_counter() - t0, 3),
    }
    if args.json:
        result["round_trip_failures"] = check.failures
        print(json.dumps(result, ensure_ascii=False))
        return 0
    print(corpus.describe())
    if len(vocab) != args.size:
        print(f"note: the vocabulary has {len(vocab)} tokens, not --size {args.size} (a small "
              "corpus gives fewer; an alphabet larger than --size gives more); set the model's "
              f"vocab_size to {len(vocab)}")
    print(f"{vocab.kind} vocabulary of {len(vocab)} tokens written to {path} "
          f"(learned in {t_learn:.1f} s; {result['total_s']:.1f} s in all)")
    print(f"round trip: {check.exact} of {check.total} lines decode to the original "
          f"({100 * check.rate:.2f}%)")
    for text, decoded in check.failures:
        print(f"  {text!r}\n  -> {decoded!r}")
    return 0
