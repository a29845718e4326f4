"""``run(cfg)``: build everything, resume if possible, train, evaluate, checkpoint, export, record."""

from __future__ import annotations

import copy
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kdsweep.checkpoint import export as exporting
from kdsweep.checkpoint import steps as checkpoints
from kdsweep.config.schema import (ConfigError, DataConfig, DistConfig, RolloutConfig, RunConfig, StudentConfig,
                                   TeacherCacheConfig)
from kdsweep.data.dataset import RunData, data_key, describe, load_data
from kdsweep.data.key import cache_root as data_cache_root, tokenizer_digest
from kdsweep.data.rows import Rows
from kdsweep.data.sampling import StepSampler
from kdsweep.distributed import DistEnv, device_for, single_process
from kdsweep.metrics.records import SHARED_THREADS, RunRecord, job_started
from kdsweep.metrics.sinks import MetricLogger, open_sinks
from kdsweep.metrics.cost import CostMeter
from kdsweep.teacher.job import open_teacher
from kdsweep.train.baseline import baseline, baseline_path
from kdsweep.train.kept import Kept
from kdsweep.train.profile import step_profiler
from kdsweep.models.load import load_student, load_tokenizer, resolve_dir, unsharded_on_rank0
from kdsweep.rollout import open_rollout
from kdsweep.train import schedule
from kdsweep.train.step import Batch, EvalResult, evaluate, train_step

log = logging.getLogger(__name__)


class Reporter(Protocol):
    """How a run tells a sweep about its evals (EvalResult's fields by name); ``True`` means: stop now (pruned)."""

    def report(self, step: int, evals: dict[str, float]) -> bool: ...


class Preemption(Protocol):
    """Set by a signal handler when the job is about to be preempted; the loop then checkpoints and stops."""

    requested: bool


class _NullReporter:
    def report(self, step: int, evals: dict[str, float]) -> bool:
        return False


NULL_REPORTER: Reporter = _NullReporter()


@dataclass
class RunResult:
    objective: float
    """Held-out student CE after training (lower is better)."""
    status: str
    """completed; pruned when the reporter asked to stop; preempted when a checkpoint was written at a signal."""
    steps: int
    eval_before: EvalResult
    eval_after: EvalResult | None
    """None when the run stopped for preemption (it has no final evaluation yet)."""
    output_dir: str
    exports: dict[str, str] = field(default_factory=dict)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this rank so far: allocated device memory on GPUs, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


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


def _warn_idle_knobs(cfg: RunConfig, dist: DistEnv) -> None:
    """Options that cannot act in this setting: say so instead of ignoring them silently."""

    def changed(section: Any, default: Any, knob: str) -> bool:
        return getattr(section, knob) != getattr(default, knob)

    if dist.world_size == 1:
        for knob in ("reshard_after_forward", "mixed_precision", "cpu_offload"):
            if changed(cfg.dist, DistConfig(), knob):
                log.warning("dist.%s=%s has no effect with one rank (nothing is sharded)", knob, getattr(cfg.dist, knob))
    if dist.source in ("torchrun", "slurm") and changed(cfg.dist, DistConfig(), "nproc_per_node"):
        log.warning("dist.nproc_per_node=%d is ignored: %s decides the ranks (%d here)",
                    cfg.dist.nproc_per_node, dist.source, dist.world_size)
    if cfg.model.lora_rank == 0:
        for knob in ("lora_alpha", "lora_dropout"):
            if changed(cfg.model, StudentConfig(zoo="tiny-student"), knob):
                log.warning("model.%s has no effect with lora_rank=0 (full fine-tune)", knob)
        if cfg.checkpoint.export_adapter and not cfg.checkpoint.export_merged:
            log.warning("checkpoint.export_adapter: a full fine-tune has no adapter; set export_merged=true to export")
    cache, default = cfg.teacher.cache, TeacherCacheConfig()
    idle = {"live": ("method", "k", "temperature", "seed", "rows", "dir"), "full": ("k", "temperature", "seed"),
            "topk": ("seed",), "sample": ()}["live" if cfg.teacher.logits == "live" else cache.method]
    for knob in (k for k in idle if changed(cache, default, k)):
        why = "teacher.logits=live" if cfg.teacher.logits == "live" else f"teacher.cache.method={cache.method}"
        log.warning("teacher.cache.%s=%s has no effect with %s", knob, getattr(cache, knob), why)
    if not cfg.rollout.active:
        for knob in ("max_new_tokens", "temperature", "top_p", "seed"):
            if changed(cfg.rollout, RolloutConfig(), knob):
                log.warning("rollout.%s has no effect with lmbda=0 and rollout.seq_kd=false (nothing is generated)", knob)
    if cfg.data.eval_datasets and changed(cfg.data, DataConfig(), "eval_fraction"):
        log.warning("data.eval_fraction has no effect: data.eval_datasets are the held-out set")


