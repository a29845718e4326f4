"""A packed job: K trials trained in one process, in lockstep, over one frozen student base and one teacher pass.

Each member is a run as :func:`kdsweep.train.loop.run_steps` makes it (its own output directory, run.json, metrics,
evaluations, reporter, checkpoints and exports, in the solo format); this module only drives them: at each step one
:func:`~kdsweep.train.step.train_step` for every member still training, on the micro-batches they all asked for
(the members read the same rows in the same order: the knobs that shape the data stream are the pack's). The members
share the tokenized rows and a live teacher's weights (one :class:`~kdsweep.train.kept.Kept`), the student's frozen
base (:class:`~kdsweep.pack.members.OverOneBase`) and each micro-batch's targets (sources with the same
``share_key``). A member that ends (completed, pruned, preempted) or fails leaves; the others go on without it.

Growth: the base's and the teacher's memory once, plus per member its adapter, optimizer state and its step's
activations (a member's forward and backward run one after another, so the activations of one at a time); per step,
one teacher pass and K student passes.
"""

from __future__ import annotations

import contextvars
import logging
import math
import time
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kdsweep.config.schema import RunConfig
from kdsweep.distributed import DistEnv, single_process
from kdsweep.metrics.records import job_started
from kdsweep.pack.members import OverOneBase
from kdsweep.train.kept import Kept
from kdsweep.train.loop import NULL_REPORTER, Preemption, Reporter, RunResult, RunSteps, StepAsk, run_steps
from kdsweep.train.step import EvalAsk, evaluate_together, train_step

log = logging.getLogger(__name__)

KNOBS = ("model.lora_rank", "model.lora_alpha", "optim.lr", "optim.weight_decay", "optim.betas", "optim.eps",
         "optim.max_grad_norm", "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio", "loss.kd_ratio",
         "loss.divergence", "loss.temperature", "loss.beta")
"""The knobs a pack's members may search: each member sets its own."""

PER_MEMBER = ("output_dir", "trial", "logger", "checkpoint", "downstream", *KNOBS)
"""What a pack's members may set each their own (dotted config paths; a section's name: all of it): the knobs, and
where each writes, logs, exports and is scored. Everything else is the pack's: the data and its seed, the models, the
teachers, the steps and evaluations, the loss's chunking, the precision and the ranks."""


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if is_dataclass(value):
        return {k: v for f in fields(value) for k, v in _flat(getattr(value, f.name), f"{prefix}{f.name}.").items()}
    return {prefix.rstrip("."): value}


