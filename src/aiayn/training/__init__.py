"""Training: the recipe of §5 (label smoothing, Adam with the warmup schedule, checkpoints)."""
