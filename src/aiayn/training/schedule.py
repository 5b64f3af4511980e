"""The learning rate of §5.3 (eq. 3)."""

from __future__ import annotations


def learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """lrate = scale · d_model^-0.5 · min(step^-0.5, step · warmup_steps^-1.5).

    Rises linearly for ``warmup_steps`` updates, then falls with the inverse square root of the
    step; the peak, at step = warmup_steps, is scale · d_model^-0.5 · warmup_steps^-0.5.

    Args:
        step: the update about to be taken, counted from 1.

    Raises:
        ValueError: step < 1.
    """
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)
