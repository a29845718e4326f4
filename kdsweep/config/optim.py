"""The ``optim`` section: AdamW and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup and a decaying schedule."""

    lr: float = 3e-4
    """Peak learning rate; set from the top-level knob ``lr``."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    schedule: str = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    min_lr_ratio: float = 0.0
    """The decay ends at ``lr * min_lr_ratio``."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr={self.lr} must be > 0; pass lr=<positive value> such as lr=3e-4")
        _check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} must be two values in [0, 1)",
        )
        _check(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _check(self.max_grad_norm >= 0, f"optim.max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables)")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _check(
            self.schedule in SCHEDULES,
            f"optim.schedule={self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}",
        )
        _check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
