"""The one place where a device name becomes a ``torch.device`` (training, decoding, CLI)."""

from __future__ import annotations

import torch

from aiayn.errors import UserError


def choose_device(name: str | torch.device | None = None, local_rank: int = 0) -> torch.device:
    """``name`` checked against this machine; None: ``cuda`` when a GPU is present, else ``cpu``.

    Under torchrun a bare ``cuda`` means this process's GPU, ``cuda:LOCAL_RANK``.

    Raises:
        UserError: an unknown device name, or a CUDA device this machine does not have.
    """
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"--device {name!r}: not a device name (use cpu, cuda or cuda:N)") \
            from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: no CUDA GPU is available on this machine "
                            "(use --device cpu)")
        index = local_rank if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                            f"GPU(s), numbered from 0")
        device = torch.device("cuda", index)
    elif device.type != "cpu":
        raise UserError(f"--device {name}: only cpu and cuda devices are supported")
    return device
