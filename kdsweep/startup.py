"""A process's start-up: what its jobs import, imported with Python's cyclic garbage collector paused, and then frozen
out of every later collection (``gc.freeze``).

torch, transformers, peft and kdsweep leave some 400k objects alive once imported, for as long as the process lives.
While they are imported, the collector runs a full collection each time the objects alive have grown by a quarter,
and each scans all of them again: seven full collections, 0.6 CPU-s of a job's start on this machine's CPU, and a
trial's first collection (``train.trial.collect_garbage``) scanned them once more, 0.2 s. Imported with the collector
paused and frozen once imported, they are never scanned; what a job builds after is collected as before. Frozen once
per process: a later freeze would keep an earlier trial's garbage (a warm worker's, a multirun's) for good. A process
forked from one that froze inherits its freeze (and the collector, never touching the frozen objects' headers, leaves
the pages it shares with its parent shared).

This module imports nothing heavy itself: it is imported before torch.
"""

from __future__ import annotations

import gc
import importlib
from typing import Iterable

# What a rank imports: the local ranks' forkserver imports it once (``distributed.launch``), and a job, a warm
# worker or a rank imports it through :func:`import_frozen` before anything else.
RANK_IMPORTS = ["kdsweep.app", "kdsweep.train.loop", "kdsweep.models.load", "transformers.modeling_utils", "peft"]

_FROZEN: list[bool] = []  # a flag: gc.get_freeze_count() walks the frozen objects (35 ms)


def import_frozen(modules: Iterable[str] = RANK_IMPORTS) -> None:
    """Import ``modules`` with the collector paused (as it was after), then freeze what is alive, once per process."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        freeze_once()
        if enabled:
            gc.enable()


def freeze_once() -> None:
    """Freeze every object alive now out of later collections, unless this process (or the one it was forked from)
    already did."""
    if not _FROZEN:
        gc.freeze()
        _FROZEN.append(True)