def training_fingerprint(cfg: RunConfig, data_key: str) -> dict[str, Any]:
    """The settings that determine the trained weights; a checkpoint only resumes a run with the same ones.

    The data counts by ``data_key`` (the tokenization cache's key: the sources' content and every setting that
    shapes the rows) and the batch sizes, not by where the files lie. Left out: where and how the run is observed
    or laid out (output dir, logging, eval cadence, threads, device, ranks and sharding, checkpoint cadence),
    which by design do not change the result.
    """
    d = asdict(cfg)
    d["data"] = {"content": data_key, "batch_size": cfg.data.batch_size, "micro_batch_size": cfg.data.micro_batch_size}
    d["teacher"]["cache"].pop("dir")  # where a cache lies, like where the data lies, does not change the weights
    for key in ("eval_every", "log_every", "threads", "device"):
        d["train"].pop(key)
    return {k: d[k] for k in ("model", "teacher", "data", "loss", "optim", "train")} | {
        "mixed_precision": cfg.dist.mixed_precision
    }


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_resumable(cfg: RunConfig) -> Path | None:
    """The checkpoint this run will resume from, after checking it belongs to the same training config.

    Runs before anything is written, so a refused resume leaves the directory (and its run.json) as it was.
    """
    root = Path(cfg.output_dir) / "checkpoints"
    latest = checkpoints.latest(root)
    if latest is None:
        return None
    if not cfg.checkpoint.resume:
        raise ConfigError(
            f"checkpoint.resume=false but {root} holds checkpoints of an earlier run; kdsweep never deletes them: "
            "pass a new hydra.run.dir to start over"
        )
    saved = torch.load(latest / "state_rank0.pt", weights_only=False).get("fingerprint")
    now = training_fingerprint(cfg, data_key(cfg.data, resolve_dir(cfg.model), cfg.loss.ignore_index))
    if saved is not None and saved != now:
        a, b = _flat(saved), _flat(now)
        diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise ConfigError(
            f"{cfg.output_dir} holds checkpoints of a different training config ({'; '.join(diff[:3])}); "
            "resume it unchanged, or pass another hydra.run.dir"
        )
    return latest


def prepare_data(cfg: RunConfig) -> None:
    """Build the run's tokenization cache here, before local ranks are spawned: a bad row is then one line from
    this process, and the ranks only memory-map the result."""
    student_dir = resolve_dir(cfg.model)
    load_data(cfg.data, load_tokenizer(student_dir), student_dir, cfg.loss.ignore_index)


def open_data(cfg: RunConfig, student_dir: Path, kept: Kept) -> tuple[Any, RunData]:
    """The student's tokenizer and the run's rows, kept by a worker under the keys of their content."""
    tokenizer = kept.get("tokenizer", lambda: (str(student_dir), tokenizer_digest(student_dir)),
                         lambda: load_tokenizer(student_dir))
    key = lambda: (str(data_cache_root(cfg.data)), data_key(cfg.data, student_dir, cfg.loss.ignore_index))
    data = kept.get("data", key, lambda: load_data(cfg.data, tokenizer, student_dir, cfg.loss.ignore_index))
    if "data" in kept.reused:
        log.info("data: the rows of %s, kept by this worker from an earlier trial", data.cache_dir)
        for split in ("train", "eval"):
            log.info("data %s: %s", split, describe(data.stats[split], cfg.data))
    return tokenizer, data


