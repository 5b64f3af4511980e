"""Decoding throughput of whichever aiayn the running Python imports: for A/B runs between two
checkouts, alternated, so a machine whose speed drifts slows both alike.

Run (each checkout's own environment, in turn, a few rounds):
    AIAYN_DATA_DIR=../shared/data OLD/.venv/bin/python bench/bench_decode_ab.py --dump old.json
    AIAYN_DATA_DIR=../shared/data NEW/.venv/bin/python bench/bench_decode_ab.py --dump new.json
    cmp old.json new.json   # the same tokens: a lever that keeps the outputs

A random-weight model of ``--preset`` decodes, in int8 (decoding's default path on the CPU,
:func:`aiayn.model.quantize.quantize_int8`), the first ``--sentences`` lines of Multi30k
test_2016_flickr.en, every output forced to ``--length`` tokens plus EOS, on one thread, in
batches of ``--batch-size`` sorted by length (as ``bench/bench_decode_levers.py``'s ``all``).
It prints sentences per CPU second, the fastest of ``--repeat`` rounds after a warm-up round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="multi30k")
    p.add_argument("--sentences", type=int, default=512)
    p.add_argument("--length", type=int, default=24, help="output tokens before EOS")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--beam", type=int, default=1, help="1: greedy search")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dump", metavar="JSON", help="write the output tokens here")
    p.add_argument("--without", nargs="*", default=[], metavar="LEVER",
                   help="levers to switch off, to measure one alone: a kernel family of "
                        "aiayn.model.kernels.KINDS (e.g. softmax), 'packed' (no map runs "
                        "over a weight packed for FBGEMM or oneDNN), or 'kv-bf16' (a float32 "
                        "self-attention cache)")
    args = p.parse_args()
    data = os.environ.get("AIAYN_DATA_DIR")
    if not data:
        p.error("set AIAYN_DATA_DIR (the shared data folder holding multi30k/)")

    import torch

    torch.set_num_threads(1)
    from aiayn.devices import keep_freed_memory

    keep_freed_memory()  # as `aiayn translate` does (aiayn.cli.DECODING_COMMANDS)
    from aiayn.config import load_config
    from aiayn.data.batching import pad_sources
    from aiayn.data.vocab import Vocabulary
    from aiayn.decoding import CachedStep, beam_search, greedy_search
    from aiayn.decoding.translate import encode_sources
    from aiayn.evaluation.bleu import read_lines
    from aiayn.model import Transformer, kernels
    from aiayn.model.quantize import quantize_int8

    m30k = os.path.join(data, "multi30k")
    lines = read_lines(os.path.join(m30k, "test_2016_flickr.en.gz"))[: args.sentences]
    train = (read_lines(os.path.join(m30k, "train.en.gz"))
             + read_lines(os.path.join(m30k, "train.de.gz")))
    vocab = Vocabulary.learn(train, 8000)
    cfg = dataclasses.replace(load_config(args.preset).model, vocab_size=len(vocab))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained model has
        model.tgt_embed.weight.mul_(4.0)
    from aiayn.model import quantize

    kv_bf16 = True
    for lever in args.without:
        if lever == "packed":
            quantize.weight_packing = lambda *shape: None
        elif lever == "kv-bf16":
            kv_bf16 = False
        elif lever in kernels.KINDS:
            kernels.ENABLED.discard(lever)
        else:
            p.error(f"--without: unknown lever {lever!r} (packed, kv-bf16, or one of "
                    f"{sorted(kernels.KINDS)})")
    q = quantize_int8(model, kv_bf16=kv_bf16)
    packed = sum(m.packed for m in q.modules() if isinstance(m, quantize.Int8Linear))
    sources = encode_sources(vocab, lines, cfg.max_len)
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    batches = [pad_sources([sources[i] for i in order[s : s + args.batch_size]])
               for s in range(0, len(order), args.batch_size)]
    kernels.warm_up()

    def decode() -> list[list[int]]:
        out = []
        with torch.inference_mode():
            for src in batches:
                memory, mask = q.encode(src)
                lens = torch.full((src.shape[0],), args.length)
                step = CachedStep.start(q, memory, mask, args.length + 1)
                if args.beam == 1:
                    hyps = greedy_search(step, lens, min_len=args.length)
                else:
                    hyps = [h[0] for h in beam_search(step, lens, beam_size=args.beam,
                                                      alpha=0.0, min_len=args.length,
                                                      rules="hf")]
                out.extend(h.tokens for h in hyps)
        return out

    ref = decode()  # warm-up
    best = float("inf")
    for _ in range(args.repeat):
        t = time.process_time()
        if decode() != ref:
            raise SystemExit("the outputs changed between rounds")
        best = min(best, time.process_time() - t)
    print(f"preset={args.preset} beam={args.beam} sentences={len(lines)} "
          f"batch={args.batch_size} packed maps={packed}"
          + (f" without {' '.join(args.without)}" if args.without else "")
          + f": {len(lines) / best:.1f} sentences/CPU-s")
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(ref, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
