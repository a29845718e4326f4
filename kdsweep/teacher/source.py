"""The protocol every teacher source implements (the step and the evaluation depend on this, nothing else)."""

from __future__ import annotations

from typing import ContextManager, Hashable, Protocol, Sequence

from kdsweep.data.batch import Batch
from kdsweep.losses.targets import Targets


class TeacherSource(Protocol):
    """The teacher's targets for the tokens of a micro-batch, and what they cost."""

    tokens_computed: int
    """Token positions the teacher model ran over (0 for a cache)."""
    tokens_read: int
    """Token positions whose targets were read from a cache (0 for a live teacher)."""

    def targets(self, batch: Batch) -> ContextManager[Targets]:
        """The targets of ``batch``'s tokens (flattened ``[B·T]``), valid until the context ends."""
        ...

    @property
    def share_key(self) -> Hashable:
        """Sources with equal keys give the same targets for the same batch: a step that trains several learners (a
        pack's members) makes them once for all of them (:func:`~kdsweep.train.step.train_step`). This default
        shares with no other source."""
        return id(self)

    def prefetch(self, batches: Sequence[Batch]) -> None:
        """The batches whose targets will be asked for next, in order: a cache reads each one ahead, while the one
        before it trains (:class:`~kdsweep.teacher.cached.ReadAhead`); nothing to do for the others (this default)."""


__all__ = ["TeacherSource"]
