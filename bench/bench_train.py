"""Training-step throughput (target tokens per second), ours against ``torch.nn.Transformer``.

Both models get the same sizes, the same Multi30k batches (sorted by length, as training uses
them), the same label-smoothed loss and Adam; each is timed in fp32 and under bf16 autocast,
in one run, so the ratio compares like with like on this machine.

    AIAYN_DATA_DIR=../shared/data python bench/bench_train.py --presets multi30k base --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.config import load_config
from aiayn.data.batching import collate, encode_corpus, make_batches
from aiayn.data.corpus import load_dataset
from aiayn.data.vocab import PAD_ID, Vocabulary
from aiayn.model import Transformer
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


def time_steps(model, batches, bf16: bool, math_attention: bool, warmup: int) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    model.train()
    tokens, start = 0, None
    for i, b in enumerate(batches):
        if i == warmup:
            tokens, start = 0, time.perf_counter()
        ac = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
        with kernel:
            keep = b.tgt_out != PAD_ID
            with ac:
                if isinstance(model, Transformer):  # ours projects the non-pad positions only
                    logits = model(b.src, b.tgt_in, output_mask=keep)
                else:
                    logits = model(b.src, b.tgt_in)[keep]
            loss, _, n = label_smoothed_loss(logits, b.tgt_out[keep], 0.1, PAD_ID)
            opt.zero_grad(set_to_none=True)
            (loss / n).backward()
        opt.step()
        tokens += b.tgt_tokens
    return tokens / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["multi30k", "base"])
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch, each side")
    p.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_dataset("multi30k", "train", "en", "de")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 8000)
    enc = encode_corpus(vocab, corpus, 128)
    order = make_batches(enc.src_lengths(), enc.tgt_lengths(), args.max_tokens, seed=1)
    batches = [collate(enc, idx) for idx in order[: args.steps + args.warmup]]
    rows = []
    for preset in args.presets:
        cfg = load_config(preset, [f"model.vocab_size={len(vocab)}"]).model
        for bf16 in (False, True):
            torch.manual_seed(0)
            ours = time_steps(Transformer(cfg), batches, bf16, True, args.warmup)
            torch.manual_seed(0)
            peer = time_steps(TorchTransformer(cfg), batches, bf16, False, args.warmup)
            rows.append({"preset": preset, "dtype": "bf16" if bf16 else "fp32",
                         "aiayn_tok_s": round(ours), "torch_nn_transformer_tok_s": round(peer),
                         "ratio": round(ours / peer, 2)})
            if not args.json:
                r = rows[-1]
                print(f"{preset:10s} {r['dtype']}: aiayn {r['aiayn_tok_s']:6d} tgt tok/s   "
                      f"torch.nn.Transformer {r['torch_nn_transformer_tok_s']:6d}   "
                      f"ratio {r['ratio']:.2f}x", flush=True)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
                          "rows": rows}))


if __name__ == "__main__":
    main()
