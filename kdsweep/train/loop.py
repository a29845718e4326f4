"""``run(cfg)``: open what the run reads, build the trial, resume if possible, train, evaluate, checkpoint, export,
record. What the run reads (``train.sources``: the worker's side, which a warm worker keeps in part) and what the trial
owns (``train.trial``) are built apart; this module is the loop between them."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Generator, Protocol

import torch

from kdsweep.checkpoint import export as exporting
from kdsweep.checkpoint import steps as checkpoints
from kdsweep.config.schema import RunConfig
from kdsweep.data.dataset import load_data
from kdsweep.distributed import DistEnv, comm, device_for, failure, single_process
from kdsweep.distributed.waits import from_rank0
from kdsweep.evaluation import downstream
from kdsweep.metrics.records import RunRecord
from kdsweep.models.load import load_tokenizer, resolve_dir, unsharded_on_rank0
from kdsweep.models.precision import enable_tf32
from kdsweep.teacher.views import chat_view
from kdsweep.train.kept import Kept
from kdsweep.train.knobs import warn_idle_knobs
from kdsweep.train.profile import step_profiler
from kdsweep.train.resume import check_resumable, training_fingerprint
from kdsweep.train.sources import Sources, open_sources
from kdsweep.train.step import Batch, EvalAsk, EvalResult, Learner, StepStats, evaluate_together, train_step
from kdsweep.train.trial import ALONE, Seat, peak_memory_mb, reset_peak_memory, start_trial

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
    test_after: EvalResult | None = None
    """The test split's evaluation after training (``train.eval_test`` and completed; else None)."""
    downstream: dict[str, Any] = field(default_factory=dict)
    """``{task: {metric, value, stderr, higher_is_better, items}}`` of ``downstream.tasks`` on the trained student
    (completed runs)."""

    def evals(self, result: EvalResult | None) -> dict[str, Any] | None:
        """An evaluation as run.json keeps it: its metrics, and each downstream task's as ``lm_eval/<task>``."""
        return {**asdict(result), **downstream.values(self.downstream)} if result else None


def _deliver(cfg: RunConfig, student: torch.nn.Module, src: Sources, out: Path, dist: DistEnv,
             step: int, seat: Seat) -> tuple[dict[str, str], dict[str, Any]]:
    """A completed run's trained student: its exports (``checkpoint``), and its scores on ``downstream.tasks``
    (lm-eval on the merged student, written for them and removed after unless ``checkpoint.export_merged``)."""
    ckpt, tasks = cfg.checkpoint, bool(cfg.downstream.tasks)
    if not (ckpt.export_adapter or ckpt.export_merged or tasks):
        return {}, {}
    failure.doing("exporting the trained student")
    merging = ckpt.export_merged or tasks  # folds the adapter into the base: the student's own, not a pack's
    full = unsharded_on_rank0(seat.own(student) if merging else student, src.student_dir, cfg.model,
                              cfg.train.dtype, cfg.train.seed, dist)
    exports = from_rank0(dist, "export the trained student", lambda: exporting.export(  # peers wait outside collectives
        full, src.tokenizer, out / "final", adapter=ckpt.export_adapter, merged=merging))
    if not tasks:
        return exports, {}
    failure.doing(f"scoring {', '.join(cfg.downstream.tasks)} with lm-eval")
    scores, exports = from_rank0(dist, "score the downstream tasks", lambda: downstream.score(
        exports, cfg.downstream, keep_merged=ckpt.export_merged))
    log.info("downstream after %d steps: %s", step, ", ".join(
        f"{t} {s['metric']} {s['value']:.4f}" + (f" ± {s['stderr']:.4f}" if s["stderr"] is not None else "")
        for t, s in scores.items()))
    return exports, scores


def comm_record(in_steps: comm.Tally, whole: comm.Tally, steps: int) -> dict[str, Any]:
    """run.json's ``comm``: rank 0's collectives in this attempt's training steps (summed, and per step), and in the
    whole attempt (loading, evaluations and checkpoints too), by model and kind, in bytes per rank."""
    per_step = {owner: {kind: {k: v / max(steps, 1) for k, v in c.items()} for kind, c in kinds.items()}
                for owner, kinds in in_steps.record().items()}
    return {"steps": steps, "train": in_steps.record(), "per_step": per_step, "attempt": whole.record(),
            "bytes": "per rank, on the wire as ring collectives move them (see kdsweep.distributed.comm)"}


def prepare_data(cfg: RunConfig) -> None:
    """Build the run's tokenization cache here, before local ranks are spawned: a bad row is then one line from
    this process, and the ranks only memory-map the result."""
    student_dir = resolve_dir(cfg.model)
    tokenizer = load_tokenizer(student_dir)
    view = chat_view(cfg, tokenizer)
    load_data(cfg.data, tokenizer, student_dir, cfg.loss.ignore_index, view)


