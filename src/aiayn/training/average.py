"""Checkpoint averaging, §6.1: "a single model obtained by averaging the last 5 checkpoints"
(base) or the last 20 (big)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from aiayn.checkpoint import load_checkpoint, read_meta, save_checkpoint
from aiayn.errors import UserError
from aiayn.rundir import CHECKPOINTS, META, WEIGHTS, step_number


def average_checkpoints(paths: list[Path], output: str | Path) -> Path:
    """Write the element-wise mean (accumulated in float64) of the weights in ``paths``.

    The config and vocabulary come from the newest checkpoint; all must share them.

    ``output`` must be a new path or an earlier average (a checkpoint whose ``meta.json`` has
    ``averaged_from``): nothing else is ever replaced.

    Raises:
        UserError: no paths, an ``output`` that exists and is not an earlier average (or is
            named like a step checkpoint), an unreadable checkpoint, checkpoints whose tensors
            differ in names or shapes, or whose vocabularies differ.
    """
    if not paths:
        raise UserError("no checkpoints to average")
    check_average_output(output)
    fingerprints = {Path(p): read_meta(p).get("vocab_fingerprint") for p in paths}
    if len({f for f in fingerprints.values() if f is not None}) > 1:
        listing = ", ".join(f"{p} ({f[:12] if f else 'none recorded'})"
                            for p, f in fingerprints.items())
        raise UserError(f"the checkpoints were trained with different vocabularies: {listing}; "
                        "average checkpoints of one run only")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        file = Path(path) / WEIGHTS
        try:
            weights = load_file(str(file))
        except Exception as err:  # safetensors' own error type: truncated or corrupt file
            raise UserError(f"{file}: not a readable safetensors file ({err})") from None
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


def check_average_output(output: str | Path) -> None:
    """Refuse an output path that averaging would destroy: anything that exists and is not an
    earlier average, and any ``step-N`` name inside a run's ``checkpoints/`` folder.

    Raises:
        UserError: naming ``output`` and what is there.
    """
    output = Path(output)
    if output.parent.name == CHECKPOINTS and step_number(output) is not None:
        raise UserError(f"-o {output}: names a step checkpoint of a run; write the average "
                        "elsewhere (default: RUN_DIR/averaged)")
    if not output.exists() and not output.is_symlink():
        return
    what = "a file" if not output.is_dir() else "a folder that is not an earlier average"
    if output.is_dir() and (output / META).is_file():
        try:
            if "averaged_from" in read_meta(output):
                return
        except UserError:
            pass
    raise UserError(f"-o {output}: already exists and is {what}; aiayn average replaces only "
                    "its own earlier output. Choose a new path")
