"""``kd_ratio=0``: training steps without the teacher.

The loss is then ``1·CE + 0·KD``: the teacher's targets weigh nothing in it, so a training step neither runs the
teacher nor reads its cache (a CE-only baseline trial costs what a plain fine-tune costs). :class:`TeacherFree`
stands in for the training source and gives :class:`NoTargets`: a KD term of 0 whose gradient is 0, and a logged
KL that is not measured (``null`` in the train rows of ``metrics.jsonl``). The evaluations keep the real source: the
held-out KL and the teacher's CE are measured as in any run. With ``lmbda > 0`` (on-policy KD) the student's own
samples train on the KD term alone whatever ``kd_ratio`` is, so such a run keeps its teacher in training.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from kdsweep.config.schema import RunConfig
from kdsweep.data.batch import Batch
from kdsweep.losses.targets import Targets, chunk_sizes
from kdsweep.teacher.job import Teacher
from kdsweep.teacher.source import TeacherSource


@dataclass
class NoTargets:
    """No teacher for ``n`` tokens: a divergence of 0 everywhere, no KL. ``vocab``: what the teacher's own targets
    would cut the student's logits to (a padded teacher's rows; the student's tokenizer for another tokenizer's
    teacher), so that the CE trains exactly as in a run that computes the teacher's targets and weighs them 0."""

    n: int
    vocab: int
    exact = True
    measured = False
    kl_temperature = 1.0
    extent = ()
    picks = None

    def __len__(self) -> int:
        return self.n

    def cuts(self, num_chunks: int) -> list[int]:
        return chunk_sizes(self.n, num_chunks)

    def split(self, num_chunks: int) -> list["NoTargets"]:
        return self.split_at(self.cuts(num_chunks))

    def split_at(self, sizes: list[int]) -> list["NoTargets"]:
        return [NoTargets(size, self.vocab) for size in sizes]

    def divergence(self, log_q: torch.Tensor, divergence: str, beta: float, temperature: float) -> torch.Tensor:
        return log_q.new_zeros(log_q.shape[0])

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        return log_q.new_full((log_q.shape[0],), math.nan)

    def kl_is(self, divergence: str, beta: float, temperature: float) -> bool:
        return False

    def teacher_ce(self, labels: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
        return torch.full(labels.shape, math.nan, device=labels.device)


class TeacherFree(TeacherSource):
    """The training source of a ``kd_ratio=0`` run: :class:`NoTargets` for every batch; no teacher token is computed
    or read."""

    tokens_computed = 0
    tokens_read = 0

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    @property
    def share_key(self) -> tuple:
        return "none", self.vocab

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Targets]:
        yield NoTargets(batch.labels.numel(), self.vocab)


def teacher_vocab_cut(cfg: RunConfig, teacher_dirs: list[Path], tokenizer: Any) -> int:
    """The vocabulary the teachers' targets compare the student over (the smallest any of them takes)."""
    from kdsweep.models.check import cross_tokenizer
    from kdsweep.teacher.job import vocab_size

    return min(len(tokenizer) if cross_tokenizer(view) else vocab_size(d)
               for (_, view), d in zip(cfg.teacher_views(), teacher_dirs))


def for_training(cfg: RunConfig, teacher: Teacher, teacher_dirs: list[Path], tokenizer: Any) -> Teacher:
    """``teacher``, whose training source is :class:`TeacherFree` when ``kd_ratio=0`` and nothing trains on the
    student's own samples (the evaluations' source unchanged)."""
    if cfg.loss.kd_ratio != 0 or cfg.rollout.lmbda > 0:
        return teacher
    free = TeacherFree(teacher_vocab_cut(cfg, teacher_dirs, tokenizer))
    return replace(teacher, train=free, record={**teacher.record, "training_steps": "without the teacher (kd_ratio=0)"})


__all__ = ["NoTargets", "TeacherFree", "for_training", "teacher_vocab_cut"]