def run(
    cfg: RunConfig,
    *,
    reporter: Reporter = NULL_REPORTER,
    preemption: Preemption | None = None,
    dist: DistEnv | None = None,
    resolved_config: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    kept: Kept | None = None,
) -> RunResult:
    """Train the student against the teacher as ``cfg`` says; resumable from ``cfg.output_dir``. ``kept``: what a
    warm worker keeps from its earlier trials (a fresh one for a plain job)."""
    dist, kept = dist or single_process(), kept or Kept.one_run()
    kept.begin_run()
    resume_from = check_resumable(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = (
        RunRecord(out / "run.json", resolved_config or asdict(cfg), overrides or [], world_size=dist.world_size)
        if dist.is_main else None
    )
    if record is not None:
        t = cfg.trial
        record.update(trial={"study": t.study, "number": t.number, "sweep_dir": t.sweep_dir} if t.sweep_dir else None)
    started = time.time()
    try:
        result = _train(cfg, dist, reporter, preemption, out, record, resume_from, kept)
    except BaseException as e:
        if record is not None:
            record.update(status="failed", error=f"{type(e).__name__}: {e}", wall_seconds=time.time() - started)
        raise
    if record is not None:
        record.update(
            status=result.status,
            objective=result.objective,
            steps=result.steps,
            eval_before=asdict(result.eval_before),
            eval_after=asdict(result.eval_after) if result.eval_after else None,
            exports=result.exports,
            wall_seconds=time.time() - started,
        )
    return result


def _train(
    cfg: RunConfig, dist: DistEnv, reporter: Reporter, preemption: Preemption | None, out: Path,
    record: RunRecord | None, resume_from: Path | None, kept: Kept,
) -> RunResult:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = device_for(cfg.train.device, dist)
    torch.manual_seed(cfg.train.seed)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    student_dir, teacher_dir = resolve_dir(cfg.model), resolve_dir(cfg.teacher, "teacher")
    d = cfg.data
    tokenizer, data = open_data(cfg, student_dir, kept)
    train_rows, eval_rows = data.train, data.eval.head(d.max_eval_sequences)
    sampler = StepSampler(len(train_rows), d.batch_size, cfg.train.seed)
    data_stats = {"cache_dir": str(data.cache_dir), "cache_reused": data.reused, **copy.deepcopy(data.stats)}
    if d.sequences == "pad":  # how much of each padded micro-batch is padding, over the steps this run takes
        steps = [sampler.rank_micro_batches(k, 0, 1, d.micro_batch_size) for k in range(min(cfg.train.max_steps, 200))]
        data_stats["train"]["padding_fraction"] = train_rows.padding_fraction([i for s in steps for i in s])
        log.info("data train: micro-batches padded to their longest row are %.1f%% padding",
                 100 * data_stats["train"]["padding_fraction"])
    timings["data_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _warn_idle_knobs(cfg, dist)
    dtype = cfg.train.dtype
    def building(progress: dict[str, float]) -> None:  # how long this job took to start, for the sweep controller
        if record is not None:
            started = time.time() - job_started() - progress["elapsed_s"]
            record.update(teacher_targets={"building": True, "startup_s": started, **progress})

    teacher = open_teacher(cfg, teacher_dir, student_dir, data, dist, device, building, kept.get)
    if record is not None:  # the sweep controller starts the other trials once a cache is ready
        record.update(teacher_targets=teacher.record, kept=list(kept.reused))
    if kept.reused:
        log.info("worker: kept from its earlier trials: %s", ", ".join(kept.reused))
    if os.environ.get(SHARED_THREADS) and not cfg.train.threads:  # it built the cache alone: now it shares the cores
        torch.set_num_threads(int(os.environ[SHARED_THREADS]))
    timings["teacher_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    student = load_student(student_dir, cfg.model, dtype, device, cfg.train.seed, dist, cfg.dist)
    timings["student_s"] = time.perf_counter() - t0
    rollout = open_rollout(cfg, student, teacher.train, tokenizer, dist, device)

    torch.manual_seed(cfg.train.seed + dist.rank)  # dropout: each rank its own stream, as each has its own data
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [p for p in student.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, eps=o.eps,
        weight_decay=o.weight_decay,
    )
    scheduler = schedule.build(optimizer, o, cfg.train.max_steps)
    eval_batches = eval_batches_of_rank(eval_rows, d.eval_batch_size, dist, device)
    evaluate_now = lambda: evaluate(
        student, teacher.eval, eval_batches, ignore_index=cfg.loss.ignore_index, dist=dist,
        num_chunks=cfg.loss.num_chunks, fused=cfg.loss.impl == "fused",
    )
    # the job's own start: its imports and tokenization hold the devices too
    meter = CostMeter(dist, job_started(), teacher.tokens, (teacher.record.get("build") or {}).get("teacher_tokens", 0))

    ckpt_root = out / "checkpoints"
    if resume_from is not None:
        state = checkpoints.load(resume_from, student, optimizer, dist)
        scheduler.load_state_dict(state["scheduler"])
        start_step, eval_before = state["step"], EvalResult(**state["eval_before"])
        log.info("resumed from %s (step %d)", resume_from, start_step)
    else:
        where = baseline_path(cfg, student_dir, teacher_dir, teacher.record, data.cache_dir.name, dist.world_size)
        start_step, (eval_before, timings["baseline_reused"]) = 0, baseline(where, evaluate_now, dist)
    step = start_step
    log.info(
        "held-out CE before: student %.4f, teacher %.4f (KL %.4f, %d tokens)",
        eval_before.student_ce, eval_before.teacher_ce, eval_before.kl, eval_before.tokens,
    )
    sinks, wandb_info = open_sinks(cfg, out, start_step, record.data["config"]) if record is not None else ([], None)
    metrics = MetricLogger(sinks)
    if start_step == 0:
        metrics.log("eval", 0, asdict(eval_before))
    if record is not None:
        record.update(models={"student": str(student_dir), "teacher": str(teacher_dir)},  # a hub id's snapshot
                      timings=timings, data=data_stats, resumed_from=str(resume_from) if resume_from else None, start_step=start_step,
                      wandb=wandb_info)

    status = "completed"
    from tqdm import tqdm

    bar = tqdm(
        total=cfg.train.max_steps, initial=start_step, desc="kd", disable=not (cfg.logger.progress_bar and dist.is_main)
    )
    profiler = step_profiler(cfg.profiler, out, device, dist.rank)
    meter.start_loop()
    with profiler:
        while step < cfg.train.max_steps:
            t_step = time.perf_counter()
            shares = sampler.rank_micro_batches(step, dist.rank, dist.world_size, d.micro_batch_size)
            micro = rollout.batches(step, [train_rows.batch(idx).to(device) for idx in shares])
            work = rollout.work(sum(int(train_rows.tokens[idx].sum()) for idx in shares))  # data: non-padding inputs
            meter.step(work.tokens, work.teacher_generated)
            stats = train_step(
                student, teacher.train, micro, optimizer, scheduler,
                loss_cfg=cfg.loss, max_grad_norm=o.max_grad_norm, dist=dist,
            )
            step += 1
            profiler.step()
            elapsed = time.perf_counter() - t_step
            bar.update(1)
            bar.set_postfix(loss=f"{stats.loss:.4f}", ce=f"{stats.ce:.4f}", kd=f"{stats.kd:.4f}")
            if step % cfg.train.log_every == 0:
                peaks = dist.gather_floats(peak_memory_mb(device))
                tokens = dist.gather_floats(float(work.tokens))
                training_s = elapsed - work.generation_s  # generation is timed apart (generation_s)
                metrics.log("train", step, {
                    **asdict(stats),
                    "tokens_per_s": sum(tokens) / training_s,
                    "tokens_per_s_per_rank": tokens[dist.rank] / training_s,
                    "step_s": elapsed,
                    "peak_mem_mb": max(peaks),
                    "peak_mem_mb_per_rank": peaks,
                    **rollout.report(elapsed),
                })
            pruned = False
            if step % cfg.train.eval_every == 0 and step < cfg.train.max_steps:
                ev = evaluate_now()
                metrics.log("eval", step, asdict(ev))
                pruned = dist.any(reporter.report(step, asdict(ev)))  # rank 0 decides (others hold a null reporter)
            preempted = dist.any(preemption is not None and preemption.requested)  # signals may reach ranks apart
            periodic = cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0
            if periodic or step == cfg.train.max_steps or pruned or preempted:
                checkpoints.save(
                    ckpt_root, step, student, optimizer,
                    {"step": step, "scheduler": scheduler.state_dict(), "eval_before": asdict(eval_before),
                     "fingerprint": training_fingerprint(cfg, data.cache_dir.name)},
                    dist, cfg.checkpoint.keep_last,
                )
                spent = meter.snapshot()
                if record is not None:
                    record.cost(spent)
            if pruned or preempted:
                status = "pruned" if pruned else "preempted"
                log.info("%s at step %d (checkpoint written)", status, step)
                break
    bar.close()
    if status == "preempted":
        metrics.close()
        return RunResult(
            objective=float("nan"), status=status, steps=step, eval_before=eval_before, eval_after=None,
            output_dir=str(out),
        )

    eval_after = evaluate_now()
    spent = meter.snapshot()
    if record is not None:
        record.cost(spent)
    metrics.log("eval", step, asdict(eval_after))
    if status == "completed":
        reporter.report(step, asdict(eval_after))
    metrics.close({"objective": eval_after.student_ce, "status": status, "steps": step,
                   **{f"eval/{k}": v for k, v in asdict(eval_after).items()}})
    log.info(
        "held-out CE after %d steps: student %.4f (before %.4f), teacher %.4f, KL %.4f",
        step, eval_after.student_ce, eval_before.student_ce, eval_after.teacher_ce, eval_after.kl,
    )
    exports: dict[str, str] = {}
    if status == "completed" and (cfg.checkpoint.export_adapter or cfg.checkpoint.export_merged):
        full = unsharded_on_rank0(student, student_dir, cfg.model, dtype, cfg.train.seed, dist)
        if full is not None:
            exports = exporting.export(
                full, tokenizer, out / "final",
                adapter=cfg.checkpoint.export_adapter, merged=cfg.checkpoint.export_merged,
            )
        dist.barrier()
    return RunResult(
        objective=eval_after.student_ce, status=status, steps=step, eval_before=eval_before,
        eval_after=eval_after, output_dir=str(out), exports=exports,
    )
