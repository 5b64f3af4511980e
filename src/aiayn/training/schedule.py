"""Learning-rate schedules: the paper's (§5.3, eq. 3) for runs bounded by steps, and two that
decay to zero exactly when a run's budget (of steps or of seconds) is spent.

``train.lr_schedule`` names the schedule:

- ``inverse_sqrt`` (default, §5.3): linear warmup, then the inverse square root of the step.
- ``linear``: linear warmup, then ``peak * (1 - progress)``.
- ``cosine``: linear warmup, then ``peak * (1 + cos(pi * progress)) / 2``.

``progress`` is the larger of ``step / max_steps`` and ``elapsed_s / time_budget_s`` (when a
budget is set), so a run stopped by its time budget ends with a learning rate of about zero
instead of being cut off mid-decay (Li et al. 2020, "Budgeted Training").
"""

from __future__ import annotations

import math

from aiayn.config import LR_SCHEDULES


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


def peak_learning_rate(tc, d_model: int) -> float:
    """The highest learning rate of a run: ``train.peak_lr`` when set (> 0), else the peak of
    eq. 3, ``lr_scale · d_model^-0.5 · warmup_steps^-0.5``."""
    if tc.peak_lr > 0:
        return tc.peak_lr
    return tc.lr_scale * d_model**-0.5 * tc.warmup_steps**-0.5


def budget_progress(step: int, elapsed_s: float, max_steps: int, time_budget_s: float) -> float:
    """How much of the run's budget is spent, in [0, 1]: the larger of the step fraction and,
    when ``time_budget_s`` > 0, the fraction of training seconds."""
    progress = step / max_steps
    if time_budget_s > 0:
        progress = max(progress, elapsed_s / time_budget_s)
    return min(max(progress, 0.0), 1.0)


def scheduled_lr(tc, d_model: int, step: int, elapsed_s: float) -> float:
    """The learning rate of update ``step`` (counted from 1) under ``tc.lr_schedule``.

    Args:
        tc: a :class:`aiayn.config.TrainConfig` (``lr_schedule``, ``warmup_steps``,
            ``lr_scale``, ``peak_lr``, ``max_steps``, ``time_budget_s``).
        d_model: the model width (eq. 3 scales by d_model^-0.5).
        step: the update about to be taken, counted from 1.
        elapsed_s: training seconds spent before this update (evaluation excluded).

    Raises:
        ValueError: step < 1, or an unknown schedule name.
    """
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if tc.lr_schedule == "inverse_sqrt" and tc.peak_lr <= 0:
        return learning_rate(step, d_model, tc.warmup_steps, tc.lr_scale)  # eq. 3 itself
    peak = peak_learning_rate(tc, d_model)
    warm = min(1.0, step / tc.warmup_steps)
    if tc.lr_schedule == "inverse_sqrt":
        return peak * min(warm, (tc.warmup_steps / step) ** 0.5)
    p = budget_progress(step - 1, elapsed_s, tc.max_steps, tc.time_budget_s)
    if tc.lr_schedule == "linear":
        return peak * warm * (1.0 - p)
    if tc.lr_schedule == "cosine":
        return peak * warm * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown train.lr_schedule {tc.lr_schedule!r}; known: {LR_SCHEDULES}")
