"""``aiayn params``: parameter count of a preset or config file (Table 3's last column)."""

from __future__ import annotations

import argparse
import json

HELP = "Print the parameter count of a model preset (compare with Table 3)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="base",
                   help="preset name (base, big, table3-A1 … table3-E, multi30k, tiny) "
                        "or a .toml/.json config file")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="shared vocabulary size in tokens (default: the preset's)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field, e.g. model.N=4 (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from aiayn.config import load_config
    from aiayn.model import Transformer, count_parameters

    overrides = list(args.set)
    if args.vocab_size is not None:
        overrides.append(f"model.vocab_size={args.vocab_size}")
    cfg = load_config(args.preset, overrides)
    import torch

    with torch.device("meta"):  # count without allocating (big is ~0.9 GB in fp32)
        model = Transformer(cfg.model)
    n = count_parameters(model)
    m = cfg.model
    if args.json:
        print(json.dumps({
            "preset": cfg.name, "vocab_size": m.vocab_size, "parameters": n,
            "N": m.N, "d_model": m.d_model, "d_ff": m.d_ff, "h": m.h, "d_k": m.d_k, "d_v": m.d_v,
        }))
    else:
        print(f"{cfg.name}: {n:,} parameters ({n / 1e6:.1f}M) with a vocabulary of "
              f"{m.vocab_size:,} (N={m.N}, d_model={m.d_model}, d_ff={m.d_ff}, h={m.h}, "
              f"d_k={m.d_k}, d_v={m.d_v})")
    return 0
