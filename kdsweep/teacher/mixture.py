"""Several teachers behind the one protocol (``teachers=[...]``): each teacher's own source (live, cached, another
tokenizer's), their targets for a micro-batch combined into a :class:`~kdsweep.losses.mixture.Mixture`."""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

from kdsweep.data.batch import Batch
from kdsweep.losses.mixture import Mixture
from kdsweep.teacher.job import Teacher
from kdsweep.teacher.source import TeacherSource

log = logging.getLogger(__name__)


class MixedTeacher(TeacherSource):
    """A :class:`~kdsweep.teacher.source.TeacherSource` of several: ``sources[i]`` weighs ``weights[i]``."""

    def __init__(self, sources: list[TeacherSource], weights: list[float]) -> None:
        self.sources, self.weights = sources, weights

    @property
    def tokens_computed(self) -> int:
        return sum(s.tokens_computed for s in self.sources)

    @property
    def tokens_read(self) -> int:
        return sum(s.tokens_read for s in self.sources)

    @property
    def share_key(self) -> tuple:
        return "mixture", tuple(s.share_key for s in self.sources), tuple(self.weights)

    def prefetch(self, batches: Sequence[Batch]) -> None:
        for s in self.sources:
            s.prefetch(batches)

    @contextmanager
    def targets(self, batch: Batch) -> Iterator[Mixture]:
        with ExitStack() as stack:
            yield Mixture([stack.enter_context(s.targets(batch)) for s in self.sources], self.weights)


def mix(teachers: list[Teacher], weights: list[float], names: list[str]) -> Teacher:
    """One teacher of several: their sources mixed, run.json's ``teacher_targets`` listing each (``names``: where
    each comes from), the baseline's identity of them all and their weights."""
    total = sum(weights)
    log.info("teachers: %s; the KD term is the weighted mean of the divergences to each",
             ", ".join(f"{name} (weight {w / total:.3g}, {t.record['source']})"
                       for name, w, t in zip(names, weights, teachers)))
    record: dict[str, Any] = {
        "source": "mixture", "ready": all(t.record.get("ready", True) for t in teachers),
        "kd": "the weighted mean of the divergences to each teacher, each as its own targets define it",
        "teacher_ce": "the weighted mean of each teacher's cross-entropy of the same text",
        "kl": "the weighted mean of each teacher's logged distance, at T=1",
        "teachers": [{"teacher": name, "weight": w / total, **t.record}
                     for name, w, t in zip(names, weights, teachers)],
    }
    identity = hashlib.sha256(json.dumps([[t.identity, w / total] for t, w in zip(teachers, weights)]).encode())
    return Teacher(MixedTeacher([t.train for t in teachers], weights),
                   MixedTeacher([t.eval for t in teachers], weights), record, identity.hexdigest()[:20])


__all__ = ["MixedTeacher", "mix"]