def _own(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") for p in PER_MEMBER)


def check_pack(cfgs: Sequence[RunConfig]) -> None:
    """One line (a ValueError) for a pack that cannot train together: members that differ in a knob the pack
    shares (the ranks and their layout among them), a full fine-tune, on-policy or sequence-level KD, two members in
    one output directory."""
    if not cfgs:
        raise ValueError("a pack needs at least one member")
    first = _flat(cfgs[0])
    for i, cfg in enumerate(cfgs):
        if cfg.model.lora_rank == 0:
            raise ValueError(f"pack member {i} has model.lora_rank=0: a full fine-tune trains the base the members "
                             "share; give it a LoRA rank, or run it unpacked")
        if cfg.rollout.active:
            raise ValueError(f"pack member {i} generates its own data (rollout.lmbda={cfg.rollout.lmbda:g}, "
                             f"rollout.seq_kd={cfg.rollout.seq_kd}): on-policy and sequence-level KD train on what "
                             "each student or the teacher writes, not one shared stream; run them unpacked")
        other = _flat(cfg)
        for path, value in other.items():
            if not _own(path) and value != first[path]:
                raise ValueError(f"pack member {i} sets {path}={value!r} and member 0 {path}={first[path]!r}: a "
                                 f"pack's members share it (each sets only its own {', '.join(KNOBS)}); set it the "
                                 "same for every member, or train them unpacked")
    dirs = [str(Path(cfg.output_dir).resolve()) for cfg in cfgs]
    if len(set(dirs)) != len(dirs):
        same = next(d for d in dirs if dirs.count(d) > 1)
        raise ValueError(f"two pack members write to output_dir={same}: give each member its own")


CURRENT: contextvars.ContextVar[int | None] = contextvars.ContextVar("pack_member", default=None)
"""The pack member whose run is running now (None: the pack's own work, such as its shared step)."""


def member_lines(index: int) -> Callable[[logging.LogRecord], bool]:
    """A logging filter for member ``index``'s own log: its run's lines and the pack's, not the other members'."""
    return lambda record: CURRENT.get() in (None, index)


class Member(OverOneBase):
    """The seat (:class:`~kdsweep.train.trial.Seat`) of every member of one pack: its student over the pack's base
    (:class:`~kdsweep.pack.members.OverOneBase`), and its share of the job's wall seconds: each second counts 1/n to
    each of the n members training then, so the members' device-seconds add up to the job's and one that left (ended,
    pruned, failed) pays for nothing after."""

    def __init__(self, members: int, started: float) -> None:
        super().__init__()
        self.training, self.shared, self.last = members, 0.0, started

    def _tally(self) -> float:
        now = time.time()
        self.shared += (now - self.last) / max(self.training, 1)
        self.last = now
        return self.shared

    def seconds(self, started: float) -> float:
        return self._tally()  # every member's meter counts from the job's start, as this does

    def leave(self) -> None:
        self._tally()
        self.training -= 1


def _same_rows(asks: Sequence[StepAsk | EvalAsk], first: int, i: int, what: str) -> None:
    a, b = (x.micro if isinstance(x, StepAsk) else x.batches for x in (asks[first], asks[i]))
    if len(a) != len(b) or not all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b)):
        raise RuntimeError(f"pack members {first} and {i} read different {what}: their data settings differ "
                           "(check_pack refuses that)")


def together(runs: Sequence[RunSteps], dist: DistEnv,
             left: Callable[[], None] = lambda: None) -> list[RunResult | BaseException]:
    """Drive runs in lockstep. The members waiting for an evaluation are scored first, together
    (:func:`~kdsweep.train.step.evaluate_together`: each held-out batch's targets made once for the members whose
    teachers share them); then one :func:`~kdsweep.train.step.train_step` for the members furthest behind (all of
    them, unless some resumed from later checkpoints), on the micro-batches the first of them asked for, every member
    sent its own stats. A member that ends or raises leaves (its error is its result: its run has recorded it), and
    so does one whose loss is not finite (its run records a FloatingPointError) or whose own forward or backward
    raised in the step (out of memory, say: its run records that error; the others' step is unchanged);
    ``left()`` is called as each leaves.
    An error of the pack's own (its shared step or evaluation, an interrupt) is thrown into every member still in it
    (each run records it), then raised."""
    results: list[RunResult | BaseException | None] = [None] * len(runs)
    asks: dict[int, StepAsk | EvalAsk] = {}

    def advance(i: int, how) -> None:
        token = CURRENT.set(i)  # what its run logs is its own (member_lines)
        try:
            asks[i] = how()
        except StopIteration as done:
            asks.pop(i, None)
            results[i] = done.value
            left()
        except Exception as e:  # noqa: BLE001 - the member's own failure, recorded in its run.json
            asks.pop(i, None)
            results[i] = e
            left()
            log.error("pack member %d failed: %s: %s", i, type(e).__name__, e, exc_info=e)
        finally:
            CURRENT.reset(token)

    try:
        for i, steps in enumerate(runs):  # each member's start (its sources, student, baseline), in turn
            advance(i, lambda steps=steps: next(steps))
        while asks:
            scoring: dict[tuple, list[int]] = {}
            for i, a in asks.items():
                if isinstance(a, EvalAsk):
                    scoring.setdefault((a.split, a.teacher.share_key), []).append(i)
            for (split, _), group in scoring.items():
                for i in group[1:]:
                    _same_rows(asks, group[0], i, f"{split} rows")
                scores = evaluate_together([asks[i] for i in group], dist=dist)
                for i, ev in zip(group, scores):
                    advance(i, lambda i=i, ev=ev: runs[i].send(ev))
            if scoring:
                continue
            behind = min(a.step for a in asks.values())
            now = [i for i, a in asks.items() if a.step == behind]
            lead = asks[now[0]]
            for i in now[1:]:
                _same_rows(asks, now[0], i, f"micro-batches at step {behind + 1}")
            stats = train_step([asks[i].learner for i in now], lead.micro, dist=dist, compute=lead.compute)
            for i, s in zip(now, stats):
                if isinstance(s, Exception):  # its own forward or backward failed (out of memory, say): it leaves
                    advance(i, lambda i=i, s=s: runs[i].throw(s))
                elif math.isfinite(s.loss):
                    advance(i, lambda i=i, s=s: runs[i].send(s))
                else:  # it leaves: the others no longer pay for its steps
                    advance(i, lambda i=i, s=s: runs[i].throw(FloatingPointError(
                        f"the loss is not finite at step {behind + 1} ({s.loss}): the member leaves the pack")))
    except BaseException as e:  # the pack's own (its step, an interrupt): every member still in it records it
        for i in list(asks):
            token = CURRENT.set(i)
            try:
                runs[i].throw(e)
            except BaseException:  # noqa: BLE001 - raised again below, once
                pass
            finally:
                CURRENT.reset(token)
        raise
    return results  # type: ignore[return-value]


