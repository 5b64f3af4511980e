"""Training-step time of this checkout's model against another version of
``model/transformer.py`` (say, before a change), interleaved step by step in one process, so that
a busy machine slows both alike. Both models get the same weights and the same batches.

    git show main:src/aiayn/model/transformer.py > /tmp/transformer_main.py
    AIAYN_DATA_DIR=../shared/data python bench/bench_model_ab.py --baseline /tmp/transformer_main.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.config import load_config
from aiayn.data.batching import collate, encode_corpus, make_batches
from aiayn.data.corpus import load_dataset
from aiayn.data.vocab import PAD_ID, Vocabulary
from aiayn.model import Transformer
from aiayn.training.loss import label_smoothed_loss


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_transformer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Transformer


def step(model, opt, b, bf16: bool) -> float:
    start = time.perf_counter()
    ac = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with sdpa_kernel(SDPBackend.MATH):
        keep = b.tgt_out != PAD_ID
        with ac:
            logits = model(b.src, b.tgt_in, output_mask=keep)
        loss, _, n = label_smoothed_loss(logits, b.tgt_out[keep], 0.1, PAD_ID)
        opt.zero_grad(set_to_none=True)
        (loss / n).backward()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="another model/transformer.py")
    p.add_argument("--preset", default="multi30k")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20, help="timed steps per model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    corpus = load_dataset("multi30k", "train", "en", "de")
    vocab = Vocabulary.learn(corpus.src + corpus.tgt, 8000)
    enc = encode_corpus(vocab, corpus, 128)
    order = make_batches(enc.src_lengths(), enc.tgt_lengths(), args.max_tokens, seed=1)
    cfg = load_config(args.preset, [f"model.vocab_size={len(vocab)}"]).model
    batches = [collate(enc, idx, start_id=cfg.decoder_start_id) for idx in order[: args.steps + 2]]
    torch.manual_seed(0)
    ours = Transformer(cfg).train()
    base = load_baseline(args.baseline)(cfg).train()
    base.load_state_dict(ours.state_dict())
    opts = {m: torch.optim.Adam(m.parameters(), lr=1e-4) for m in (ours, base)}
    times = {"ours": [], "baseline": []}
    for i, b in enumerate(batches):
        pair = [("ours", ours), ("baseline", base)]
        if i % 2:
            pair.reverse()  # alternate who goes first
        for name, model in pair:
            t = step(model, opts[model], b, args.bf16)
            if i >= 2:  # warm-up
                times[name].append(t)
    tokens = sum(b.tgt_tokens for b in batches[2:])
    out = {name: {"median_step_s": round(statistics.median(ts), 4),
                  "tgt_tok_s": round(tokens / sum(ts))} for name, ts in times.items()}
    ratios = sorted(o / b for o, b in zip(times["ours"], times["baseline"]))
    out["ours_over_baseline_step_time_median"] = round(statistics.median(ratios), 4)
    out["steps"] = len(ratios)
    out["bf16"] = args.bf16
    print(json.dumps(out))


if __name__ == "__main__":
    main()
