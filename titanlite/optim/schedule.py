"""The learning-rate schedule: warmup, stable, decay (linear, sqrt or cosine) to a floor."""

from __future__ import annotations

import math

import torch

from titanlite.config import JobConfig


def lr_factor(step: int, steps: int, warmup: int, decay_ratio: float | None, decay_type: str, min_factor: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based), warmup-stable-decay.

    Warmup rises linearly to 1 at the last warmup step. The last `decay_ratio * steps` steps (all
    steps after warmup when decay_ratio is None) decay from 1 to `min_factor` along `decay_type`.
    """
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = steps - warmup if decay_ratio is None else round(decay_ratio * steps)
    decay_start = steps - decay_steps
    if step < decay_start or decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    curve = {
        "linear": 1.0 - progress,
        "sqrt": 1.0 - math.sqrt(progress),
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[decay_type]
    return min_factor + (1.0 - min_factor) * curve


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: JobConfig) -> torch.optim.lr_scheduler.LambdaLR:
    s = config.lr_scheduler
    steps = s.total_steps or config.training.steps

    def factor(step: int) -> float:
        return lr_factor(step, steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
