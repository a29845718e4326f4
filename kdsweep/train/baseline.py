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
from typing import Any, Callable, Iterator

from kdsweep.config.schema import RunConfig
from kdsweep.data.key import cache_root as data_cache_root
from kdsweep.data.sources import content_hash
from kdsweep.distributed import DistEnv
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
             cfg.train.dtype, cfg.dist.mixed_precision, cfg.data.max_eval_sequences, cfg.loss.ignore_index,
             cfg.loss.impl, world_size]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]
    return Path(cfg.trial.sweep_dir) / "baselines" / f"{key}.json"


@contextlib.contextmanager
def _one_at_a_time(path: Path | None, dist: DistEnv) -> Iterator[None]:
    """Rank 0 holds the lock of ``path`` (its other ranks wait for rank 0's word inside); nothing for a plain run."""
    if path is None or not dist.is_main:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a trial evaluating this baseline now: wait, then read what it wrote
        yield


def baseline(path: Path | None, evaluate: Callable[[], EvalResult], dist: DistEnv) -> tuple[EvalResult, bool]:
    """(the evaluation before training, whether it was read from the sweep rather than computed)."""
    with _one_at_a_time(path, dist):
        saved = dist.broadcast_object(json.loads(path.read_text()) if dist.is_main and path and path.is_file() else None)
        if saved is not None:
            log.info("the untrained student's evaluation: reused the sweep's baseline %s (same student, data, "
                     "teacher)", path)
            return EvalResult(**saved), True
        result = evaluate()
        if path is not None and dist.is_main:
            write_json_atomic(path, asdict(result))
    return result, False