@dataclass
class StepAsk:
    """What a run asks of whoever drives it, at each training step: one optimizer step of its learner on these
    micro-batches (:func:`~kdsweep.train.step.train_step`), whose stats it is then sent."""

    learner: Learner
    micro: list[Batch]
    compute: Callable[[], ContextManager]
    step: int
    """The step about to be taken (0 for the first)."""


RunSteps = Generator[StepAsk | EvalAsk, StepStats | EvalResult, RunResult]
"""A run as its steps: :func:`run_steps` yields a :class:`StepAsk` per training step and an
:class:`~kdsweep.train.step.EvalAsk` per evaluation during and after training, and returns its result."""


def run(cfg: RunConfig, *, dist: DistEnv | None = None, **options: Any) -> RunResult:
    """Train the student against the teacher as ``cfg`` says; resumable from ``cfg.output_dir``. ``options``:
    :func:`run_steps`' (the reporter, the preemption watch, the resolved config and overrides run.json records, and
    ``kept``: what a warm worker keeps from its earlier trials; a fresh one for a plain job)."""
    dist = dist or single_process()
    return alone(run_steps(cfg, dist=dist, **options), dist)


def alone(steps: RunSteps, dist: DistEnv) -> RunResult:
    """Drive one run: each step it asks for is its own :func:`~kdsweep.train.step.train_step`, each evaluation its
    own :func:`~kdsweep.train.step.evaluate_together`; an error is thrown back into the run (which records it) and
    raised."""
    try:
        ask = next(steps)
        while True:
            try:
                if isinstance(ask, EvalAsk):
                    answer, = evaluate_together([ask], dist=dist)
                else:
                    answer, = train_step([ask.learner], ask.micro, dist=dist, compute=ask.compute)
            except BaseException as e:
                ask = steps.throw(e)
                continue
            ask = steps.send(answer)
    except StopIteration as done:
        return done.value


def run_steps(
    cfg: RunConfig,
    *,
    reporter: Reporter = NULL_REPORTER,
    preemption: Preemption | None = None,
    dist: DistEnv | None = None,
    resolved_config: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    kept: Kept | None = None,
    seat: Seat = ALONE,
) -> RunSteps:
    """:func:`run` as its steps, for a driver that takes them (:func:`alone`, or a pack's, which steps several runs
    together: :mod:`kdsweep.pack`). ``seat``: alone in its job, or a pack's member (its student over the pack's
    shared base, its share of the job's time)."""
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
        result = yield from _train(cfg, dist, reporter, preemption, out, record, resume_from, kept, seat)
    except BaseException as e:
        if record is not None:  # a collective that failed because a peer is gone is the job's lost rank, not the run's
            lost = failure.peer_lost(e)
            try:
                record.update(status="interrupted" if lost else "failed", wall_seconds=time.time() - started,
                              error=f"{'a peer rank was lost while ' + failure.DOING[0] + ': ' if lost else ''}"
                                    f"{type(e).__name__}: {e}")
            except OSError as unwritten:  # a full disk: the run's own error is what the job says
                log.error("run.json could not record the failure: %s", unwritten)
        raise
    if record is not None:
        record.update(
            status=result.status,
            objective=result.objective,
            steps=result.steps,
            eval_before=asdict(result.eval_before),
            eval_after=result.evals(result.eval_after),
            test_after=result.evals(result.test_after),
            exports=result.exports,
            **({"downstream": result.downstream} if result.downstream else {}),
            wall_seconds=time.time() - started,
        )
    return result


