"""Learning-rate schedule: linear warmup, then cosine / linear decay to ``lr·min_lr_ratio``, or constant."""

from __future__ import annotations

import math

import torch

from kdsweep.config.schema import OptimConfig


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def build(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
