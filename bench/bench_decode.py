"""Time greedy and beam-4 decoding (§6.1) with and without the incremental key/value cache.

Run:  AIAYN_DATA_DIR=../shared/data python bench/bench_decode.py [--sentences 200] [--length 20]
      [--batch-size 64] [--threads 1] [--no-uncached] [--json]

A random-weight model of the ``multi30k`` preset (weights do not change the work done) decodes
the first ``--sentences`` lines of the Multi30k test source. Every output is forced to exactly
``--length`` tokens plus EOS (EOS banned before, required at that length), so runs compare. For
each search (greedy, beam 4 with alpha 0.6) and precision (fp32, bf16 autocast) it prints
sentences/s and generated tokens/s (tokens of the returned outputs, EOS included; beam search
computes K times as many rows), then the same weights decoded without the cache (every step
reruns the decoder over the whole prefix) and the ratio cached / uncached. Each figure is the
fastest of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="multi30k")
    p.add_argument("--sentences", type=int, default=200, help="test source lines decoded")
    p.add_argument("--length", type=int, default=20, help="output tokens (EOS excluded)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--repeat", type=int, default=2, help="runs per figure; the fastest is kept")
    p.add_argument("--no-uncached", action="store_true", help="skip the uncached baseline")
    p.add_argument("--no-bf16", action="store_true", help="skip bf16 autocast")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default); on a CPU shared with other "
                        "jobs, 1 thread avoids OpenMP threads waiting on each other")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from aiayn.config import DecodeConfig, load_config
    from aiayn.data.vocab import Vocabulary
    from aiayn.decoding import translate_nbest
    from aiayn.evaluation.bleu import read_lines
    from aiayn.model import Transformer

    data = os.environ.get("AIAYN_DATA_DIR")
    if not data:
        p.error("set AIAYN_DATA_DIR (the shared data folder holding multi30k/)")
    m30k = os.path.join(data, "multi30k")
    lines = read_lines(os.path.join(m30k, "test_2016_flickr.en.gz"))[: args.sentences]
    t = time.perf_counter()
    train = (read_lines(os.path.join(m30k, "train.en.gz"))
             + read_lines(os.path.join(m30k, "train.de.gz")))
    vocab = Vocabulary.learn(train, args.vocab_size)
    learn_s = time.perf_counter() - t
    cfg = load_config(args.preset).model
    cfg = dataclasses.replace(cfg, vocab_size=len(vocab))
    torch.manual_seed(0)
    model = Transformer(cfg).to(args.device).eval()

    def run(beam: int, bf16: bool, cached: bool, n_lines: list[str]) -> tuple[float, int]:
        t = time.perf_counter()
        search = DecodeConfig(beam_size=beam, alpha=0.6, max_len_a=0.0, max_len_b=args.length,
                              batch_size=args.batch_size)
        out = translate_nbest(model, vocab, n_lines, search, min_len=args.length, bf16=bf16,
                              use_cache=cached)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        tokens = sum(len(r[0].tokens) for r in out)
        assert all(len(r[0].tokens) == args.length + 1 for r in out), "lengths not fixed"
        return seconds, tokens

    run(args.beam, False, True, lines[:8])  # warm up allocators and kernels
    rows = []
    precisions = [False] if args.no_bf16 else [False, True]
    for beam in (1, args.beam):
        for bf16 in precisions:
            row = {"search": "greedy" if beam == 1 else f"beam-{beam}",
                   "precision": "bf16" if bf16 else "fp32"}
            for cached in ([True] if args.no_uncached else [True, False]):
                best = min((run(beam, bf16, cached, lines) for _ in range(args.repeat)),
                           key=lambda r: r[0])
                key = "cached" if cached else "uncached"
                row[f"{key}_sent_per_s"] = len(lines) / best[0]
                row[f"{key}_tok_per_s"] = best[1] / best[0]
            if not args.no_uncached:
                row["speedup"] = row["cached_sent_per_s"] / row["uncached_sent_per_s"]
            rows.append(row)
            if not args.json:
                _print_row(row)

    info = {"preset": args.preset, "sentences": len(lines), "output_tokens": args.length + 1,
            "batch_size": args.batch_size, "vocab": len(vocab), "device": args.device,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "vocab_learn_s": round(learn_s, 2)}
    if args.json:
        print(json.dumps({**info, "results": rows}))
    else:
        print("; ".join(f"{k}={v}" for k, v in info.items()))
    return 0


def _print_row(row: dict) -> None:
    text = (f"{row['search']:>7} {row['precision']}: cached {row['cached_sent_per_s']:7.1f} "
            f"sent/s {row['cached_tok_per_s']:8.1f} tok/s")
    if "speedup" in row:
        text += (f" | uncached {row['uncached_sent_per_s']:7.1f} sent/s "
                 f"{row['uncached_tok_per_s']:8.1f} tok/s | cache gain x{row['speedup']:.2f}")
    print(text, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
