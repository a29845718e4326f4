"""Where the models come from: the student (``model``), the teacher (``teacher``, its logit cache) and several
teachers (``teachers``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kdsweep.config.base import _check


ZOO_NAMES = ("tiny-teacher", "tiny-student", "tiny-teacher-other")


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """Where a model comes from: a local HF directory (``path``) or the embedded tiny zoo (``zoo``)."""

    path: str | None = None
    """A local Hugging Face model directory (config.json + weights + tokenizer), or a hub id ``org/name`` (optionally
    ``org/name@revision``) read from the Hugging Face cache (kdsweep.hub). Wins over ``zoo``."""
    zoo: str | None = None
    """Name of an embedded tiny model built locally on first use: one of ZOO_NAMES."""

    def _validate(self, section: str) -> None:
        _check(
            self.path is not None or self.zoo is not None,
            f"{section}: neither {section}.path nor {section}.zoo is set; "
            f"pass {section}.path=/dir/of/an/hf/model or {section}=tiny",
        )
        if self.path is None:
            _check(
                self.zoo in ZOO_NAMES,
                f"{section}.zoo={self.zoo!r} is not an embedded model; use one of {', '.join(ZOO_NAMES)}",
            )


@dataclass(frozen=True, kw_only=True)
class StudentConfig(ModelSource):
    """The student: the model being trained, with LoRA or fully."""

    lora_rank: int = 8
    """LoRA rank; 0 means full fine-tuning (all weights trained). Set from the top-level knob ``lora_rank``."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / rank)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input during training."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """What receives LoRA adapters: presets that fit any architecture (``all-linear``: every linear layer but the
    output layer, as peft defines it; ``attention``; ``mlp``) and module names (``lm_head``, ``q_proj``), matched
    on the model before training (kdsweep.models.targets). A single string is a one-item list."""

    def __post_init__(self) -> None:
        self._validate("model")
        _check(
            self.lora_rank >= 0,
            f"model.lora_rank={self.lora_rank} is negative; use lora_rank=0 for full fine-tuning or a positive rank",
        )
        _check(self.lora_alpha > 0, f"model.lora_alpha={self.lora_alpha} must be > 0")
        _check(0.0 <= self.lora_dropout < 1.0, f"model.lora_dropout={self.lora_dropout} must be in [0, 1)")
        _check(
            self.lora_rank == 0 or len(self.target_modules) > 0,
            "model.target_modules is empty; pass model.target_modules=all-linear (or a list such as [q_proj,v_proj]) "
            "or set lora_rank=0",
        )


TEACHER_LOGITS = ("live", "cache")

CACHE_METHODS = ("full", "sample", "topk")

CACHE_ROWS = ("used", "all")


@dataclass(frozen=True, kw_only=True)
class TeacherCacheConfig:
    """The teacher-logit cache (``teacher.logits=cache``): what one teacher pass over the tokenized rows keeps, shared
    by every trial and rank that reads it (kdsweep.teacher.cache; kdsweep.losses.targets says what is exact)."""

    method: str = "sample"
    """full: every logit in the teacher's dtype (exact: any divergence, any temperature); sample: k tokens drawn per
    position from the teacher's distribution (an unbiased forward-KL gradient, RS-KD); topk: the k most likely tokens
    and the rest of the mass as one tail outcome (any divergence on k + 1 outcomes; biased unless the tail is empty)."""
    k: int = 12
    """Tokens kept per position by sample and topk (12 draws match full KD in the RS-KD paper)."""
    temperature: float | None = None
    """The temperature sample draws and topk log-probabilities are taken at; null means loss.temperature. Training
    at another temperature is refused for sample and topk (full keeps logits: any temperature)."""
    seed: int = 0
    """Seeds the draws of method=sample (each row has its own stream, so the cache does not depend on the ranks)."""
    rows: str = "used"
    """used: the training rows the run's steps read (train.max_steps × data.batch_size of them, in the order
    train.seed gives; the whole split from one epoch on), so a short trial on a large dataset pays only for what it
    reads, and every trial of a sweep with the same seed, batch and steps shares the cache; all: every training row
    (for a sweep over seeds or lengths). The held-out rows are always all cached."""
    dir: str | None = None
    """Where caches are built (default ``$KDSWEEP_CACHE/teacher``); shared by every trial and rank, like the data's."""

    def __post_init__(self) -> None:
        _check(self.method in CACHE_METHODS,
               f"teacher.cache.method={self.method} is unknown; use one of {', '.join(CACHE_METHODS)}")
        _check(self.k >= 1, f"teacher.cache.k={self.k} must be >= 1 (tokens kept per position)")
        _check(self.rows in CACHE_ROWS,
               f"teacher.cache.rows={self.rows} is unknown; use one of {', '.join(CACHE_ROWS)}")
        _check(self.temperature is None or self.temperature > 0,
               f"teacher.cache.temperature={self.temperature} must be > 0, or null for loss.temperature")


@dataclass(frozen=True, kw_only=True)
class TeacherConfig(ModelSource):
    """The teacher: frozen, in eval mode, never trained."""

    logits: str = "live"
    """live: the teacher runs on every micro-batch of every trial; cache: one teacher pass writes its targets once
    (``teacher.cache``) and every job reads them, never loading the teacher."""
    cache: TeacherCacheConfig = field(default_factory=TeacherCacheConfig)
    chat_template: str | None = None
    """The teacher's chat template (a Jinja template, or a ``.jinja`` file) instead of its tokenizer's own; read only
    for chat data with a teacher of another tokenizer, which reads each conversation in its own template
    (kdsweep.teacher.views). ``data.chat_template`` is the student's."""

    def __post_init__(self) -> None:
        self._validate("teacher")
        _check(self.logits in TEACHER_LOGITS,
               f"teacher.logits={self.logits} is unknown; use live (run the teacher) or cache (read a teacher pass)")


@dataclass(frozen=True, kw_only=True)
class TeacherMember(ModelSource):
    """One of several teachers (``teachers=[...]``): where it comes from and its weight; how its targets are had
    (``teacher.logits``, ``teacher.cache``) is the ``teacher`` section's, for each teacher (each its own cache)."""

    weight: float = 1.0
    """Its share of the KD term: the term is the weighted mean of the divergences to each teacher
    (kdsweep.losses.mixture); weights are normalised, so only their ratios count."""

    def __post_init__(self) -> None:
        self._validate("teachers[]")
