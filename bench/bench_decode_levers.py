"""What each decoding lever of issue 58 gains alone, and all together, in one process.

Run:  AIAYN_DATA_DIR=../shared/data python bench/bench_decode_levers.py [--preset base]
      [--sentences 96] [--length 24] [--batch-size 32] [--beam 4] [--threads 1] [--repeat 3]

A random-weight model of ``--preset`` (weights do not change the work) decodes, in int8
(``aiayn.model.quantize``), the first ``--sentences`` lines of Multi30k test_2016_flickr.en,
every output forced to ``--length`` tokens plus EOS. The configurations run in turn, ``--repeat``
rounds, and each keeps its fastest run, timed in this process's CPU seconds (on a machine
shared with other work, wall time measures the others as much as this; CPU time much less):

- ``none``: round 3's path (SDPA attention, nine passes per int8 map, three maps for Q, K
  and V, the first beam step on K rows per sentence);
- one lever alone: ``attention`` (:func:`aiayn.model.kernels.attend`), ``int8 passes``
  (:func:`~aiayn.model.kernels.quantize_rows`, :func:`~aiayn.model.kernels.rescale`),
  ``fused qkv`` (one int8 map for W^Q, W^K, W^V), ``step 0`` (the first beam step on one row
  per sentence); ``no reorder`` (beams reorder a table of rows, not the cached keys; it needs
  the attention kernel, so it is measured beside it); ``weight layout`` (each int8 weight
  stored as ``aiayn.model.quantize.weight_columns_first`` finds faster here, not always as
  (out, in) rows); ``packed weights`` (each map whose shape
  ``aiayn.model.quantize.weight_packing`` finds faster over a prepacked weight runs in
  FBGEMM's or oneDNN's int8 linear, not ``torch._int_mm``); ``search`` (the searches' argmax
  and top-k over the candidates in :func:`aiayn.model.kernels.row_argmax` and
  :func:`~aiayn.model.kernels.beam_top`, not torch's);
- ``all``: every lever, as decoding runs by default.

It prints sentences per CPU second, the ratio to ``none``, the decoder row-steps and the share of sentences
token-identical to ``all``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time


class _FirstStepOnKRows:
    """A step function that runs its first call on K copies of every row, as beam search did
    before it ran step 0 on one row per sentence (for measuring that lever)."""

    def __init__(self, step, K: int, stats) -> None:
        self.step, self.K, self.start_id, self.stats = step, K, step.start_id, stats

    def __call__(self, tokens):
        import torch

        B = tokens.shape[0]
        self.stats.row_steps += (self.K - 1) * B  # the search booked B rows
        self.step = self.step.select(torch.arange(B).repeat_interleave(self.K))
        return self.step(tokens.repeat_interleave(self.K))[:: self.K]

    def select(self, index):
        return self.step.select(index * self.K)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--sentences", type=int, default=96)
    p.add_argument("--length", type=int, default=24, help="output tokens before EOS")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3, help="rounds; each figure keeps its fastest")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from aiayn.config import load_config
    from aiayn.data.batching import pad_sources
    from aiayn.data.vocab import Vocabulary
    from aiayn.decoding import CachedStep, DecodeStats, beam_search, greedy_search
    from aiayn.decoding.translate import encode_sources
    from aiayn.evaluation.bleu import read_lines
    from aiayn.model import Transformer, kernels
    from aiayn.model.quantize import quantize_int8

    data = os.environ.get("AIAYN_DATA_DIR")
    if not data:
        p.error("set AIAYN_DATA_DIR (the shared data folder holding multi30k/)")
    m30k = os.path.join(data, "multi30k")
    lines = read_lines(os.path.join(m30k, "test_2016_flickr.en.gz"))[: args.sentences]
    train = (read_lines(os.path.join(m30k, "train.en.gz"))
             + read_lines(os.path.join(m30k, "train.de.gz")))
    vocab = Vocabulary.learn(train, args.vocab_size)
    cfg = dataclasses.replace(load_config(args.preset).model, vocab_size=len(vocab))
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # peaked next-token distributions, as a trained model has
        model.tgt_embed.weight.mul_(4.0)
    from aiayn.model import quantize

    probes = quantize.weight_columns_first, quantize.weight_packing
    copies = {}
    for layout in (True, False):
        for packed in (True, False):
            if not layout:  # every weight as round 3 stored it, (out, in) rows
                quantize.weight_columns_first = lambda *shape: False
            if not packed:  # every product in torch._int_mm
                quantize.weight_packing = lambda *shape: None
            for fuse in (True, False):
                copies[fuse, layout, packed] = quantize_int8(model, fuse_qkv=fuse)
            quantize.weight_columns_first, quantize.weight_packing = probes
    packed_maps = sum(m.packed for m in copies[True, True, True].modules()
                      if isinstance(m, quantize.Int8Linear))
    sources = encode_sources(vocab, lines, cfg.max_len)
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    batches = [pad_sources([sources[i] for i in order[s : s + args.batch_size]])
               for s in range(0, len(order), args.batch_size)]
    kernels.warm_up()

    def decode(levers: set[str]):
        kernels.ENABLED.clear()
        kernels.ENABLED.update(kernels.KINDS & levers)
        q = copies["fused qkv" in levers, "weight layout" in levers, "packed weights" in levers]
        stats, out = DecodeStats(), []
        t = time.process_time()
        with torch.inference_mode():
            for src in batches:
                memory, mask = q.encode(src)
                lens = torch.full((src.shape[0],), args.length)
                step = CachedStep.start(q, memory, mask, args.length + 1)
                step.cache.gather &= "no reorder" in levers
                if args.beam == 1:
                    hyps = greedy_search(step, lens, min_len=args.length, stats=stats)
                else:
                    if "step 0" not in levers:
                        step = _FirstStepOnKRows(step, args.beam, stats)
                    hyps = [h[0] for h in beam_search(step, lens, beam_size=args.beam,
                                                      alpha=0.0, min_len=args.length,
                                                      rules="hf", stats=stats)]
                out.extend(h.tokens for h in hyps)
        return time.process_time() - t, stats.row_steps, out

    all_levers = {"attention", "int8", "fused qkv", "step 0", "no reorder", "weight layout",
                  "packed weights", "search"}
    configs = {"none": set(), "attention": {"attention"},
               "attention + no reorder": {"attention", "no reorder"},
               "int8 passes": {"int8"}, "fused qkv": {"fused qkv"},
               "weight layout": {"weight layout"}, "packed weights": {"packed weights"},
               "search": {"search"}, "all but packed weights": all_levers - {"packed weights"},
               "all but search": all_levers - {"search"}, "all": all_levers}
    if args.beam > 1:
        configs["step 0"] = {"step 0"}
    decode(all_levers)  # warm-up
    best: dict[str, tuple] = {}
    for _ in range(args.repeat):
        for name, levers in configs.items():
            seconds, row_steps, out = decode(levers)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, row_steps, out)
    kernels.ENABLED.update(kernels.KINDS if kernels.AVAILABLE else set())
    print(f"preset={args.preset} beam={args.beam} sentences={len(lines)} "
          f"output_tokens={args.length + 1} batch={args.batch_size} threads={args.threads} "
          f"cpu={platform.processor() or platform.machine()} "
          f"capability={torch.backends.cpu.get_cpu_capability()} "
          f"bf16_class={torch.ops.mkldnn._is_mkldnn_bf16_supported()} "
          f"packed_maps={packed_maps}")
    base = best["none"][0]
    ref = best["all"][2]
    for name, (seconds, row_steps, out) in best.items():
        same = sum(a == b for a, b in zip(out, ref)) / len(ref)
        print(f"  {name:<22} {len(lines) / seconds:7.1f} sent/CPU-s  x{base / seconds:4.2f} of none"
              f"  row-steps {row_steps}  identical to all {same:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
