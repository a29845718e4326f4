"""What a run reads: the student's tokenizer, the tokenized rows and the teacher's targets.

This is the worker's side of the split between a warm worker and its trials: ``train.kept.Kept`` keeps what of it
does not depend on a trial's knobs (the tokenizer, the rows, a live teacher's weights), each under the key of its
content; a plain job opens it all once. What a trial owns is built on top of it by ``train.trial``.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kdsweep.config.schema import RunConfig
from kdsweep.data.dataset import RunData, data_key, describe, load_data
from kdsweep.data.key import cache_root as data_cache_root, tokenizer_digest
from kdsweep.data.rows import Rows
from kdsweep.data.sampling import StepSampler
from kdsweep.distributed import DistEnv, failure
from kdsweep.metrics.records import SHARED_THREADS, RunRecord, job_started
from kdsweep.models.load import Plan, load_tokenizer, plan, resolve_dir
from kdsweep.teacher.absent import for_training
from kdsweep.teacher.job import Teacher, open_teacher
from kdsweep.teacher.mixture import mix
from kdsweep.teacher.views import chat_view
from kdsweep.train.kept import Kept

log = logging.getLogger(__name__)


@dataclass
class Sources:
    student_dir: Path
    teacher_dirs: list[Path]
    """The models' HF directories (a hub id's snapshot, a zoo model's build): the student's, each teacher's."""
    tokenizer: Any
    data: RunData
    train_rows: Rows
    eval_rows: Rows
    """The held-out rows this run evaluates on (at most ``data.max_eval_sequences``)."""
    sampler: StepSampler
    """Which rows each step reads (the run's seed and batch size): resumable by step."""
    plan: Plan
    """Where the student and each teacher live on the ranks (run.json's ``placement``)."""
    teacher: Teacher
    stats: dict[str, Any]
    """run.json's ``data``: the tokenization cache, and per split samples, rows, tokens and padding."""
    timings: dict[str, float]


def open_data(cfg: RunConfig, student_dir: Path, kept: Kept) -> tuple[Any, RunData]:
    """The student's tokenizer and the run's rows (with a teacher of another tokenizer, its reading of chat samples
    in its own template beside them), kept by a worker under the keys of their content."""
    tokenizer = kept.get("tokenizer", lambda: (str(student_dir), tokenizer_digest(student_dir)),
                         lambda: load_tokenizer(student_dir))
    view = chat_view(cfg, tokenizer)
    identity = None if view is None else view.identity
    key = lambda: (str(data_cache_root(cfg.data)), data_key(cfg.data, student_dir, cfg.loss.ignore_index, identity))
    data = kept.get("data", key, lambda: load_data(cfg.data, tokenizer, student_dir, cfg.loss.ignore_index, view))
    if "data" in kept.reused:
        log.info("data: the rows of %s, kept by this worker from an earlier trial", data.cache_dir)
        for split, stats in data.stats.items():
            log.info("data %s: %s", split, describe(stats, cfg.data))
    return tokenizer, data


def open_sources(cfg: RunConfig, dist: DistEnv, device: torch.device, kept: Kept, record: RunRecord | None) -> Sources:
    """The run's rows and its teacher (a live model, or the teacher-logit cache, built first if nobody has yet)."""
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    failure.doing("reading the data")
    views = cfg.teacher_views()  # each teacher's weight, and the config as that teacher's alone
    student_dir = resolve_dir(cfg.model)
    teacher_dirs = [resolve_dir(view.teacher, "teacher") for _, view in views]
    d = cfg.data
    tokenizer, data = open_data(cfg, student_dir, kept)
    train_rows, eval_rows = data.train, data.eval.head(d.max_eval_sequences)
    sampler = StepSampler(len(train_rows), d.batch_size, cfg.train.seed)
    stats = {"cache_dir": str(data.cache_dir), "cache_reused": data.reused, **copy.deepcopy(data.stats)}
    if d.sequences == "pad":  # how much of each padded micro-batch is padding, over the steps this run takes
        steps = [sampler.rank_micro_batches(k, 0, 1, d.micro_batch_size) for k in range(min(cfg.train.max_steps, 200))]
        stats["train"]["padding_fraction"] = train_rows.padding_fraction([i for s in steps for i in s])
        log.info("data train: micro-batches padded to their longest row are %.1f%% padding",
                 100 * stats["train"]["padding_fraction"])
    timings["data_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()

    def building(progress: dict[str, float]) -> None:  # how long this job took to start, for the sweep controller
        if record is not None:
            started = time.time() - job_started() - progress["elapsed_s"]
            record.update(teacher_targets={"building": True, "startup_s": started, **progress})

    placed = plan(cfg, student_dir, teacher_dirs, dist, device)
    for name, where in (("student", placed.student), *((f"teacher {i}", t) for i, t in enumerate(placed.teachers))):
        if dist.world_size > 1:
            log.info("placement: %s %s (%s)", name, where.how, where.why)
    failure.doing("loading the teacher (or reading, or building, its cache)")
    teachers = [open_teacher(view, teacher_dir, student_dir, data, dist, device, building, kept.get, slot=f"{i or ''}",
                             placement=where)
                for i, ((_, view), teacher_dir, where) in enumerate(zip(views, teacher_dirs, placed.teachers))]
    teacher = teachers[0] if not cfg.teachers else mix(teachers, [w for w, _ in views], [str(d) for d in teacher_dirs])
    teacher = for_training(cfg, teacher, teacher_dirs, tokenizer)  # kd_ratio=0: the training steps need no teacher
    if record is not None:  # the sweep controller starts the other trials once a cache is ready
        record.update(teacher_targets=teacher.record, kept=list(kept.reused))
    if kept.reused:
        log.info("worker: kept from its earlier trials: %s", ", ".join(kept.reused))
    if os.environ.get(SHARED_THREADS) and not cfg.train.threads:  # it built the cache alone: now it shares the cores
        torch.set_num_threads(int(os.environ[SHARED_THREADS]))
    timings["teacher_s"] = time.perf_counter() - t0
    return Sources(student_dir, teacher_dirs, tokenizer, data, train_rows, eval_rows, sampler, placed, teacher, stats,
                   timings)
