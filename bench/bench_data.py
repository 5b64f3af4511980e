"""Time the data pipeline on Multi30k train: vocabulary learning, encoding, batching, collation.

Run:  AIAYN_DATA_DIR=../shared/data python bench/bench_data.py [--kind bpe] [--size 10000] [--json]

Figures are wall-clock seconds and sentences per second (a pair is two sentences for learning
and encoding, one for batching and collation); each stage is timed ``--repeat`` times and the
fastest run is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def best_of(repeat: int, fn):
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t)
    return best, result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="multi30k")
    p.add_argument("--split", default="train")
    p.add_argument("--src-lang", default="en")
    p.add_argument("--tgt-lang", default="de")
    p.add_argument("--kind", choices=("bpe", "wordpiece"), default="bpe")
    p.add_argument("--size", type=int, default=10000, help="vocabulary size in tokens")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch, each side")
    p.add_argument("--max-len", type=int, default=128, help="longest pair kept, in tokens")
    p.add_argument("--repeat", type=int, default=3, help="runs per stage; the fastest is kept")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()

    from aiayn.data.batching import collate, encode_corpus, make_batches
    from aiayn.data.corpus import load_dataset
    from aiayn.data.vocab import Vocabulary

    t_read, corpus = best_of(1, lambda: load_dataset(args.dataset, args.split, args.src_lang,
                                                      args.tgt_lang))
    n = len(corpus)
    texts = corpus.src + corpus.tgt
    t_learn, vocab = best_of(args.repeat, lambda: Vocabulary.learn(texts, args.size, args.kind))
    t_encode, enc = best_of(args.repeat, lambda: encode_corpus(vocab, corpus, args.max_len))
    src, tgt = enc.src_lengths(), enc.tgt_lengths()
    t_batch, batches = best_of(args.repeat, lambda: make_batches(src, tgt, args.max_tokens,
                                                                 seed=0, epoch=0))
    t_collate, _ = best_of(1, lambda: [collate(enc, b, start_id=1) for b in batches])
    check = vocab.round_trip(texts)
    padded = sum(len(b) * int(tgt[b].max()) for b in batches)

    result = {
        "corpus": corpus.name, "pairs": n, "kind": vocab.kind, "vocab_size": len(vocab),
        "max_tokens": args.max_tokens, "max_len": args.max_len, "filtered": enc.filtered,
        "batches": len(batches), "target_padding_fraction": round(1 - int(tgt.sum()) / padded, 4),
        "round_trip_rate": check.rate,
        "read_s": round(t_read, 3),
        "learn_s": round(t_learn, 3), "learn_sentences_per_s": round(2 * n / t_learn),
        "encode_s": round(t_encode, 3), "encode_sentences_per_s": round(2 * n / t_encode),
        "batch_s": round(t_batch, 4), "batch_pairs_per_s": round(len(enc) / t_batch),
        "collate_s": round(t_collate, 3), "collate_pairs_per_s": round(len(enc) / t_collate),
        "cpus": os.cpu_count(), "python": platform.python_version(),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{corpus.name}: {n} pairs; {vocab.kind} vocabulary of {len(vocab)}; "
          f"{os.cpu_count()} CPUs")
    print(f"  read      {t_read:7.3f} s")
    print(f"  learn     {t_learn:7.3f} s  {2 * n / t_learn:12,.0f} sentences/s")
    print(f"  encode    {t_encode:7.3f} s  {2 * n / t_encode:12,.0f} sentences/s "
          f"({enc.filtered} pairs over {args.max_len} tokens filtered)")
    print(f"  batch     {t_batch:7.3f} s  {len(enc) / t_batch:12,.0f} pairs/s "
          f"({len(batches)} batches of <= {args.max_tokens} tokens, "
          f"{100 * result['target_padding_fraction']:.1f}% target padding)")
    print(f"  collate   {t_collate:7.3f} s  {len(enc) / t_collate:12,.0f} pairs/s")
    print(f"  round trip {100 * check.rate:.3f}% of {check.total} sentences")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
