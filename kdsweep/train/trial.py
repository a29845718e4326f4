"""What a trial owns, built on the run's sources (``train.sources``) and never kept from one trial to the next: its
student (a fresh LoRA adapter, or the full weights read again), rollout, optimizer, scheduler, random state,
evaluation, cost meter, starting point (a checkpoint, or the sweep's shared baseline evaluation) and metric sinks.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Protocol

import torch
from torch import nn

from kdsweep.checkpoint import steps as checkpoints
from kdsweep.config.schema import RunConfig
from kdsweep.data.rows import Rows
from kdsweep.distributed import DistEnv, failure
from kdsweep.metrics.cost import CostMeter
from kdsweep.metrics.records import RunRecord, job_started
from kdsweep.metrics.sinks import MetricLogger, open_sinks
from kdsweep.models.load import load_student
from kdsweep.models.precision import Precision
from kdsweep.rollout import open_rollout
from kdsweep.startup import freeze_once
from kdsweep.train import schedule
from kdsweep.train.baseline import baseline, baseline_path
from kdsweep.train.sources import Sources
from kdsweep.train.chunks import output_rows
from kdsweep.train.step import Batch, EvalAsk, EvalResult, evaluate_together

log = logging.getLogger(__name__)


class Seat(Protocol):
    """Where a trial sits: alone in its job (:data:`ALONE`), or a member of a pack (:class:`~kdsweep.pack.job.Member`:
    its student wrapped over a frozen base the members share, and a share of the job's device time)."""

    def load(self, cfg: RunConfig, src: Sources, device: torch.device, dist: DistEnv) -> nn.Module:
        """The trial's student in train mode (:func:`~kdsweep.models.load.load_student`'s)."""
        ...

    def own(self, student: nn.Module) -> nn.Module:
        """The trained student as its export may change it in place (merging folds the adapter into the base)."""
        ...

    def seconds(self, started: float) -> float:
        """This trial's share of the job's wall seconds since ``started`` (all of them, alone)."""
        ...


class _Alone:
    def load(self, cfg: RunConfig, src: Sources, device: torch.device, dist: DistEnv) -> nn.Module:
        return load_student(src.student_dir, cfg.model, cfg.train.dtype, device, cfg.train.seed, dist, cfg.dist,
                            src.plan.student)

    def own(self, student: nn.Module) -> nn.Module:
        return student  # its own base: the export's is its last use

    def seconds(self, started: float) -> float:
        return time.time() - started


ALONE: Seat = _Alone()


@dataclass
class Trial:
    student: nn.Module
    rollout: Any
    """Where each step's micro-batches come from: the data, or completions generated on-policy (``rollout``)."""
    optimizer: torch.optim.Optimizer
    scheduler: Any
    held_out: Callable[[], EvalAsk]
    """The held-out evaluation, as the run asks its driver for it (a collective: every rank's run asks it)."""
    test: Callable[[], EvalAsk]
    """The test split's evaluation (``train.eval_test``), asked like :attr:`held_out`."""
    meter: CostMeter
    start_step: int
    eval_before: EvalResult
    metrics: MetricLogger
    compute: Callable[[], ContextManager]
    """What the student's steps and evaluations run under: autocast to bf16 for an unsharded ``train.dtype=bf16``
    student (a sharded one gets it from FSDP2), else nothing."""
    chunks: int
    """The loss's chunks per training micro-batch: from the configured micro-batch (``data.micro_batch_size`` ×
    ``data.seq_len``), so every rank and every batch takes the same path (kdsweep.train.chunks)."""


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank since :func:`reset_peak_memory`: allocated device memory on GPUs, the process's peak
    resident memory on CPU (``VmHWM``)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def reset_peak_memory(device: torch.device) -> None:
    """A trial's peak memory counts from here (a warm worker's earlier trials do not count): the previous trial's
    garbage collected, its cached device blocks freed, the heap's free pages given back to the system (glibc keeps
    what was freed, and a reset ``VmHWM`` would start from it: what an evaluation before training had freed counted
    in the training steps' peak, 244 MB of a CE-only trial at a 128k vocabulary), the peak counters reset
    (``/proc/self/clear_refs`` resets ``VmHWM`` on Linux)."""
    collect_garbage()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def collect_garbage() -> None:
    """Collect what earlier trials left. The first collection in a process that did not import through
    ``startup.import_frozen`` also freezes what is alive then (the imported modules: about 400k objects) out of every
    later collection: a full collection scanned them all, 0.19 s on this machine's CPU, twice per trial (a pack:
    twice per member). What a trial builds is made after that, and collected as before."""
    gc.collect()
    freeze_once()


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def eval_batches_of_rank(rows: Rows, batch_size: int, dist: DistEnv, device: torch.device) -> list[Batch]:
    """This rank's share of the held-out rows, in batches.

    Sharded models run collectives in every forward, so every rank must run the same number of forwards:
    a rank whose share is shorter gets padding batches whose labels are all ignored (they add nothing).
    """
    share = torch.arange(len(rows)).tensor_split(dist.world_size)[dist.rank]
    longest = -(-len(rows) // dist.world_size)
    batches = [rows.batch(idx).to(device) for idx in share.split(batch_size) if len(idx)]
    while len(batches) < -(-longest // batch_size):
        batches.append(rows.batch([0], mask_labels=True).to(device))
    return batches


def start_trial(cfg: RunConfig, dist: DistEnv, device: torch.device, src: Sources, record: RunRecord | None,
                resume_from: Path | None, out: Path, seat: Seat = ALONE) -> Trial:
    """The trial's own parts, from its checkpoint (``resume_from``) or from the start (after the baseline); its
    student, and its share of the job's time, from its ``seat``."""
    t0 = time.perf_counter()
    failure.doing("loading the student")
    student = seat.load(cfg, src, device, dist)
    compute = lambda: Precision(cfg.train.dtype).autocast(device, sharded=src.plan.student.sharded)
    src.timings["student_s"] = time.perf_counter() - t0
    rollout = open_rollout(cfg, student, src.teacher, src.tokenizer, dist, device)

    torch.manual_seed(cfg.train.seed + dist.rank)  # dropout: each rank its own stream, as each has its own data
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [p for p in student.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, eps=o.eps,
        weight_decay=o.weight_decay,
    )
    scheduler = schedule.build(optimizer, o, cfg.train.max_steps)
    eval_batches = eval_batches_of_rank(src.eval_rows, cfg.data.eval_batch_size, dist, device)
    chunks = cfg.loss_chunks(output_rows(student))
    log.info("the loss runs in %d chunk(s) per micro-batch (%d per held-out batch): loss.chunk_mb=%g, impl=%s",
             chunks["train"], chunks["eval"], cfg.loss.chunk_mb, cfg.loss.impl)

    def held_out(batches: list[Batch] = eval_batches, split: str = "eval") -> EvalAsk:
        return EvalAsk(student, src.teacher.eval, batches, cfg.loss, chunks["eval"], compute, split)

    def test() -> EvalAsk:  # the data has a test split whenever train.eval_test is set (RunConfig)
        rows = src.data.test.head(cfg.data.max_eval_sequences)
        return held_out(eval_batches_of_rank(rows, cfg.data.eval_batch_size, dist, device), "test")

    # the job's own start: its imports and tokenization hold the devices too
    teacher = src.teacher
    meter = CostMeter(dist, job_started(), teacher.tokens, (teacher.record.get("build") or {}).get("teacher_tokens", 0),
                      seat.seconds)

    failure.doing("resuming from its checkpoint" if resume_from is not None else "evaluating the untrained student")
    if resume_from is not None:
        state = checkpoints.load(resume_from, student, optimizer, dist)
        scheduler.load_state_dict(state["scheduler"])
        start_step, eval_before = state["step"], EvalResult(**state["eval_before"])
        log.info("resumed from %s (step %d)", resume_from, start_step)
    else:
        where = baseline_path(cfg, src.student_dir, teacher.identity, teacher.record, src.data.cache_dir.name,
                              dist.world_size)
        start_step, (eval_before, src.timings["baseline_reused"]) = 0, baseline(
            where, lambda: evaluate_together([held_out()], dist=dist)[0], dist)
    log.info(
        "held-out CE before: student %.4f, teacher %.4f (KL %.4f, %d tokens)",
        eval_before.student_ce, eval_before.teacher_ce, eval_before.kl, eval_before.tokens,
    )
    sinks, wandb_info = open_sinks(cfg, out, start_step, record.data["config"]) if record is not None else ([], None)
    metrics = MetricLogger(sinks)
    if start_step == 0:
        metrics.log("eval", 0, asdict(eval_before))
    if record is not None:
        teachers = [str(d) for d in src.teacher_dirs]  # a hub id's snapshot
        record.update(models={"student": str(src.student_dir),
                              "teacher": teachers[0] if len(teachers) == 1 else teachers},
                      placement=src.plan.record(), precision=precision_record(cfg, student), timings=src.timings,
                      data=src.stats, resumed_from=str(resume_from) if resume_from else None,
                      start_step=start_step, wandb=wandb_info, loss_chunks=chunks)
    return Trial(student, rollout, optimizer, scheduler, held_out, test, meter, start_step, eval_before,
                 metrics, compute, chunks["train"])


def precision_record(cfg: RunConfig, student: nn.Module) -> dict[str, Any]:
    """run.json's ``precision``: ``train.dtype``, and the dtypes the student's parameters are held in."""
    held: dict[str, int] = {}
    for p in student.parameters():
        key = f"{'trainable' if p.requires_grad else 'frozen'} {str(p.dtype).removeprefix('torch.')}"
        held[key] = held.get(key, 0) + p.numel()
    return {"dtype": cfg.train.dtype, "tf32": cfg.train.tf32, "student_parameters": held}
