"""The one optimizer step of a KD job, and the held-out evaluation."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Hashable, Sequence

import torch
from torch import nn

from kdsweep.config.schema import LossConfig
from kdsweep.data.batch import Batch
from kdsweep.distributed import DistEnv
from kdsweep.losses import LossSums, cross_entropy_sum, kd_loss_sums, log_probs, token_chunks
from kdsweep.losses.targets import Targets
from kdsweep.models.heads import final_hidden, frozen_projection
from kdsweep.teacher.source import TeacherSource
from kdsweep.train.chunked import chunked_loss_sums
from kdsweep.train.chunks import output_rows, pieces_for
from kdsweep.train.fused import fused_loss_sums


@dataclass(frozen=True)
class StepStats:
    """Token-weighted means over the whole optimizer step (all micro-batches of all ranks)."""

    loss: float
    ce: float
    kd: float
    kl: float
    """KL(teacher ‖ student) at temperature 1 (the KD term is T²·KL at the loss's temperature)."""
    tokens: int
    grad_norm: float
    lr: float


def micro_batch_backward(student: nn.Module, targets: Targets, batch: Batch, loss_cfg: LossConfig,
                         scale: torch.Tensor, compute: Callable[[], ContextManager] = contextlib.nullcontext,
                         chunks: int | None = None) -> LossSums:
    """Forward and backward of one micro-batch's loss (its sums times ``scale``); returns the sums, detached.

    ``targets``: the teacher's for this batch (from a live model or a cache: :mod:`kdsweep.teacher`; made by the
    step, once for every learner that trains on them, and held until their backwards are done). When the loss fits
    in one chunk (:mod:`kdsweep.train.chunks`) it is the plain graph: the student's logits, the whole loss, one
    backward. Otherwise ``loss.impl`` says how its chunks are made: from the full logits (chunked), or from the final
    hidden states through the output layer (fused: the B×T×V logits never exist); each chunk is differentiated at
    once, and the step's one backward runs the model's from what they kept. ``compute``: what the forwards and the
    loss run under (autocast), not the backward. ``chunks``: how many (the same on every rank, from the configured
    micro-batch: :meth:`~kdsweep.config.schema.RunConfig.loss_chunks`); None: from this batch's own size (one
    process)."""
    kw = {"divergence": loss_cfg.divergence, "beta": loss_cfg.beta, "temperature": loss_cfg.temperature,
          "ignore_index": loss_cfg.ignore_index}
    kd_ratio = batch.kd_weight(loss_cfg.kd_ratio)
    with compute():
        tokens, vocab = batch.labels.numel(), output_rows(student)
        chunks = loss_cfg.chunks_for(tokens, vocab) if chunks is None else chunks
        if chunks == 1:  # the plain graph (in cache-sized pieces on a CPU, still one graph)
            sums = kd_loss_sums(student(**batch.inputs()).logits, targets, batch.labels,  # no **kw: see chunked
                                num_chunks=pieces_for(batch.labels.device, tokens, vocab), once=True,
                                divergence=loss_cfg.divergence, beta=loss_cfg.beta,
                                temperature=loss_cfg.temperature, ignore_index=loss_cfg.ignore_index)
            mixed = sums.total(kd_ratio)
        elif loss_cfg.impl == "fused":
            sums, mixed = fused_loss_sums(student, batch.inputs(), targets, batch.labels, kd_ratio=kd_ratio,
                                          num_chunks=chunks, **kw)
        else:
            sums, mixed = chunked_loss_sums(student(**batch.inputs()).logits, targets, batch.labels,
                                            kd_ratio=kd_ratio, num_chunks=chunks, **kw)
    (mixed * scale).backward()
    return LossSums(*(t.detach() for t in sums))


def _eval_chunks(student: nn.Module, targets: Targets, batch: Batch, loss_cfg: LossConfig, chunks: int | None):
    """(student logits, teacher targets, labels) of each token chunk (``chunks``, as for :func:`micro_batch_backward`);
    with ``loss.impl=fused`` and more than one chunk, each student chunk is projected from the final hidden states on
    its own, so no B×T×V tensor exists."""
    y, vocab = batch.labels.reshape(-1), output_rows(student)
    chunks = loss_cfg.chunks_for(y.numel(), vocab) if chunks is None else chunks
    if chunks == 1 or loss_cfg.impl != "fused":
        chunks = pieces_for(y.device, y.numel(), vocab) if chunks == 1 else chunks
        s_logits = student(**batch.inputs()).logits
        for (s_c, y_c), t_c in token_chunks(targets, chunks, s_logits.reshape(-1, s_logits.shape[-1]), y):
            yield s_c, t_c, y_c
        return
    h_s = final_hidden(student, batch.inputs())
    with frozen_projection(student) as head_s:  # frozen here
        for (hs_c, y_c), t_c in token_chunks(targets, chunks, h_s.reshape(-1, h_s.shape[-1]), y):
            yield head_s(hs_c), t_c, y_c


@dataclass
class Learner:
    """One student trained by :func:`train_step`: what a trial owns of a step. Several learners in one step train on
    the same micro-batches (a packed job's members); each is exactly the trial it would be alone."""

    student: nn.Module
    teacher: TeacherSource
    """Where its targets come from in training: learners whose sources have the same ``share_key`` share each
    micro-batch's targets (made once, by the first one's source); a ``kd_ratio=0`` learner's gives none
    (:class:`~kdsweep.teacher.absent.TeacherFree`)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_cfg: LossConfig
    max_grad_norm: float
    """Clip its gradients' global norm to this (0: measured, not clipped)."""
    chunks: int | None = None
    """Its loss's chunks per micro-batch (:func:`micro_batch_backward`)."""


def train_step(
    learners: Sequence[Learner],
    micro_batches: list[Batch],
    *,
    dist: DistEnv,
    compute: Callable[[], ContextManager] = contextlib.nullcontext,
) -> list[StepStats | Exception]:
    """One optimizer step of each learner: accumulate its gradients over ``micro_batches``, clip, step its optimizer
    and schedule; its stats, in the learners' order.

    A learner whose own forward or backward raises (a pack's member out of memory, say) on one rank, while others
    train beside it, gets that error in place of its stats (its traceback dropped, so what its graph held is freed);
    its gradients are discarded, it takes no optimizer step, and the others' steps are what they would have been
    without it. Alone, on several ranks (where the ranks must agree on who steps), or in what the learners share (the
    targets, the token count), an error is raised.

    Every micro-batch's loss is a *sum* over its valid tokens divided by the valid tokens of the whole step on
    all ranks, so the gradient equals that of the token-mean loss of the global batch, however the batch is
    split over ranks and micro-batches. Gradient reduction across ranks averages (FSDP/DDP default); the
    ``world_size`` factor turns that average back into the sum the normalisation assumes. ``compute``: what the
    forwards and the losses run under (autocast to bf16 for an unsharded bf16 student); clipping and the optimizer
    steps run outside it. The micro-batches are the outer loop: each one's targets are made once per teacher source
    (sources with the same ``share_key`` are one), held while every learner that reads them runs its forward and
    backward, and let go before the next micro-batch's (so a step holds one micro-batch's targets, however many
    learners it trains). A learner's arithmetic is the same as alone: nothing it computes depends on the others."""
    ignores = sorted({learner.loss_cfg.ignore_index for learner in learners})
    if len(ignores) != 1:
        raise ValueError(f"learners of one step count the same tokens: loss.ignore_index differs ({ignores})")
    local_tokens = sum((b.labels != ignores[0]).sum() for b in micro_batches)
    global_tokens = dist.all_reduce_sum(torch.as_tensor(local_tokens, dtype=torch.float32).clone())
    scale = dist.world_size / global_tokens.clamp_min(1.0)
    totals = torch.zeros(len(learners), 3, dtype=torch.float32, device=global_tokens.device)  # Σce, Σkd, Σkl
    keys = [learner.teacher.share_key for learner in learners]
    sources = {}
    for key, learner in zip(keys, learners):
        sources.setdefault(key, learner.teacher)  # the first learner's source makes what its key's learners read
    for source in sources.values():
        source.prefetch(micro_batches)  # a cache reads each micro-batch's targets while the one before trains
    isolated = len(learners) > 1 and dist.world_size == 1
    failed: dict[int, Exception] = {}
    for batch in micro_batches:
        with contextlib.ExitStack() as held:
            given: dict[Hashable, Targets] = {}
            for i, (key, learner) in enumerate(zip(keys, learners)):
                if i in failed:
                    continue
                if key not in given:
                    with compute():  # a live teacher's forward runs here, once for the learners that share it
                        given[key] = held.enter_context(sources[key].targets(batch))
                try:
                    sums = micro_batch_backward(learner.student, given[key], batch, learner.loss_cfg, scale, compute,
                                                learner.chunks)
                except Exception as e:
                    if not isolated:
                        raise
                    failed[i] = e.with_traceback(None)
                    learner.optimizer.zero_grad(set_to_none=True)
                    continue
                totals[i] += torch.stack([sums.ce, sums.kd, sums.kl])
            given.clear()  # the batch's targets go now, not when the next batch's are made (two would be held)
    norms, lrs = [], []
    for i, learner in enumerate(learners):
        if i in failed:
            norms.append(torch.zeros(()))
            lrs.append(0.0)
            continue
        params = [p for p in learner.student.parameters() if p.requires_grad]
        # max_norm=inf measures the norm without clipping.
        norm = torch.nn.utils.clip_grad_norm_(params, learner.max_grad_norm if learner.max_grad_norm > 0 else math.inf)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: a DTensor norm
        lrs.append(learner.optimizer.param_groups[0]["lr"])
        learner.optimizer.step()
        learner.scheduler.step()
        learner.optimizer.zero_grad(set_to_none=True)
    dist.all_reduce_sum(totals)
    means = (totals / global_tokens.clamp_min(1.0)).tolist()  # host syncs only here, after the optimizer steps
    tokens, stats = int(global_tokens.item()), []
    for i, (learner, (ce, kd, kl), norm, lr) in enumerate(zip(learners, means, norms, lrs)):
        r = micro_batches[0].kd_weight(learner.loss_cfg.kd_ratio)  # a step's micro-batches: all data or generated
        stats.append(failed.get(i) or StepStats(loss=(1 - r) * ce + r * kd, ce=ce, kd=kd, kl=kl, tokens=tokens,
                                                grad_norm=float(norm), lr=lr))
    return stats


@dataclass(frozen=True)
class EvalResult:
    """Held-out, token-weighted means over all ranks."""

    student_ce: float
    """Student cross-entropy on the gold labels: the objective (independent of kd_ratio)."""
    kl: float
    """KL(teacher ‖ student) at temperature 1."""
    teacher_ce: float
    """Teacher cross-entropy on the gold labels: the floor distillation aims at."""
    tokens: int


@dataclass
class EvalAsk:
    """One student's held-out evaluation (:func:`evaluate`): what a run asks of whoever drives it at an evaluation,
    whose :class:`EvalResult` it is then sent. A driver may score several asks together (:func:`evaluate_together`:
    a pack's members) when their teachers share a key and their batches are the same rows."""

    student: nn.Module
    teacher: TeacherSource
    batches: list[Batch]
    loss_cfg: LossConfig
    chunks: int | None = None
    """The loss's chunks per batch (as for :func:`micro_batch_backward`)."""
    compute: Callable[[], ContextManager] = contextlib.nullcontext
    split: str = "eval"
    """Which held-out rows: ``eval`` (the objective's) or ``test``."""


def evaluate(
    student: nn.Module, teacher: TeacherSource, batches: list[Batch], *, loss_cfg: LossConfig, dist: DistEnv,
    chunks: int | None = None,
) -> EvalResult:
    """Student CE, KL(teacher‖student) and teacher CE on held-out batches; the student is left in train mode.

    Computed in chunks as the training step's are (``loss_cfg``'s impl; ``chunks`` as for :func:`micro_batch_backward`:
    the same on every rank, since a fused evaluation's projection is a collective), so evaluation never holds more
    fp32 logits than a training step does. The KL is at the targets' ``kl_temperature`` (1 for a live teacher or a
    full cache).
    """
    return evaluate_together([EvalAsk(student, teacher, batches, loss_cfg, chunks)], dist=dist)[0]


@torch.no_grad()
def evaluate_together(asks: Sequence[EvalAsk], *, dist: DistEnv) -> list[EvalResult]:
    """:func:`evaluate` of each ask's student, on the first ask's batches and teacher (the others' must be the same
    rows and give the same targets: the caller checks): each batch's targets are made once and held while every
    student is scored on them, so a pack's evaluation runs the teacher once, not once per member. Every student's
    arithmetic is what it is alone; one all-reduce carries all of their sums."""
    first = asks[0]
    for ask in asks:
        ask.student.eval()
    first.teacher.prefetch(first.batches)
    device = first.batches[0].labels.device if first.batches else torch.device("cpu")
    sums = torch.zeros(len(asks), 4, dtype=torch.float64, device=device)  # Σ student ce, Σ kl, Σ teacher ce, tokens
    with first.compute():
        for batch in first.batches:
            with first.teacher.targets(batch) as targets:
                for i, ask in enumerate(asks):
                    for s_c, t_c, y_c in _eval_chunks(ask.student, targets, batch, ask.loss_cfg, ask.chunks):
                        vocab = min(s_c.shape[-1], t_c.vocab)
                        s_c = s_c[..., :vocab]
                        valid = y_c != ask.loss_cfg.ignore_index
                        sums[i] += torch.stack([
                            cross_entropy_sum(s_c, y_c, ask.loss_cfg.ignore_index),
                            torch.where(valid, t_c.kl(log_probs(s_c, t_c.kl_temperature)), 0.0).sum(),
                            t_c.teacher_ce(y_c, vocab, ask.loss_cfg.ignore_index).sum(),
                            valid.sum().float(),
                        ]).double()
    for ask in asks:
        ask.student.train()
    dist.all_reduce_sum(sums)
    results = []
    for ce, kl, tce, n in sums.tolist():
        n_safe = max(n, 1.0)
        results.append(EvalResult(student_ce=ce / n_safe, kl=kl / n_safe, teacher_ce=tce / n_safe, tokens=int(n)))
    return results


__all__ = ["Batch", "EvalAsk", "EvalResult", "LossSums", "StepStats", "evaluate", "evaluate_together",
           "train_step"]
