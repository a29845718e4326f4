"""The ``trial`` section: what the sweep controller sets on the jobs it starts."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """Set by the sweep controller on the jobs it starts; empty for a plain run."""

    sweep_dir: str = ""
    """The sweep this job is a trial of (its sweep.json names the study and the pruner)."""
    number: int = -1
    """The Optuna trial number."""
    study: str = ""
    """The Optuna study's name (W&B groups the trials of a study)."""

    def __post_init__(self) -> None:
        _check(not self.sweep_dir or self.number >= 0,
               f"trial.number={self.number} must be >= 0 when trial.sweep_dir is set")
