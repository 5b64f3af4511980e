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
    p.add_argument("--sample-lines", type=int, default=None, metavar="N",
                   help="learn from at most N sentences: both sides of N/2 pairs drawn with a "
                        "fixed seed, streamed from the files (default: data.vocab_sample_lines, "
                        "2,000,000 as Marian; 0: every sentence)")
    p.add_argument("--check-lines", type=int, default=None, metavar="N",
                   help="check decode(encode(s)) == s on at most N of the sentences learned "
                        "from, spread over them (default 100,000)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from aiayn.config import DataConfig
    from aiayn.data.corpus import load_dataset, load_tsv
    from aiayn.data.vocab import ROUND_TRIP_LINES, SPECIAL_TOKENS, LearningSample, Vocabulary

    if args.dataset and (args.src or args.tgt):
        raise UserError("give either --dataset or --src/--tgt, not both")
    if not args.dataset and not args.src:
        raise UserError("nothing to learn from: give --src FILE --tgt FILE, --src PAIRS.tsv, "
                         "or --dataset multi30k")
    if args.tgt and not args.src:
        raise UserError("--tgt needs --src")
    sample_lines = DataConfig().vocab_sample_lines if args.sample_lines is None \
        else args.sample_lines
    if sample_lines < 0 or sample_lines == 1:
        raise UserError(f"--sample-lines must be 0 (all) or at least 2, got {sample_lines}")
    check_lines = ROUND_TRIP_LINES if args.check_lines is None else args.check_lines
    if check_lines < 0:
        raise UserError(f"--check-lines must be >= 0, got {check_lines}")
    from aiayn.fileio import check_output_dir

    check_output_dir(args.output, "-o")
    t0 = time.perf_counter()
    read_empty = 0  # pairs with an empty side dropped while reading (TSV, datasets)
    if args.src and args.tgt:  # streamed: the corpus is never held in memory
        sample = LearningSample.from_files(args.src, args.tgt, sample_lines,
                                           drop_empty=not args.keep_empty,
                                           check_lines=check_lines)
        name = sample.name
    else:
        if args.dataset:
            corpus = load_dataset(args.dataset, args.split, args.src_lang, args.tgt_lang,
                                  drop_empty=not args.keep_empty)
        else:
            corpus = load_tsv(args.src, drop_empty=not args.keep_empty)
        sample = LearningSample.from_corpus(corpus, sample_lines, check_lines=check_lines)
        sample.drop_empty = not args.keep_empty
        name, read_empty = corpus.name, corpus.dropped_empty
    t_read = time.perf_counter() - t0
    t1 = time.perf_counter()
    vocab = Vocabulary.learn(sample.batches(), args.size, args.kind)
    t_learn = time.perf_counter() - t1
    dropped = read_empty + sample.dropped_empty
    if len(vocab) == len(SPECIAL_TOKENS):  # not one character seen
        source = args.src + (f" and {args.tgt}" if args.tgt else "") if args.src else name
        raise UserError(f"{source}: no text to learn a vocabulary from ({sample.used} pairs, "
                        f"{dropped} empty ones dropped)")
    path = vocab.save(args.output)
    t2 = time.perf_counter()
    check = vocab.round_trip(sample.check, examples=3)
    t_check = time.perf_counter() - t2
    # pairs: the corpus's, less those found with an empty side (only the sample's are looked
    # at); pairs_used: those learned from
    result = {
        "path": str(path), "kind": vocab.kind, "size": len(vocab), "requested_size": args.size,
        "corpus": name, "pairs": sample.total - sample.dropped_empty, "pairs_used": sample.used,
        "sample_lines": sample_lines, "dropped_empty": dropped,
        "round_trip_exact": check.exact, "round_trip_total": check.total,
        "round_trip_rate": check.rate, "fingerprint": vocab.fingerprint,
        "read_s": round(t_read, 3), "learn_s": round(t_learn, 3),
        "round_trip_s": round(t_check, 3), "total_s": round(time.perf_counter() - t0, 3),
    }
    if args.json:
        result["round_trip_failures"] = check.failures
        print(json.dumps(result, ensure_ascii=False))
        return 0
    empty = f", {dropped} pairs with an empty side dropped" if dropped else ""
    print(f"{name}: {result['pairs'] + dropped} pairs{empty}; learned from {sample.used} of them"
          + (f" (a sample: --sample-lines {sample_lines})" if sample.chosen < sample.total
             else ""))
    if len(vocab) != args.size:
        print(f"note: the vocabulary has {len(vocab)} tokens, not --size {args.size} (a small "
              "corpus gives fewer; an alphabet larger than --size gives more); set the model's "
              f"vocab_size to {len(vocab)}")
    print(f"{vocab.kind} vocabulary of {len(vocab)} tokens written to {path} "
          f"(learned in {t_learn:.1f} s; {result['total_s']:.1f} s in all)")
    print(f"round trip: {check.exact} of {check.total} sampled lines decode to the original "
          f"({100 * check.rate:.2f}%)")
    for text, decoded in check.failures:
        print(f"  {text!r}\n  -> {decoded!r}")
    return 0