def _train(
    cfg: RunConfig, dist: DistEnv, reporter: Reporter, preemption: Preemption | None, out: Path,
    record: RunRecord | None, resume_from: Path | None, kept: Kept, seat: Seat,
) -> RunSteps:
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = device_for(cfg.train.device, dist)
    enable_tf32(cfg.train.tf32)
    reset_peak_memory(device)  # a warm worker's earlier trials count for nothing here
    comm_start = comm.TALLY.copy()
    torch.manual_seed(cfg.train.seed)
    warn_idle_knobs(cfg, dist)
    src = open_sources(cfg, dist, device, kept, record)
    trial = start_trial(cfg, dist, device, src, record, resume_from, out, seat)
    student, rollout, optimizer, scheduler, meter, metrics = (
        trial.student, trial.rollout, trial.optimizer, trial.scheduler, trial.meter, trial.metrics)
    eval_before, step = trial.eval_before, trial.start_step
    d, o, train_rows, sampler, teacher = cfg.data, cfg.optim, src.train_rows, src.sampler, src.teacher
    ckpt_root = out / "checkpoints"

    status = "completed"
    from tqdm import tqdm

    bar = tqdm(
        total=cfg.train.max_steps, initial=trial.start_step, desc="kd",
        disable=not (cfg.logger.progress_bar and dist.is_main),
    )
    profiler = step_profiler(cfg.profiler, out, device, dist.rank)
    reset_peak_memory(device)  # train rows' peak_mem_mb: the steps' (and evaluations'), not loading's transients
    meter.start_loop()
    in_steps = comm.Tally()  # what the training steps issued (the rest: loading, evaluations, checkpoints)
    evaluated: dict[int, EvalResult] = {}  # the loop's last evaluation, by step: a pruned trial is evaluated once
    learner = Learner(student, teacher.train, optimizer, scheduler, cfg.loss, o.max_grad_norm, trial.chunks)
    with profiler:
        while step < cfg.train.max_steps:
            failure.doing(f"training step {step + 1}")
            before = comm.TALLY.copy()  # bookkeeping outside the timed step
            t_step = time.perf_counter()
            shares = sampler.rank_micro_batches(step, dist.rank, dist.world_size, d.micro_batch_size)
            with trial.compute():  # on-policy generation is a forward too
                micro = rollout.batches(step, [train_rows.batch(idx).to(device) for idx in shares])
            work = rollout.work(sum(int(train_rows.tokens[idx].sum()) for idx in shares))  # data: non-padding
            meter.step(work.tokens, work.teacher_generated)
            stats = yield StepAsk(learner, micro, trial.compute, step)
            profiler.step()
            elapsed = time.perf_counter() - t_step
            step += 1
            step_comm = comm.TALLY.since(before)
            in_steps += step_comm
            failure.injected(dist.rank, step, out)
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
                    **step_comm.row(),  # this rank's collectives of the step, bytes by model and kind
                })
            pruned = False
            if step % cfg.train.eval_every == 0 and step < cfg.train.max_steps:
                failure.doing(f"evaluating after step {step}")
                ev = yield trial.held_out()
                evaluated = {step: ev}
                metrics.log("eval", step, asdict(ev))
                pruned = dist.any(reporter.report(step, asdict(ev)))  # rank 0 decides (others hold a null reporter)
            preempted = dist.any(preemption is not None and preemption.requested)  # signals may reach ranks apart
            periodic = cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0
            if periodic or step == cfg.train.max_steps or pruned or preempted:
                failure.doing(f"writing the checkpoint of step {step}")
                checkpoints.save(
                    ckpt_root, step, student, optimizer,
                    {"step": step, "scheduler": scheduler.state_dict(), "eval_before": asdict(eval_before),
                     "fingerprint": training_fingerprint(cfg, src.data.cache_dir.name)},
                    dist, cfg.checkpoint.keep_last,
                )
                spent = meter.snapshot()
                if record is not None:
                    record.cost(spent)
                    record.update(comm=comm_record(in_steps, comm.TALLY.since(comm_start), step - trial.start_step))
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

    failure.doing(f"evaluating after step {step}")
    eval_after = evaluated[step] if step in evaluated else (yield trial.held_out())  # pruned: the one that pruned it
    spent = meter.snapshot()
    if record is not None:
        record.cost(spent)
        record.update(comm=comm_record(in_steps, comm.TALLY.since(comm_start), step - trial.start_step))
    if step not in evaluated:
        metrics.log("eval", step, asdict(eval_after))
    if status == "completed":
        reporter.report(step, asdict(eval_after))
    test_after = None
    if cfg.train.eval_test and status == "completed":
        failure.doing("evaluating the test split")
        test_after = yield trial.test()
        log.info("test-split CE after %d steps: student %.4f, teacher %.4f, KL %.4f (%d tokens)",
                 step, test_after.student_ce, test_after.teacher_ce, test_after.kl, test_after.tokens)
    log.info(
        "held-out CE after %d steps: student %.4f (before %.4f), teacher %.4f, KL %.4f",
        step, eval_after.student_ce, eval_before.student_ce, eval_after.teacher_ce, eval_after.kl,
    )
    exports, scores = _deliver(cfg, student, src, out, dist, step, seat) if status == "completed" else ({}, {})
    if scores and record is not None:  # scoring is the trial's device time too (a sweep's budget counts it)
        record.cost(meter.snapshot())
    metrics.close({"objective": eval_after.student_ce, "status": status, "steps": step,
                   **{f"eval/{k}": v for k, v in asdict(eval_after).items()},
                   **{f"test/{k}": v for k, v in (asdict(test_after) if test_after else {}).items()},
                   **downstream.values(scores)})  # lm_eval/<task>, as eval_after names it
    return RunResult(
        objective=eval_after.student_ce, status=status, steps=step, eval_before=eval_before,
        eval_after=eval_after, output_dir=str(out), exports=exports, test_after=test_after, downstream=scores,
    )
