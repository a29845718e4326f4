"""The ``rollout`` section: on-policy and sequence-level distillation."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """On-policy and sequence-level distillation (kdsweep.rollout): which steps train on completions generated
    during the run instead of the data's own, as GKD (Agarwal et al., 2024) and TRL's GKDTrainer define them."""

    lmbda: float = 0.0
    """GKD's λ: the fraction of optimizer steps (drawn by seed, the same on every rank) whose prompts the student
    completes; the loss is taken on the generated tokens only, and only its KD term (the student's own samples are
    no gold labels). Set from the top-level knob ``lmbda``. 0 = the data only."""
    seq_kd: bool = False
    """Sequence-level KD: on the other steps the teacher completes the prompts, and its completions are trained on
    as labels (cross-entropy and KD, as ``kd_ratio`` mixes them)."""
    max_new_tokens: int = 32
    """Tokens generated per prompt at most (generation stops at EOS); prompt + completion fit in data.seq_len."""
    temperature: float = 1.0
    """Sampling temperature of the generation (> 0; 1 samples the model's own distribution)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability; 1 = all."""
    seed: int = 0
    """Seed of which steps generate and of every draw (each prompt's own stream: the same on any number of ranks)."""

    @property
    def active(self) -> bool:
        return self.lmbda > 0 or self.seq_kd

    def __post_init__(self) -> None:
        _check(0.0 <= self.lmbda <= 1.0, f"rollout.lmbda={self.lmbda} is outside [0, 1]; pass lmbda=<value in [0, 1]> "
               "(0 = the data only, 1 = every step on the student's own completions)")
        _check(self.max_new_tokens > 0, f"rollout.max_new_tokens={self.max_new_tokens} must be > 0; pass "
               "rollout.max_new_tokens=32 (or another positive count)")
        _check(self.temperature > 0,
               f"rollout.temperature={self.temperature} must be > 0; pass rollout.temperature=1.0")
        _check(0.0 < self.top_p <= 1.0, f"rollout.top_p={self.top_p} must be in (0, 1]; pass rollout.top_p=1.0")
