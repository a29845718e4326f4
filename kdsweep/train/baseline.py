"""The held-out evaluation before training, computed once per sweep and reused by every trial it is the same for.

Before its first step a LoRA student is its base model (peft initialises B = 0) and a fully fine-tuned one is the
base model too, so every trial of a sweep with the same student, data, teacher targets, precision and ranks starts
from the same numbers, whatever its kd_ratio, learning rate or LoRA rank. The first trial that computes them
writes them into the sweep directory (``baselines/<key>.json``, atomically); the others read them. Trials that
start together (the controller starts the ones behind a teacher-cache build before it ends) take turns on a lock
beside that file, so the baseline is evaluated exactly once per sweep. Plain runs (not a sweep's trials) always
evaluate.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from kdsweep.config.schema import RunConfig
from kdsweep.data.key import cache_root as data_cache_root
from kdsweep.data.sources import content_hash
from kdsweep.distributed import DistEnv
from kdsweep.distributed.waits import from_rank0
from kdsweep.metrics.records import write_json_atomic
from kdsweep.train.step import EvalResult

log = logging.getLogger(__name__)


def baseline_path(cfg: RunConfig, student_dir: Path, teacher_identity: str, teacher_record: dict[str, Any],
                  data_key: str, world_size: int) -> Path | None:
    """Where this trial's baseline is kept in its sweep; None for a run that is not a sweep's trial. The teacher
    counts by its identity (its cache, which names its weights, or its weights' content; several teachers, each
    and its weight) and by the distance it logs (a teacher with another tokenizer: its loss and weights)."""
    if not cfg.trial.sweep_dir:
        return None
    memo = data_cache_root(cfg.data) / "hashes"
    parts = [1, content_hash(str(student_dir), memo), teacher_identity, teacher_record.get("kl"), data_key,
             cfg.train.dtype, cfg.data.max_eval_sequences, cfg.loss.ignore_index,
             cfg.loss.impl, world_size]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]
    return Path(cfg.trial.sweep_dir) / "baselines" / f"{key}.json"


def _lock(path: Path, held: contextlib.ExitStack) -> Any:
    """Rank 0 takes the lock beside ``path`` for as long as ``held`` lasts (a trial evaluating this baseline now:
    wait, then read what it wrote) and reads the baseline, if it is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = held.enter_context(open(path.parent / f".{path.name}.lock", "w"))
    fcntl.flock(lock, fcntl.LOCK_EX)
    return json.loads(path.read_text()) if path.is_file() else None


def baseline(path: Path | None, evaluate: Callable[[], EvalResult], dist: DistEnv) -> tuple[EvalResult, bool]:
    """(the evaluation before training, whether it was read from the sweep rather than computed). Rank 0 holds the
    baseline's lock while it is evaluated; its peers wait for its word outside any collective."""
    if path is None:
        return evaluate(), False
    with contextlib.ExitStack() as held:
        saved = from_rank0(dist, f"read the sweep's baseline {path}", lambda: _lock(path, held))
        if saved is not None:
            log.info("the untrained student's evaluation: reused the sweep's baseline %s (same student, data, "
                     "teacher)", path)
            return EvalResult(**saved), True
        result = evaluate()
        if dist.is_main:
            write_json_atomic(path, asdict(result))
    return result, False
