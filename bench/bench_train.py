"""Training-step throughput (target tokens per second) and model FLOP utilization, aiayn against
``torch.nn.Transformer``, in one run.

    AIAYN_DATA_DIR=../shared/data python bench/bench_train.py [--presets multi30k base] [--json]

For each preset, on the same Multi30k en-de batches (shared BPE 8000, length-sorted batches of
``--max-tokens`` tokens a side, shuffled as training shuffles them), each contender runs the
same ``--steps`` batches ``--warmup`` times untimed (the first pass builds each shape's oneDNN
kernels, as a run's first epoch does, so that no contender inherits another's), then once timed:

- ``aiayn``: :meth:`aiayn.training.update.Learner.update` on the stream's batches (collate, forward,
  label-smoothed loss, backward, gradient norm, Adam, the learning-rate schedule), fp32, bf16
  autocast, bf16 with ``train.bf16_weights`` (a bf16 compute copy of the weights, float32
  masters in Adam), and that with ``model.output_vocab = "target"`` as well (the output layer
  over the tokens of the training targets only);
- ``torch.nn.Transformer`` (post-norm, tied embeddings, sinusoids, the same sizes) trained the
  way its documentation suggests: ``F.cross_entropy(..., label_smoothing=0.1,
  ignore_index=pad)`` over every position, Adam, fp32 and bf16 autocast;
- the same peer with aiayn's loss (``label_smoothed_loss`` on the non-pad positions only), to
  show how much of the ratio is the loss and the output layer.

Model FLOPs count the matrix products the model needs per sentence pair (projections and
feed-forward layers on real tokens, attention scores and sums over real lengths, the output
layer on real target tokens, over the tokens it scores), times 3 for forward and backward
(Kaplan et al. 2020). FLOP
utilization (MFU) divides the model FLOPs per second by the rate of a bf16 2048x2048x2048
matrix product measured in the same run, on the same threads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from aiayn.config import load_config
from aiayn.data.batching import collate, encode_corpus
from aiayn.data.corpus import load_dataset
from aiayn.data.vocab import BOS_ID, PAD_ID, Vocabulary
from aiayn.training.loop import Trainer
from aiayn.training.run import prepare_training_process
from aiayn.training.loss import label_smoothed_loss


class TorchTransformer(nn.Module):
    """The peer: ``torch.nn.Transformer`` (post-norm) with tied embeddings and sinusoids."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.core = nn.Transformer(cfg.d_model, cfg.h, cfg.N, cfg.N, cfg.d_ff, cfg.P_drop,
                                   batch_first=True)
        pe = torch.zeros(cfg.max_len, cfg.d_model)
        pos = torch.arange(cfg.max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, cfg.d_model, 2) * (-math.log(10000.0) / cfg.d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.scale = cfg.d_model**0.5

    def forward(self, src, tgt_in):
        s = self.embed(src) * self.scale + self.pe[: src.shape[1]]
        t = self.embed(tgt_in) * self.scale + self.pe[: tgt_in.shape[1]]
        causal = self.core.generate_square_subsequent_mask(tgt_in.shape[1], dtype=s.dtype)
        pad = src == PAD_ID
        out = self.core(s, t, tgt_mask=causal, src_key_padding_mask=pad,
                        memory_key_padding_mask=pad, tgt_is_causal=True)
        return F.linear(out, self.embed.weight)


def pair_flops(m, src_len: int, tgt_len: int, out_vocab: int | None = None) -> float:
    """Training FLOPs (3 x forward) of one sentence pair of ``src_len`` and ``tgt_len`` tokens
    under ModelConfig ``m``: 2 FLOPs per multiply-add of every matrix product; the output
    layer scores ``out_vocab`` tokens (default: the whole target vocabulary)."""
    qk, v = m.h * m.d_k, m.h * m.d_v
    proj = m.d_model * (2 * qk + v) + v * m.d_model  # W^Q, W^K, W^V, W^O per token
    ffn = 2 * m.d_model * m.d_ff
    enc = m.N * src_len * (proj + ffn + src_len * (qk + v))
    dec_self = tgt_len * (proj + tgt_len * (qk + v))
    dec_cross = (tgt_len * (m.d_model * qk + v * m.d_model)  # W^Q, W^O on the target
                 + src_len * (m.d_model * (qk + v))  # W^K, W^V on the source
                 + tgt_len * src_len * (qk + v))
    dec = m.N * (dec_self + dec_cross + tgt_len * ffn)
    out = tgt_len * m.d_model * (out_vocab or m.target_vocab_size)
    return 3 * 2 * (enc + dec + out)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # CUDA runs asynchronously: wait for the queued kernels
        torch.cuda.synchronize(device)


def matmul_rate(size: int = 2048, reps: int = 6, device: torch.device | None = None,
                dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a ``size``^3 matrix product in ``dtype`` on ``device`` (this machine's
    current threads on a CPU)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        size, reps = 8192, 20
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    for _ in range(2):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return reps * 2 * size**3 / (time.perf_counter() - t0)


def time_aiayn(config, vocab, enc, steps: int, passes: int,
               device: torch.device = torch.device("cpu")) -> tuple[float, list[list[int]]]:
    """Target tokens/s of the Trainer's own step over the first ``steps`` batches of its first
    epoch, timed after ``passes`` untimed passes over the same batches; also those batches."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        prepare_training_process(device)  # as a training process does (aiayn train)
        trainer = Trainer(config, tmp, vocab, enc, device=device, progress=False)
        used = trainer.stream.batches_of_epoch(0)[:steps]
        for _ in range(passes):
            for _ in range(steps):
                trainer.learner.update(trainer.next_batches())
            trainer.state.batch_in_epoch = 0  # the same batches again
        _sync(device)
        tokens, t0 = 0.0, time.perf_counter()
        for _ in range(steps):
            tokens += trainer.learner.update(trainer.next_batches())["tokens"]
        _sync(device)
        return tokens / (time.perf_counter() - t0), used


def time_peer(cfg, enc, order: list[list[int]], bf16: bool, ours_loss: bool,
              passes: int, device: torch.device = torch.device("cpu")) -> float:
    """Target tokens/s of ``torch.nn.Transformer`` on the batches ``order``, timed after
    ``passes`` untimed passes over them."""
    torch.manual_seed(0)
    model = TorchTransformer(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    model.train()
    tokens, start = 0, None
    for i, idx in enumerate(order * (passes + 1)):
        if i == passes * len(order):
            _sync(device)
            tokens, start = 0, time.perf_counter()
        b = collate(enc, idx, start_id=BOS_ID).to(device)  # torch.nn.Transformer starts at BOS
        ac = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 \
            else contextlib.nullcontext()
        with ac:
            logits = model(b.src, b.tgt_in)
        if ours_loss:
            keep = b.tgt_out != PAD_ID
            loss, _, n = label_smoothed_loss(logits[keep], b.tgt_out[keep], 0.1, PAD_ID)
            loss = loss / n
        else:
            loss = F.cross_entropy(logits.float().flatten(0, 1), b.tgt_out.flatten(),
                                   ignore_index=PAD_ID, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        tokens += b.tgt_tokens
    _sync(device)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["multi30k", "base"],
                   help="presets to measure (default: multi30k base)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="tokens per batch on each side (the multi30k preset's 2048)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed passes over the timed batches first: the first pass builds "
                        "each shape's oneDNN kernels, as a run's first epoch does")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default=None,
                   help="cpu or cuda (default: cpu); on CUDA the peak is an 8192^3 bf16 product")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    from aiayn.devices import choose_device

    device = choose_device(args.device or "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_dataset("multi30k", "train", "en", "de")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 8000)
    enc = encode_corpus(vocab, corpus, 128)
    src_len, tgt_len = enc.src_lengths(), enc.tgt_lengths()
    say = (lambda *a, **k: None) if args.json else print
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    # bf16 only where the hardware has it: emulated bf16 (AVX2-only CPUs) runs 5-45x slower than
    # fp32, and its figures would say nothing about aiayn
    native_bf16 = device.type == "cuda" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    peak_fp32 = matmul_rate(device=device, dtype=torch.float32)
    say(f"fp32 matmul: {peak_fp32 / 1e9:.0f} GFLOP/s on {where}")
    peak = matmul_rate(device=device) if native_bf16 else peak_fp32
    if native_bf16:
        say(f"bf16 matmul: {peak / 1e9:.0f} GFLOP/s on {where}")
    else:
        say(f"no native bf16 here ({torch.backends.cpu.get_cpu_capability()}): fp32 rows only")
    rows = []
    for preset in args.presets:
        base = [f"model.vocab_size={len(vocab)}", f"data.max_tokens={args.max_tokens}",
                "train.eval_bleu_sentences=0", "train.time_budget_s=0",
                "train.checkpoint_every_s=0"]
        row: dict = {"preset": preset}
        order: list[list[int]] = []
        ours = (("aiayn_fp32", ["train.precision=fp32"]),
                ("aiayn_bf16", ["train.precision=bf16"]),
                ("aiayn_bf16_weights", ["train.precision=bf16-weights"]),
                ("aiayn_target_vocab", ["train.precision=bf16-weights",
                                        "model.output_vocab=target"]))
        peers = (("torch_fp32", False, False), ("torch_bf16", True, False),
                 ("torch_bf16_aiayn_loss", True, True))
        if not native_bf16:
            ours, peers = ours[:1], peers[:1]
        for name, extra in ours:
            config = load_config(preset, base + extra)
            row[name], order = time_aiayn(config, vocab, enc, args.steps, args.warmup, device)
        cfg = load_config(preset, base).model
        for name, bf16, ours_loss in peers:
            row[name] = time_peer(cfg, enc, order, bf16, ours_loss, args.warmup, device)
        tokens = sum(int(tgt_len[i]) for idx in order for i in idx)
        flops = sum(pair_flops(cfg, int(src_len[i]), int(tgt_len[i]))
                    for idx in order for i in idx)
        flops_per_token = flops / tokens
        kept = len(enc.target_token_ids())
        target_flops_per_token = sum(pair_flops(cfg, int(src_len[i]), int(tgt_len[i]), kept)
                                     for idx in order for i in idx) / tokens
        row.update({
            "ratio_fp32": row["aiayn_fp32"] / row["torch_fp32"],
            "model_gflop_per_token": flops_per_token / 1e9,
            "mfu_fp32": row["aiayn_fp32"] * flops_per_token / peak_fp32})
        if native_bf16:
            _bf16_figures(row, flops_per_token, target_flops_per_token, kept, peak)
        rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        r = rows[-1]
        say(f"{preset}: target tok/s (model {r['model_gflop_per_token'] * 1e3:.1f} MFLOP/token)")
        say(f"  aiayn fp32 {r['aiayn_fp32']:7.0f}   torch.nn.Transformer fp32 "
            f"{r['torch_fp32']:7.0f}   ratio {r['ratio_fp32']:.2f}x   MFU {r['mfu_fp32']:.1%} "
            "of the fp32 product")
        if native_bf16:
            _say_bf16(say, r)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
                          "native_bf16": native_bf16,
                          "matmul_fp32_gflop_s": round(peak_fp32 / 1e9, 1),
                          "matmul_bf16_gflop_s": round(peak / 1e9, 1) if native_bf16 else None,
                          "rows": rows}))


def _bf16_figures(row: dict, flops_per_token: float, target_flops_per_token: float, kept: int,
                  peak: float) -> None:
    """The bf16 rows' ratios to torch.nn.Transformer bf16 and their MFU of the bf16 peak."""
    best = max(row["aiayn_bf16"], row["aiayn_bf16_weights"])
    row.update({
        "ratio_bf16": row["aiayn_bf16"] / row["torch_bf16"],
        "ratio_bf16_weights": row["aiayn_bf16_weights"] / row["torch_bf16"],
        "mfu_bf16": row["aiayn_bf16"] * flops_per_token / peak,
        "mfu_bf16_weights": row["aiayn_bf16_weights"] * flops_per_token / peak,
        "ratio_target_vocab": row["aiayn_target_vocab"] / row["torch_bf16"],
        "output_vocab_target": kept,
        "model_gflop_per_token_target_vocab": target_flops_per_token / 1e9,
        "mfu_target_vocab": row["aiayn_target_vocab"] * target_flops_per_token / peak,
        "mfu_torch_bf16": row["torch_bf16"] * flops_per_token / peak,
        "mfu_best": best * flops_per_token / peak,
    })


def _say_bf16(say, r: dict) -> None:
    """Print the bf16 rows of one preset."""
    say(f"  aiayn bf16 {r['aiayn_bf16']:7.0f}   torch.nn.Transformer bf16 "
        f"{r['torch_bf16']:7.0f}   ratio {r['ratio_bf16']:.2f}x   MFU {r['mfu_bf16']:.1%} "
        f"(torch.nn.Transformer {r['mfu_torch_bf16']:.1%})")
    say(f"  aiayn bf16 weights {r['aiayn_bf16_weights']:7.0f}   ratio "
        f"{r['ratio_bf16_weights']:.2f}x   MFU {r['mfu_bf16_weights']:.1%}")
    say(f"  aiayn bf16 weights, output_vocab target ({r['output_vocab_target']} tokens, "
        f"{r['model_gflop_per_token_target_vocab'] * 1e3:.1f} MFLOP/token) "
        f"{r['aiayn_target_vocab']:7.0f}   ratio {r['ratio_target_vocab']:.2f}x   "
        f"MFU {r['mfu_target_vocab']:.1%}")
    say(f"  torch.nn.Transformer bf16 with aiayn's loss {r['torch_bf16_aiayn_loss']:7.0f}")


if __name__ == "__main__":
    main()
