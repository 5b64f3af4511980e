"""Vocabulary learning at scale: time, peak memory, and what a sample costs in tokens a sentence.

Each ``--sample-lines`` value (0: every sentence) learns a vocabulary in its own process
(so peak RSS is that learning's alone), streamed from the files as ``aiayn vocab`` does, then
counts the subword tokens per sentence on held-out aligned files (newstest2013 for real data).
The last column compares each sample with the first value given (put 0 first: everything).

Run:  python bench/bench_vocab.py --src train.en --tgt train.de --size 37000 \\
          --eval-src newstest2013.en --eval-tgt newstest2013.de --sample-lines 0 2000000 [--json]

Figures are wall-clock seconds measured beside whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time


def learn_one(args: argparse.Namespace, sample_lines: int) -> dict:
    from aiayn.data.corpus import load_parallel
    from aiayn.data.vocab import LearningSample, Vocabulary

    t = time.perf_counter()
    sample = LearningSample.from_files(args.src, args.tgt, sample_lines)
    vocab = Vocabulary.learn(sample.batches(), args.size, args.kind)
    learn_s = time.perf_counter() - t
    held = load_parallel(args.eval_src, args.eval_tgt)
    src = sum(len(ids) for ids in vocab.encode_batch(held.src))
    tgt = sum(len(ids) for ids in vocab.encode_batch(held.tgt))
    return {"sample_lines": sample_lines, "pairs": sample.total, "pairs_used": sample.used,
            "vocab": len(vocab), "learn_s": round(learn_s, 1),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "eval_sentences": 2 * len(held),
            "tokens_per_sentence": round((src + tgt) / (2 * len(held)), 4),
            "src_tokens_per_sentence": round(src / len(held), 4),
            "tgt_tokens_per_sentence": round(tgt / len(held), 4)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    p.add_argument("--eval-src", required=True)
    p.add_argument("--eval-tgt", required=True)
    p.add_argument("--size", type=int, default=37000)
    p.add_argument("--kind", default="bpe", choices=("bpe", "wordpiece"))
    p.add_argument("--sample-lines", type=int, nargs="+", default=[0, 2_000_000])
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.one:
        print(json.dumps(learn_one(args, args.sample_lines[0])))
        return 0
    rows = []
    for n in args.sample_lines:
        cmd = [sys.executable, __file__, "--one", "--src", args.src, "--tgt", args.tgt,
               "--eval-src", args.eval_src, "--eval-tgt", args.eval_tgt, "--size",
               str(args.size), "--kind", args.kind, "--sample-lines", str(n)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                              text=True).stdout))
    ref = rows[0]["tokens_per_sentence"]
    for row in rows:
        row["vs_first_pct"] = round(100 * (row["tokens_per_sentence"] / ref - 1), 3)
    cpu = "bf16 class" if "avx512_bf16" in open("/proc/cpuinfo").read() else "AVX2 class"
    if args.json:
        print(json.dumps({"cpu": cpu, "machine": platform.machine(), "rows": rows}))
        return 0
    print(f"{args.src} | {args.tgt}, {args.kind} {args.size}, held out: {args.eval_src}; {cpu}")
    print(f"{'sample lines':>12} {'pairs used':>10} {'learn s':>8} {'peak RSS GB':>11} "
          f"{'tok/sent':>9} {'vs first':>9}")
    for r in rows:
        print(f"{r['sample_lines'] or 'all':>12} {r['pairs_used']:>10} {r['learn_s']:>8} "
              f"{r['peak_rss_gb']:>11} {r['tokens_per_sentence']:>9} {r['vs_first_pct']:>8}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
