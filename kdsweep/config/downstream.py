"""The ``downstream`` section: lm-evaluation-harness tasks scored after training."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


@dataclass(frozen=True, kw_only=True)
class DownstreamConfig:
    """lm-evaluation-harness tasks scored on the trained student at the end of a completed run (``pip install
    'kdsweep[eval]'``): run.json's ``downstream``, and each task's headline metric as ``lm_eval/<task>`` beside the
    held-out CE in ``eval_after`` and ``test_after``, which a sweep may optimise or confirm on
    (``kdsweep.evaluation.downstream``). The merged student is written to be scored, and removed after unless
    ``checkpoint.export_merged``."""

    tasks: tuple[str, ...] = ()
    """lm-eval tasks: the shipped ``kdsweep_next_word``, one in ``include``, or any lm-eval ships (those read their
    datasets through the Hugging Face cache). Empty: none."""
    include: tuple[str, ...] = ()
    """Directories of a user's own lm-eval task YAML files."""
    batch_size: int = 16
    """lm-eval's batch size."""
    limit: int | None = None
    """Score only the first this many items of each task (None: every item): cheaper and noisier, for a search."""

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, f"downstream.batch_size={self.batch_size} must be >= 1")
        _check(self.limit is None or self.limit >= 1,
               f"downstream.limit={self.limit} must be >= 1 (null: every item of each task)")
