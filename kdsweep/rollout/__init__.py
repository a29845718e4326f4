"""On-policy and sequence-level distillation, behind one call: the loop asks ``rollout.batches(step, micro)`` for
every step's micro-batches and trains on what it gets.

:class:`OffPolicy` (``lmbda=0``, no ``seq_kd``: the null object) gives them back. :class:`Rollout` draws, per step
and by seed (the same draw on every rank), whether the student completes the step's prompts (probability ``lmbda``,
GKD's on-policy steps: the loss is the KD term on the generated tokens), else the teacher does (``seq_kd``) or the
data stays as it is, as TRL's GKDTrainer does. The completions replace each sample's last labelled span; the labels
cover the completion only. What it did is in ``stats`` (logged with the step), and what the step then trains on in
:meth:`work`: a generating step trains on its completions, generation timed apart.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kdsweep.config.schema import RolloutConfig, RunConfig
from kdsweep.data.batch import Batch
from kdsweep.distributed import DistEnv
from kdsweep.data.dataset import pad_id
from kdsweep.data.sampling import stream_seed
from kdsweep.distributed.fsdp import hf_model
from kdsweep.rollout.generate import complete
from kdsweep.rollout.prompts import completion_batch, empty_batch, prompts_of


@dataclass(frozen=True)
class StepWork:
    """What one rank's step trained on, for its throughput and the run's cost."""

    tokens: int
    """Tokens trained on: the data's non-padding tokens, or on a generating step the completions it generated."""
    teacher_generated: int = 0
    """Tokens the teacher generated (``seq_kd`` steps): teacher positions computed besides its forwards."""
    generation_s: float = 0.0
    """Seconds spent generating, apart from the step's training."""


class OffPolicy:
    """The data as it is: no step generates."""

    def batches(self, step: int, micro: list[Batch]) -> list[Batch]:
        return micro

    def work(self, data_tokens: int) -> StepWork:
        return StepWork(data_tokens)

    def report(self, step_s: float) -> dict[str, Any]:
        return {}


def stop_ids(model: nn.Module, tokenizer: Any) -> set[int]:
    """EOS, and whatever else the model's generation config ends a turn with (chat models' end-of-turn tokens)."""
    configured = getattr(getattr(hf_model(model), "generation_config", None), "eos_token_id", None)
    extra = configured if isinstance(configured, list) else [configured]
    return {tokenizer.eos_token_id, *(t for t in extra if t is not None)}


def step_source(r: RolloutConfig, step: int) -> str:
    """Who completes step ``step``'s prompts: student (with probability ``lmbda``), else teacher (``seq_kd``) or
    nobody (data). Seeded by the step: the same on every rank, and after a resume."""
    if random.Random(f"{r.seed}:{step}").random() < r.lmbda:
        return "student"
    return "teacher" if r.seq_kd else "data"


class Rollout:
    """Generated completions on the steps the seeded draw picks (see the module docstring)."""

    def __init__(self, cfg: RunConfig, student: nn.Module, teacher: nn.Module, tokenizer: Any, dist: DistEnv,
                 device: torch.device) -> None:
        self.cfg, self.r, self.dist, self.device = cfg, cfg.rollout, dist, device
        self.models = {"student": student, "teacher": teacher}
        self.pad_id = pad_id(tokenizer)
        self.stops = stop_ids(student, tokenizer)
        self.vocab = len(tokenizer)
        self.stats: dict[str, Any] = {}
        self.local_generated = 0

    def batches(self, step: int, micro: list[Batch]) -> list[Batch]:
        who = step_source(self.r, step)
        if who == "data":
            self.stats = {"rollout": "data"}
            return micro
        t0 = time.perf_counter()
        ignore, room = self.cfg.loss.ignore_index, self.cfg.data.seq_len + 1 - self.r.max_new_tokens
        out, made = [], []
        for batch in micro:
            prompts = prompts_of(batch, ignore, room)
            seeds = [stream_seed(self.r.seed, step, p.key) for p in prompts]
            completions = complete(self.models[who], [p.ids for p in prompts], seeds,
                                   max_new_tokens=self.r.max_new_tokens, temperature=self.r.temperature,
                                   top_p=self.r.top_p, stop_ids=self.stops, pad_id=self.pad_id, vocab=self.vocab,
                                   device=self.device, dist=self.dist)
            made += [(p.key, c) for p, c in zip(prompts, completions)]
            out.append(completion_batch(prompts, completions, pad_id=self.pad_id, ignore_index=ignore,
                                        own_samples=who == "student").to(self.device) if prompts
                       else empty_batch(batch, ignore, own_samples=who == "student"))
        seconds = time.perf_counter() - t0
        self.local_generated = sum(len(c) for _, c in made)
        everyone = [m for part in self.dist.gather_objects(made) for m in part]
        tokens = sum(len(c) for _, c in everyone)
        digest = hashlib.sha1(repr(sorted(everyone)).encode()).hexdigest()[:12]
        self.stats = {"rollout": who, "generated_tokens": tokens, "completions": len(everyone),
                      "mean_completion_len": tokens / max(len(everyone), 1), "generation_s": seconds,
                      "completions_digest": digest}
        return out

    def work(self, data_tokens: int) -> StepWork:
        """What this rank's last step trains on, ``data_tokens`` being its data's non-padding tokens."""
        who = self.stats["rollout"]
        if who == "data":
            return StepWork(data_tokens)
        return StepWork(self.local_generated, self.local_generated if who == "teacher" else 0,
                        self.stats["generation_s"])

    def report(self, step_s: float) -> dict[str, Any]:
        """What the last step's rollout did, for its metrics line (``step_s``: the whole step's seconds)."""
        share = {"generation_share": self.stats["generation_s"] / step_s} if "generation_s" in self.stats else {}
        return {**self.stats, **share}


def open_rollout(cfg: RunConfig, student: nn.Module, teacher: Any, tokenizer: Any, dist: DistEnv,
                 device: torch.device) -> OffPolicy | Rollout:
    """The job's rollout; ``teacher``: the job's :class:`~kdsweep.teacher.job.Teacher`, whose evaluations read the
    live teacher that generates (generation refuses a cache and several teachers, earlier); its training source may
    be teacher-free (``kd_ratio=0`` with ``seq_kd``: the student trains on the teacher's completions by CE alone)."""
    if not cfg.rollout.active:
        return OffPolicy()
    return Rollout(cfg, student, teacher.eval.model, tokenizer, dist, device)


__all__ = ["OffPolicy", "Rollout", "StepWork", "open_rollout", "step_source"]