def run_pack(
    cfgs: Sequence[RunConfig],
    *,
    reporters: Sequence[Reporter] | None = None,
    preemption: Preemption | None = None,
    dist: DistEnv | None = None,
    resolved_configs: Sequence[dict[str, Any] | None] | None = None,
    overrides: Sequence[list[str] | None] | None = None,
    kept: Kept | None = None,
) -> list[RunResult | BaseException]:
    """Train ``cfgs`` as one pack (:func:`check_pack` first); each member's result, or the error it failed with,
    in their order. ``reporters``: each member's (pruning is each member's own); ``kept``: a warm worker's (the
    members share what it keeps), else one for the pack."""
    dist = dist or single_process()
    check_pack(cfgs)
    n = len(cfgs)
    reporters = reporters or [NULL_REPORTER] * n
    resolved_configs, overrides = resolved_configs or [None] * n, overrides or [None] * n
    kept = kept if kept is not None and kept.keeps else Kept()  # a plain job's keeps nothing: the pack's shares
    seat = Member(n, job_started())
    log.info("pack of %d: %s", n, "; ".join(
        f"{cfg.output_dir} (kd_ratio {cfg.loss.kd_ratio:g}, lr {cfg.optim.lr:g}, rank {cfg.model.lora_rank})"
        for cfg in cfgs))
    # one progress bar and one profiler (torch profiles a thread once): the first member's
    cfgs = [cfg if i == 0 else replace(cfg, logger=replace(cfg.logger, progress_bar=False),
                                       profiler=replace(cfg.profiler, enabled=False)) for i, cfg in enumerate(cfgs)]
    if cfgs[0].model.lora_dropout > 0:
        log.warning("pack: model.lora_dropout=%g: the members draw their dropout masks in turn from one random "
                    "stream, so each trains with other masks than it would alone (set it to 0 for members equal to "
                    "their trials alone)", cfgs[0].model.lora_dropout)
    runs = [run_steps(cfg, reporter=r, preemption=preemption, dist=dist, resolved_config=rc, overrides=ov, kept=kept,
                      seat=seat) for cfg, r, rc, ov in zip(cfgs, reporters, resolved_configs, overrides)]
    return together(runs, dist, seat.leave)


__all__ = ["CURRENT", "KNOBS", "PER_MEMBER", "Member", "check_pack", "member_lines", "run_pack", "together"]
