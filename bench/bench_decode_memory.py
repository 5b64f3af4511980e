"""Decoder memory against output length: the key/value cache grows, nothing else does.

Run:  python bench/bench_decode_memory.py [--lengths 25 50 100 200] [--precision int8]
      [--beam 4] [--batch-size 32] [--json-out FILE]

A random-weight base Transformer (d_model 512, 6+6 layers, vocabulary 8000) decodes 32 random
16-token sources with beam search, every output forced to exactly L tokens (``min_len``), once
per L, each in a fresh child process. For each L it reports the child's peak resident memory
(read after every decoder step) above its resident memory just before decoding (MiB, after
``malloc_trim`` returns what setup freed), the self-attention cache
it ended with (the buffers of ``aiayn.model.cache.DecoderCache``, MiB), and their difference:
what decoding holds besides the cache. A flat difference across L says memory grows only with
the cache (2 x layers x rows x d_model x 4 bytes per position: 12 KiB per row-position here).
"""

from __future__ import annotations

import argparse
import json
import ctypes
import subprocess
import sys
from pathlib import Path


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


class _Watched:
    """A step function passing through to ``inner``, keeping the newest step's cache in
    ``seen`` (the search holds one step at a time)."""

    def __init__(self, inner, seen: list) -> None:
        self.inner, self.seen = inner, seen
        self.start_id = inner.start_id
        seen[:1] = [inner.cache]

    def __call__(self, tokens):
        out = self.inner(tokens)
        self.seen.append(_rss_mib())  # resident memory after each step
        return out

    def select(self, index):
        return _Watched(self.inner.select(index), self.seen)


def child(length: int, precision: str, beam: int, batch_size: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from aiayn.config import ModelConfig
    from aiayn.data.batching import pad_sources
    from aiayn.decoding import CachedStep, beam_search
    from aiayn.model import Transformer
    from aiayn.model.quantize import quantize_int8

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=8000, max_len=1024, P_drop=0.0)).eval()
    if precision == "int8":
        model = quantize_int8(model)
    gen = torch.Generator().manual_seed(1)
    src = pad_sources([torch.randint(4, 8000, (15,), generator=gen).tolist() + [2]
                       for _ in range(batch_size)])
    lens = torch.full((batch_size,), length)
    with torch.inference_mode():  # a short warm-up decode: kernels, allocator pools
        memory, mask = model.encode(src[:2])
        beam_search(CachedStep.start(model, memory, mask, 3), lens[:2].clamp(max=2),
                    beam_size=beam, min_len=2)
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what setup freed goes back to the system
        before = _rss_mib()
        memory, mask = model.encode(src)
        step = _Watched(CachedStep.start(model, memory, mask, length + 1), seen := [None])
        hyps = beam_search(step, lens, beam_size=beam, min_len=length)
    assert all(len(h[0].tokens) == length + 1 for h in hyps)
    cache, peak = seen[0], max(seen[1:])
    cache_mib = sum(b.numel() * b.element_size() for b in (*cache._k, *cache._v)) / 2**20
    grown = peak - before
    return {"length": length, "precision": precision, "rows": batch_size * beam,
            "peak_above_start_mib": round(grown, 1), "cache_mib": round(cache_mib, 1),
            "besides_cache_mib": round(grown - cache_mib, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[25, 50, 100, 200],
                   help="output tokens (EOS not counted)")
    p.add_argument("--precision", choices=("fp32", "int8"), default="int8")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json-out", default=None, help="write the rows here as JSON")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.precision, args.beam, args.batch_size,
                               args.threads)))
        return 0
    rows = []
    print(f"{'length':>6} {'peak above start':>17} {'cache':>8} {'besides the cache':>18}  (MiB)")
    for length in args.lengths:
        out = subprocess.run([sys.executable, __file__, "--child", str(length), "--precision",
                              args.precision, "--beam", str(args.beam), "--batch-size",
                              str(args.batch_size), "--threads", str(args.threads)],
                             check=True, capture_output=True, text=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(f"{length:>6} {row['peak_above_start_mib']:>17.1f} {row['cache_mib']:>8.1f} "
              f"{row['besides_cache_mib']:>18.1f}", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
