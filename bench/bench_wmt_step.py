"""One WMT-shaped training step, aiayn against ``torch.nn.Transformer``, in one process.

    python bench/bench_wmt_step.py --device cuda [--tokens 25000 3125] [--json]
    python bench/bench_wmt_step.py --device cpu --quick     # the wiring, on a tiny model

The paper's workload (§5.1-5.2): the ``base`` model, a shared vocabulary of V = 37,000, batches
of about 25,000 target tokens (3,125 is the per-GPU share of the paper's 25k over 8 GPUs), bf16
on CUDA. The batches are random token ids shaped like WMT14's length-sorted batches (sentences
of 20 to 36 tokens, padded to the batch's longest), so no data is needed. Each contender runs
``--warmup`` untimed steps, then ``--steps`` timed ones; the median step counts:

- ``aiayn``: the model's forward to the decoder's last hidden states at non-pad positions, the
  output layer fused with the label-smoothed loss (training's own loss function), backward,
  Adam;
- ``torch``: ``torch.nn.Transformer`` with tied embeddings, full (B, T, V) logits and
  ``F.cross_entropy(label_smoothing=0.1, ignore_index=pad)``, backward, Adam.

For each it also times the output layer and loss alone (forward and backward from the decoder's
hidden states) and reports that share of the step, and the peak memory the step allocated
(CUDA). ``--chunk-elements`` also times aiayn's loss at other chunk sizes (logits made per chunk
of rows: ``elements // V`` rows), to size the chunk for the device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from aiayn.config import load_config  # noqa: E402
from aiayn.data.vocab import BOS_ID, PAD_ID  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.training import loss as loss_module  # noqa: E402
from aiayn.training.loss import projected_label_smoothed_loss  # noqa: E402
from bench_train import TorchTransformer  # noqa: E402

EPSILON_LS = 0.1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wmt_batch(tokens: int, vocab: int, device: torch.device, seed: int = 0,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, tgt_in, tgt_out), each (B, L), of about ``tokens`` real target tokens: sentences
    of 20-36 tokens (a length-sorted WMT batch's spread), padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(20, 37, (1,), generator=g)))
    longest = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), longest + 1), generator=g)
    for i, n in enumerate(lengths):
        ids[i, n + 1:] = PAD_ID
    src = ids[:, 1:].clone()
    tgt_in = ids[:, :-1].clone()
    tgt_in[:, 0] = BOS_ID
    tgt_out = ids[:, 1:].clone()
    return src.to(device), tgt_in.to(device), tgt_out.to(device)


def _median_s(fn, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 \
        else contextlib.nullcontext()


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def time_aiayn(cfg, batch, device, bf16: bool, steps: int, warmup: int,
               chunk_elements: list[int]) -> dict:
    torch.manual_seed(0)
    model = Transformer(cfg).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = batch
    keep = tgt_out != PAD_ID
    gold = tgt_out[keep]
    n = int(keep.sum())

    def loss_of(hidden):
        value, _, _ = projected_label_smoothed_loss(hidden, model.tgt_embed.weight,
                                                    model.final_logits_bias, gold, EPSILON_LS,
                                                    PAD_ID, 1.0 / n)
        return value

    def step():
        opt.zero_grad(set_to_none=True)
        with _autocast(device, bf16):
            hidden = model(src, tgt_in, output_mask=keep, project=False)  # (n, d_model)
            value = loss_of(hidden)
        value.backward()
        opt.step()

    _peak_reset(device)
    step_s = _median_s(step, steps, warmup, device)
    peak = _peak_gib(device)
    with torch.no_grad(), _autocast(device, bf16):
        h0 = model(src, tgt_in, output_mask=keep, project=False).detach()

    def loss_only():
        hidden = h0.clone().requires_grad_(True)
        with _autocast(device, bf16):
            value = loss_of(hidden)
        value.backward()

    loss_s = _median_s(loss_only, steps, warmup, device)
    by_chunk = {}
    knob = "_CHUNK_ELEMENTS_CUDA" if device.type == "cuda" else "_CHUNK_ELEMENTS"
    default = getattr(loss_module, knob)
    try:
        for elements in chunk_elements:
            setattr(loss_module, knob, elements)
            by_chunk[str(elements)] = round(1e3 * _median_s(loss_only, steps, warmup,
                                                            device), 2)
    finally:
        setattr(loss_module, knob, default)
    return {"step_ms": round(1e3 * step_s, 2), "tokens_per_s": round(n / step_s),
            "loss_ms": round(1e3 * loss_s, 2), "loss_share": round(loss_s / step_s, 3),
            "peak_gib": peak, "chunk_rows": loss_module._chunk_rows(cfg.target_vocab_size, device),
            "loss_ms_by_chunk_elements": by_chunk}


def time_torch(cfg, batch, device, bf16: bool, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = TorchTransformer(cfg).to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = batch
    n = int((tgt_out != PAD_ID).sum())
    vocab = cfg.vocab_size

    def loss_of(logits):
        return F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(),
                               ignore_index=PAD_ID, label_smoothing=EPSILON_LS)

    def step():
        opt.zero_grad(set_to_none=True)
        with _autocast(device, bf16):
            logits = model(src, tgt_in)
        loss_of(logits).backward()
        opt.step()

    _peak_reset(device)
    step_s = _median_s(step, steps, warmup, device)
    peak = _peak_gib(device)
    hidden0 = torch.randn(*tgt_out.shape, cfg.d_model, device=device)

    def loss_only():
        hidden = hidden0.clone().requires_grad_(True)
        with _autocast(device, bf16):
            logits = F.linear(hidden, model.embed.weight)  # (B, T, V)
        loss_of(logits).backward()

    loss_s = _median_s(loss_only, steps, warmup, device)
    del vocab
    return {"step_ms": round(1e3 * step_s, 2), "tokens_per_s": round(n / step_s),
            "loss_ms": round(1e3 * loss_s, 2), "loss_share": round(loss_s / step_s, 3),
            "peak_gib": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[25000, 3125],
                   help="target tokens per batch (default: 25000 3125)")
    p.add_argument("--vocab", type=int, default=37000, help="shared vocabulary size V")
    p.add_argument("--preset", default="base")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median counts)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--chunk-elements", type=int, nargs="*", default=[],
                   help="also time aiayn's loss with chunks of this many logits")
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16 autocast")
    p.add_argument("--quick", action="store_true",
                   help="the tiny preset, V = 2000, 600 tokens, 2 steps: the wiring only")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.vocab, args.tokens, args.steps, args.warmup = \
            "tiny", 2000, [600], 2, 1
    device = torch.device(args.device)
    bf16 = not args.fp32
    base = load_config(args.preset)
    cfg = base.model.__class__(**{**base.model.__dict__, "vocab_size": args.vocab,
                                  "max_len": max(base.model.max_len, 64)})
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    rows = []
    for tokens in args.tokens:
        batch = wmt_batch(tokens, args.vocab, device)
        ours = time_aiayn(cfg, batch, device, bf16, args.steps, args.warmup,
                          args.chunk_elements)
        peer = time_torch(cfg, batch, device, bf16, args.steps, args.warmup)
        row = {"tokens": tokens, "sentences": batch[0].shape[0], "aiayn": ours, "torch": peer,
               "speedup": round(peer["step_ms"] / ours["step_ms"], 3)}
        rows.append(row)
        print(f"{args.preset}, V={args.vocab}, {tokens} tokens ({row['sentences']} sentences), "
              f"{'bf16' if bf16 else 'fp32'}, {where}: aiayn {ours['step_ms']} ms "
              f"(loss {100 * ours['loss_share']:.0f}%, peak {ours['peak_gib']} GiB), "
              f"torch.nn.Transformer {peer['step_ms']} ms (loss "
              f"{100 * peer['loss_share']:.0f}%, peak {peer['peak_gib']} GiB): "
              f"{row['speedup']}x", flush=True)
        if ours["loss_ms_by_chunk_elements"]:
            print(f"  aiayn loss ms by chunk elements: {ours['loss_ms_by_chunk_elements']}",
                  flush=True)
    if args.json:
        print(json.dumps({"device": where, "preset": args.preset, "vocab": args.vocab,
                          "precision": "bf16" if bf16 else "fp32", "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
