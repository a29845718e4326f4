"""What a process keeps from one run to the next: the worker's side of the split between a worker and a trial.

A warm trial worker (``kdsweep.worker``) runs trial after trial in one process group. What does not depend on a
trial's knobs is opened once and kept: the tokenizer, the tokenized rows, a live teacher's weights. Each is kept
under the key of what it depends on, computed from the trial's config by content as the caches are (the data's
key hashes the sources, the tokenizer files, the template and every setting that shapes the rows; a teacher's
key hashes its files and names its dtype and sharding). A trial whose config gives another key gets the thing
rebuilt, never the old one. What a trial owns (adapter or trained weights, optimizer, scheduler, random state,
data position, sinks, the pruner's handle) is built by ``train.run`` every time and never kept.

A plain job holds a fresh ``Kept`` and runs one trial with it: the same code path as a worker's.
"""

from __future__ import annotations

import gc
import logging
from typing import Any, Callable, Hashable, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Kept:
    """One slot per kind of thing (``"data"``, ``"live_teacher"``, ...): the object built for the last key asked.

    A new key replaces the old object (its memory is freed before the new one is built): a worker never holds
    two teachers at once. ``reused`` lists what was found kept since the last ``begin_run``. Keys are given as
    functions, computed only by a worker's ``Kept``: a plain job's (``Kept.one_run()``) builds and forgets, and
    never pays for a key (a teacher's key hashes its files once)."""

    def __init__(self, keeps: bool = True) -> None:
        self._slots: dict[str, tuple[Hashable, Any]] = {}
        self.keeps = keeps
        self.reused: list[str] = []

    @classmethod
    def one_run(cls) -> "Kept":
        return cls(keeps=False)

    def begin_run(self) -> None:
        self.reused = []

    def get(self, kind: str, key: Callable[[], Hashable], build: Callable[[], T]) -> T:
        """The kept ``kind`` if it was built for ``key()``, else ``build()`` (kept for the next run)."""
        if not self.keeps:
            return build()
        key = key()
        held = self._slots.get(kind)
        if held is not None and held[0] == key:
            self.reused.append(kind)
            return held[1]
        if held is not None:
            log.info("worker: %s changed for this trial: rebuilding it", kind)
            del self._slots[kind], held
            gc.collect()
        value = build()
        self._slots[kind] = (key, value)
        return value

    def clear(self) -> None:
        self._slots.clear()
        gc.collect()
