"""Checkpoint averaging, §6.1: "a single model obtained by averaging the last 5 checkpoints"
(base) or the last 20 (big)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from aiayn.checkpoint import load_checkpoint, read_meta, save_checkpoint
from aiayn.errors import UserError


def average_checkpoints(paths: list[Path], output: str | Path) -> Path:
    """Write the element-wise mean (accumulated in float64) of the weights in ``paths``.

    The config and vocabulary come from the newest checkpoint; all must share them.

    Raises:
        UserError: no paths, checkpoints whose tensors differ in names or shapes, or whose
            vocabularies differ.
    """
    if not paths:
        raise UserError("no checkpoints to average")
    fingerprints = {Path(p): read_meta(p).get("vocab_fingerprint") for p in paths}
    if len({f for f in fingerprints.values() if f is not None}) > 1:
        listing = ", ".join(f"{p} ({f[:12] if f else 'none recorded'})"
                            for p, f in fingerprints.items())
        raise UserError(f"the checkpoints were trained with different vocabularies: {listing}; "
                        "average checkpoints of one run only")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        weights = load_file(str(Path(path) / "model.safetensors"))
        if total and set(weights) != set(total):
            raise UserError(f"{path}: its tensors differ from {paths[0]}'s; average checkpoints "
                            "of one run only")
        for name, tensor in weights.items():
            if name in total and total[name].shape != tensor.shape:
                raise UserError(f"{path}: {name} has shape {tuple(tensor.shape)}, not "
                                f"{tuple(total[name].shape)}")
            total[name] = total.get(name, 0) + tensor.double()
    model, config, vocab = load_checkpoint(paths[-1])
    averaged = {name: (t / len(paths)).to(torch.float32) for name, t in total.items()}
    state = model.state_dict()
    for name in state:
        if name in averaged:
            state[name] = averaged[name]
    model.load_state_dict(state, strict=False)
    if config.model.share_embeddings:  # the tied matrix may be stored under either name
        src = averaged.get("src_embed.weight", averaged.get("tgt_embed.weight"))
        model.src_embed.weight.data.copy_(src)
    meta = {"averaged_from": [str(p) for p in paths]}
    return save_checkpoint(output, model, config, vocab, meta)
