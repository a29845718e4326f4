"""Typed, validated configuration of one kdsweep run.

Pure Python: no torch, hydra or omegaconf here, so composing and validating many sweep points stays instant.
Every dataclass is keyword-only and checks itself in ``__post_init__``; every error is a :class:`ConfigError`
whose message names the field and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


class ConfigError(ValueError):
    """A user error in the configuration: one line naming the field and the fix."""


class RanksFailed(RuntimeError):
    """A rank of a job of several failed and its peers were ended: the message is the job's one line (from the
    ranks' failure records, ``distributed.failure``); ``config_error`` when it was bad input (exit code 2)."""

    def __init__(self, line: str, config_error: bool = False) -> None:
        super().__init__(line)
        self.config_error = config_error


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


ZOO_NAMES = ("tiny-teacher", "tiny-student", "tiny-teacher-other")
DIVERGENCES = ("forward_kl",)
SCHEDULES = ("cosine", "linear", "constant")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("fp32", "bf16", "bf16_pure")
TEACHER_PLACEMENTS = ("auto", "replicate", "node", "world")
STUDENT_MESHES = ("fsdp", "hsdp")


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
        _check(self.rows in CACHE_ROWS, f"teacher.cache.rows={self.rows} is unknown; use one of {', '.join(CACHE_ROWS)}")
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


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """One local data source (kdsweep.data.sources reads it) and how its rows become samples (kdsweep.data.formats)."""

    path: str
    """A ``.jsonl``/``.json``/``.parquet``/``.csv``/``.tsv`` file, a ``.txt`` file (one document per line), a folder
    saved by ``datasets``' ``save_to_disk``, a folder of text files (one document each) or of data-file shards."""
    format: str = "text"
    """One of :data:`FORMATS`: ``text``, ``instruction`` (alpaca-style columns) or ``chat`` (a list of messages)."""
    weight: float = 1.0
    """Share of the mix when ``data.mix=weighted`` (weights are normalized; proportions count samples)."""
    split: str | None = None
    """The split of a ``DatasetDict`` folder (default: train)."""
    text_column: str = "text"
    instruction_column: str = "instruction"
    input_column: str | None = "input"
    """The optional input column of an instruction row; null when the dataset has none."""
    output_column: str = "output"
    messages_column: str = "messages"


FORMATS = ("text", "instruction", "chat")
MIXES = ("concat", "weighted")
SEQUENCES = ("stream", "pack", "pad")
TRUNCATIONS = ("truncate", "drop")
PACK_STRATEGIES = ("best_fit", "sequential")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What a run trains and evaluates on, and how samples become sequences (kdsweep.data.dataset)."""

    datasets: tuple[DatasetConfig, ...] = ()
    """Training sources; empty means the embedded corpus that ships with kdsweep (format text)."""
    eval_datasets: tuple[DatasetConfig, ...] = ()
    """Held-out sources; empty means a seeded ``eval_fraction`` of every training source is held out."""
    eval_fraction: float = 0.05
    """Fraction of each training source's rows held out for evaluation when no ``eval_datasets`` are given."""
    test_datasets: tuple[DatasetConfig, ...] = ()
    """Test sources: rows no search selects on (the sweep's confirmation scores its verdict on them); empty means a
    seeded ``test_fraction`` of every training source, when that is above 0."""
    test_fraction: float = 0.0
    """Fraction of each training source's rows held out as the test split (taken after the eval rows, which it leaves
    as they are; the training rows lose it): evaluated once after training under ``train.eval_test``. The shipped
    searches set 0.05; 0 with no ``test_datasets``: no test split."""
    split_seed: int = 1234
    """Seed of the held-out splits and of the mix; separate from ``train.seed`` so a seed sweep keeps its data."""
    mix: str = "concat"
    """``concat``: every sample of every source once; ``weighted``: sources drawn in proportion to their weights
    (up- or down-sampled, seeded) into ``mix_samples`` samples."""
    mix_samples: int = 0
    """Size of a weighted mix in samples (0 = as many as the sources hold together)."""
    sequences: str = "stream"
    """How samples become rows: ``stream`` (text only: documents joined with EOS and cut into ``seq_len`` windows),
    ``pack`` (whole samples packed into ``seq_len`` rows, no attention across documents) or ``pad`` (one sample
    per row, each micro-batch padded to its longest)."""
    truncation: str = "truncate"
    """Samples longer than ``seq_len`` (pack, pad): ``truncate`` them or ``drop`` them; both are counted."""
    pack_strategy: str = "best_fit"
    """``best_fit`` (longest first, into the fullest row that holds it) or ``sequential`` (in order)."""
    train_on_prompt: bool = False
    """Train on prompt tokens too (instruction prompts, non-assistant chat turns); by default they are masked."""
    chat_template: str | None = None
    """A Jinja chat template (or a path to a ``.jinja`` file) used instead of the tokenizer's own."""
    add_bos: bool = False
    """Prepend the tokenizer's BOS token to text and instruction samples (chat templates write their own)."""
    cache_dir: str | None = None
    """Where tokenized data is cached (default ``$KDSWEEP_CACHE/data``); shared by every trial and rank."""
    seq_len: int = 128
    """Tokens per training row."""
    batch_size: int = 16
    """Rows per optimizer step, over all ranks and micro-batches (the global batch)."""
    micro_batch_size: int = 8
    """Rows per forward/backward on one rank; gradients accumulate over ``batch_size / micro_batch_size``."""
    eval_batch_size: int = 16
    """Rows per forward during evaluation."""
    max_eval_sequences: int = 0
    """Evaluate on at most this many rows of the eval split, and of the test split (0 = all of them)."""

    def __post_init__(self) -> None:
        _check(self.seq_len >= 2, f"data.seq_len={self.seq_len} must be >= 2")
        _check(self.batch_size >= 1, f"data.batch_size={self.batch_size} must be >= 1")
        _check(self.micro_batch_size >= 1, f"data.micro_batch_size={self.micro_batch_size} must be >= 1")
        _check(
            self.batch_size % self.micro_batch_size == 0,
            f"data.batch_size={self.batch_size} is not a multiple of data.micro_batch_size={self.micro_batch_size}; "
            "choose a micro_batch_size that divides the batch_size",
        )
        _check(self.eval_batch_size >= 1, f"data.eval_batch_size={self.eval_batch_size} must be >= 1")
        _check(self.max_eval_sequences >= 0, f"data.max_eval_sequences={self.max_eval_sequences} must be >= 0")
        _check(
            0.0 <= self.eval_fraction < 1.0,
            f"data.eval_fraction={self.eval_fraction} must be in [0, 1); it is the held-out share of each source",
        )
        _check(
            bool(self.eval_datasets) or self.eval_fraction > 0,
            "data has no eval split: set data.eval_datasets=[...] or data.eval_fraction to a value in (0, 1)",
        )
        held = (0.0 if self.eval_datasets else self.eval_fraction) + (0.0 if self.test_datasets else self.test_fraction)
        _check(
            0.0 <= self.test_fraction < 1.0 and held < 1.0,
            f"data.test_fraction={self.test_fraction} must be in [0, 1) and leave training rows beside "
            f"data.eval_fraction={self.eval_fraction}; e.g. data.test_fraction=0.05",
        )
        for knob, value, allowed in (("mix", self.mix, MIXES), ("sequences", self.sequences, SEQUENCES),
                                     ("truncation", self.truncation, TRUNCATIONS),
                                     ("pack_strategy", self.pack_strategy, PACK_STRATEGIES)):
            _check(value in allowed, f"data.{knob}={value} is unknown; use one of {', '.join(allowed)}")
        _check(self.mix_samples >= 0, f"data.mix_samples={self.mix_samples} must be >= 0 (0 = the sources' size)")
        for key in ("datasets", "eval_datasets", "test_datasets"):
            for i, ds in enumerate(getattr(self, key)):
                where = f"data.{key}[{i}]"
                _check(ds.format in FORMATS, f"{where}.format={ds.format} is an unknown data format; use one of "
                       f"{', '.join(FORMATS)}")
                _check(ds.weight >= 0 and ds.weight < float("inf"), f"{where}.weight={ds.weight} must be a finite "
                       "number >= 0")
                _check(self.sequences != "stream" or ds.format == "text",
                       f"data.sequences=stream joins plain text, but {where} has format {ds.format}; "
                       "use data.sequences=pack or data.sequences=pad")
        if self.mix == "weighted" and self.datasets:
            _check(sum(ds.weight for ds in self.datasets) > 0,
                   f"data.datasets weights sum to {sum(ds.weight for ds in self.datasets)}; give at least one "
                   "dataset a positive weight")

    @property
    def has_test(self) -> bool:
        """Whether the data has a test split."""
        return bool(self.test_datasets) or self.test_fraction > 0


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """``loss = (1-kd_ratio)·CE(student, labels) + kd_ratio·f(T)·D(teacher_T, student_T)``, f(T) = T² (T for tvd).

    D is one of :attr:`DIVERGENCES` (kdsweep.losses.divergences documents each formula and the temperature factor).
    """

    DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "jsd_normalized", "tvd", "symmetric")
    """Allowed ``divergence`` values (the same tuple as ``kdsweep.losses.DIVERGENCES``; a test keeps them equal)."""
    IMPLS = ("auto", "dense", "chunked", "fused")
    """Allowed ``impl`` values."""
    CROSS_TOKENIZER = ("gold", "uld")
    """Allowed ``cross_tokenizer`` values (kdsweep.losses.cross_tokenizer.CROSS_TOKENIZER_LOSSES)."""

    kd_ratio: float = 0.5
    """Weight of the distillation term; set from the top-level knob ``kd_ratio``."""
    temperature: float = 1.0
    """Softmax temperature T applied to both teacher and student logits in the KD term."""
    divergence: str = "forward_kl"
    """Divergence D between teacher T and student S: forward_kl KL(T‖S), reverse_kl KL(S‖T), jsd (generalised
    Jensen-Shannon JSD(β)), jsd_normalized JSD(β)/(β(1-β)), tvd (total variation),
    symmetric (1-β)·KL(T‖S) + β·KL(S‖T)."""
    beta: float = 0.5
    """β in [0, 1] of jsd (the teacher's weight in the mixture), jsd_normalized and symmetric (0 = forward-KL end,
    1 = reverse-KL end); unused by the other divergences."""
    impl: str = "auto"
    """How the loss is computed when it does not fit in one chunk (``chunk_mb``). chunked: from the student's full
    logits, the loss in token chunks, each differentiated at once (one chunk's fp32 temporaries at a time, beside the
    logits and their gradient); fused: from the final hidden states, each chunk projected by the output layers and
    differentiated at once, so neither model's B×T×V logits ever exist; dense: one chunk whatever its size. When one
    chunk fits, every impl runs the plain graph (full logits, the whole loss, one backward). Same values and
    gradients (to fp32 rounding) either way. auto: fused, unless the student or a live teacher applies a transform to
    its logits after its output layer (Gemma 2's soft-capping, Cohere's logit scale), which only the logits paths
    can: then chunked. Resolved once before launch (kdsweep.models.check.choose_impl; run.json records the choice); a
    config built in code and never validated trains auto as chunked."""
    chunk_mb: float = 128.0
    """The most MiB one ``[chunk, V]`` fp32 buffer of the loss may take (V: the student's vocabulary): a micro-batch
    of N tokens is split into ceil(N·V·4 B / chunk_mb) token chunks (kdsweep.train.chunks), so memory, not a count,
    decides. 128 keeps 2,048 tokens at Llama-3's 128k vocabulary in 8 chunks, and a small model's whole loss in one
    (the plain graph: no chunk machinery at all). On a GPU with memory to spare a larger value means fewer, larger
    chunks."""
    ignore_index: int = -100
    """Label value excluded from every loss term and token count."""
    cross_tokenizer: str = "gold"
    """The KD term when the teacher's tokenizer is not the student's (read only then; kdsweep.losses.cross_tokenizer):
    both read the same text, grouped into spans of the same characters, one term per span. gold: the divergence
    above over the tokens both vocabularies share (and one outcome for the others), plus ULD over the tokens they
    do not share (GOLD); uld: ULD alone (sorted probabilities, no vocabulary mapping)."""
    gold_matched_weight: float | None = None
    """gold's weight of the shared-token divergence; None (with ``gold_unmatched_weight`` None): GOLD's, the shared
    tokens' share of the teacher's vocabulary."""
    gold_unmatched_weight: float | None = None
    """gold's weight of ULD over the tokens the vocabularies do not share; None: 1 − the matched weight."""

    def chunks_for(self, tokens: int, vocab: int) -> int:
        """The token chunks of a micro-batch of ``tokens`` tokens over a vocabulary of ``vocab`` (the student's output
        rows): ceil(tokens·vocab·4 B / chunk_mb), one for ``impl=dense`` (kdsweep.train.chunks says why)."""
        if self.impl == "dense":
            return 1
        return max(1, math.ceil(tokens * vocab * 4 / (self.chunk_mb * 2**20)))

    def __post_init__(self) -> None:
        _check(
            0.0 <= self.kd_ratio <= 1.0,
            f"loss.kd_ratio={self.kd_ratio} is outside [0, 1]; pass kd_ratio=<value in [0, 1]> "
            "(0 = pure cross-entropy, 1 = pure distillation)",
        )
        _check(
            self.temperature > 0,
            f"loss.temperature={self.temperature} must be > 0; pass loss.temperature=1.0 (or another positive value)",
        )
        _check(
            self.divergence in self.DIVERGENCES,
            f"loss.divergence={self.divergence!r} is unknown; use one of {', '.join(self.DIVERGENCES)}",
        )
        _check(
            0.0 <= self.beta <= 1.0,
            f"loss.beta={self.beta} is outside [0, 1]; pass loss.beta=<value in [0, 1]> "
            "(0 = forward-KL end, 1 = reverse-KL end of jsd_normalized and symmetric)",
        )
        _check(
            self.impl in self.IMPLS,
            f"loss.impl={self.impl!r} is unknown; use one of {', '.join(self.IMPLS)}",
        )
        _check(self.chunk_mb > 0, f"loss.chunk_mb={self.chunk_mb} must be > 0 (MiB of one [chunk, vocabulary] fp32 "
               "buffer); pass loss.chunk_mb=128")
        _check(self.cross_tokenizer in self.CROSS_TOKENIZER,
               f"loss.cross_tokenizer={self.cross_tokenizer!r} is unknown; use one of {', '.join(self.CROSS_TOKENIZER)}")
        weights = (self.gold_matched_weight, self.gold_unmatched_weight)
        _check(weights == (None, None) or (None not in weights and min(weights) >= 0 and sum(weights) > 0),
               f"loss.gold_matched_weight={weights[0]} and loss.gold_unmatched_weight={weights[1]}: give both, each "
               ">= 0 and not both 0, or neither (GOLD's weights)")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup and a decaying schedule."""

    lr: float = 3e-4
    """Peak learning rate; set from the top-level knob ``lr``."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``lr`` over this many optimizer steps."""
    schedule: str = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    min_lr_ratio: float = 0.0
    """The decay ends at ``lr * min_lr_ratio``."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"optim.lr={self.lr} must be > 0; pass lr=<positive value> such as lr=3e-4")
        _check(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas={list(self.betas)} must be two values in [0, 1)",
        )
        _check(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _check(self.max_grad_norm >= 0, f"optim.max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables)")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _check(
            self.schedule in SCHEDULES,
            f"optim.schedule={self.schedule!r} is unknown; use one of {', '.join(SCHEDULES)}",
        )
        _check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The loop: how long, how often to evaluate, where to run."""

    max_steps: int = 60
    """Optimizer steps to train."""
    eval_every: int = 20
    """Evaluate every this many steps (and always before the first and after the last step)."""
    log_every: int = 1
    """Write a metrics row every this many steps."""
    seed: int = 0
    """Seeds LoRA init, data order and dropout."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    dtype: str = "fp32"
    """Precision. ``fp32``: everything in fp32. ``bf16``: bf16 compute with fp32 master weights, fp32 gradients
    and fp32 AdamW state for every trainable parameter (full fine-tune and LoRA alike; on one rank through autocast,
    on many through FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), frozen weights (the
    teacher, a LoRA student's base) in bf16 with no fp32 copy. ``bf16_pure``: trainable weights and optimizer state
    in bf16 too (updates below bf16's resolution, ~0.4% of a weight, are lost: warned for a full fine-tune). fp16 has
    no loss scaling here and is refused."""
    tf32: bool = True
    """TF32 tensor cores for fp32 matmuls on CUDA (Ampere and later); no effect on CPU."""
    threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    eval_test: bool = False
    """Evaluate the test split (``data.test_fraction`` or ``data.test_datasets``) once after training (run.json's
    ``test_after``); the sweep's confirmation trials set it, the search's never do."""

    def __post_init__(self) -> None:
        _check(self.max_steps >= 1, f"train.max_steps={self.max_steps} must be >= 1")
        _check(self.eval_every >= 1, f"train.eval_every={self.eval_every} must be >= 1")
        _check(self.log_every >= 1, f"train.log_every={self.log_every} must be >= 1")
        _check(self.device in DEVICES, f"train.device={self.device!r} is unknown; use one of {', '.join(DEVICES)}")
        _check(
            self.dtype in DTYPES,
            f"train.dtype={self.dtype!r} is not supported; use fp32, bf16 (bf16 compute, fp32 master weights) or "
            "bf16_pure (fp16 needs loss scaling kdsweep does not do)",
        )
        _check(self.threads >= 0, f"train.threads={self.threads} must be >= 0")


WANDB_MODES = ("auto", "online", "offline")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """Weights & Biases. Keys come from the environment (WANDB_API_KEY or ~/.netrc), never from the config."""

    enabled: bool = False
    project: str = "kdsweep"
    entity: str | None = None
    mode: str = "auto"
    """auto: online with an API key and a reachable server, else offline (``wandb sync`` later); or force one."""
    group: str | None = None
    """Runs are grouped by this; default: the study of a sweep trial, else none."""
    tags: tuple[str, ...] = ()
    """Extra tags; the teacher and the student are always tagged."""

    def __post_init__(self) -> None:
        _check(self.mode in WANDB_MODES, f"logger.wandb.mode={self.mode!r} is unknown; use one of {', '.join(WANDB_MODES)}")
        _check(bool(self.project), "logger.wandb.project is empty; name a W&B project")


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """Where metrics go (rank 0 only). JSONL is always written; TensorBoard and W&B when enabled."""

    progress_bar: bool = True
    """Show a progress bar with the live loss on rank 0."""
    tensorboard: bool = False
    """Write TensorBoard event files to ``<run dir>/tensorboard``."""
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """torch.profiler over a few training steps; off by default (and then it costs nothing)."""

    enabled: bool = False
    wait: int = 1
    """Steps to skip before profiling (the first steps pay one-off costs)."""
    warmup: int = 1
    """Steps traced but discarded (the profiler's own start-up)."""
    active: int = 3
    """Steps recorded into the trace."""
    record_shapes: bool = False
    """Each op's input shapes in the trace."""
    with_stack: bool = False
    """Each op's Python stack, and every Python function the traced steps call (``python_function`` events)."""

    def __post_init__(self) -> None:
        _check(self.wait >= 0 and self.warmup >= 0, f"profiler.wait={self.wait} and profiler.warmup={self.warmup} must be >= 0")
        _check(self.active >= 1, f"profiler.active={self.active} must be >= 1 (steps recorded)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Step checkpoints for resuming, and the final exports."""

    save_every: int = 20
    """Write a step checkpoint every this many optimizer steps (0 disables step checkpoints)."""
    keep_last: int = 2
    """Keep this many step checkpoints; older ones are deleted once a newer one is complete."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the output directory, if there is one."""
    export_adapter: bool = True
    """Save the peft adapter at the end (LoRA runs)."""
    export_merged: bool = True
    """Save the merged HF model (adapter folded into the base) at the end, in its own directory."""

    def __post_init__(self) -> None:
        _check(self.save_every >= 0, f"checkpoint.save_every={self.save_every} must be >= 0 (0 disables)")
        _check(self.keep_last >= 1, f"checkpoint.keep_last={self.keep_last} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    """How many ranks a job has and how the models are sharded over them (FSDP2)."""

    nproc_per_node: int = 1
    """Local ranks to spawn for a job started by hand (torch's elastic launcher). Under torchrun or SLURM the
    launcher decides the ranks and this is ignored."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of locally spawned ranks (torchrun and SLURM bring their own)."""
    master_port: int = 0
    """Rendezvous port of locally spawned ranks; 0 picks a free one."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each forward (FSDP2 FULL_SHARD); false keeps them until backward (SHARD_GRAD_OP)."""
    teacher_placement: str = "auto"
    """Where each frozen teacher's weights live on several ranks. ``replicate``: a whole copy on every rank (no
    collective for the teacher in a step). ``node``: sharded within each node, replicated across nodes (a 2-D
    device mesh: its all-gathers never leave the node). ``world``: sharded over every rank (each micro-batch
    all-gathers the whole teacher across the job). ``auto``: ``replicate`` when the teacher's weights in their dtype,
    beside the student's share and the teachers already replicated, fit ``1 - memory_headroom`` of the rank's
    ``device_memory_gb``, else ``node``. The teacher cache's build places its teacher the same way."""
    student_mesh: str = "fsdp"
    """How the student is sharded on several ranks: ``fsdp`` over every rank, or ``hsdp`` within each node and
    replicated across nodes (gradients reduce-scattered in the node, then all-reduced across nodes), as torchtitan
    does for multi-node data parallelism. With one node both are the same."""
    device_memory_gb: float = 0.0
    """The memory budget of one rank's device that ``teacher_placement=auto`` plans against, in GB (1e9 bytes);
    0 = the device's own (a GPU's total memory; on CPU the host's memory divided by its local ranks)."""
    memory_headroom: float = 0.25
    """Share of ``device_memory_gb`` kept free of weights and optimizer state for activations, the loss's chunk
    buffers and the allocator, when ``teacher_placement=auto`` decides."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy)."""
    compile: bool = False
    """torch.compile each decoder layer (slow first step; pays off at real sizes on GPUs)."""
    timeout_s: int = 600
    """Collective timeout: a rank that waits this long for the others fails the job instead of hanging."""

    def __post_init__(self) -> None:
        _check(self.nproc_per_node >= 1, f"dist.nproc_per_node={self.nproc_per_node} must be >= 1")
        _check(0 <= self.master_port < 65536, f"dist.master_port={self.master_port} must be in [0, 65535] (0 = any free port)")
        _check(bool(self.master_addr), "dist.master_addr is empty; pass dist.master_addr=127.0.0.1 for local ranks")
        _check(self.timeout_s > 0, f"dist.timeout_s={self.timeout_s} must be > 0")
        _check(self.teacher_placement in TEACHER_PLACEMENTS, f"dist.teacher_placement={self.teacher_placement!r} is "
               f"unknown; use one of {', '.join(TEACHER_PLACEMENTS)}")
        _check(self.student_mesh in STUDENT_MESHES, f"dist.student_mesh={self.student_mesh!r} is unknown; use one "
               f"of {', '.join(STUDENT_MESHES)}")
        _check(self.device_memory_gb >= 0, f"dist.device_memory_gb={self.device_memory_gb} must be >= 0 "
               "(0 = the device's own memory)")
        _check(0 <= self.memory_headroom < 1, f"dist.memory_headroom={self.memory_headroom} must be in [0, 1); "
               "pass dist.memory_headroom=0.25")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """On-policy and sequence-level distillation (kdsweep.rollout): which steps train on completions generated
    during the run instead of the data's own, as GKD (Agarwal et al., 2024) and TRL's GKDTrainer define them."""

    lmbda: float = 0.0
    """GKD's λ: the fraction of optimizer steps (drawn by seed, the same on every rank) whose prompts the student
    completes; the loss is taken on the generated tokens only, and only its KD term (the student's own samples are
    no gold labels). Set from the top-level knob ``lmbda``. 0 = the data only."""
    seq_kd: bool = False
    """Sequence-level KD: on the other steps the teacher completes the prompts, and its completions are trained on
    as labels (cross-entropy and KD, as ``kd_ratio`` mixes them)."""
    max_new_tokens: int = 32
    """Tokens generated per prompt at most (generation stops at EOS); prompt + completion fit in data.seq_len."""
    temperature: float = 1.0
    """Sampling temperature of the generation (> 0; 1 samples the model's own distribution)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens holding this much probability; 1 = all."""
    seed: int = 0
    """Seed of which steps generate and of every draw (each prompt's own stream: the same on any number of ranks)."""

    @property
    def active(self) -> bool:
        return self.lmbda > 0 or self.seq_kd

    def __post_init__(self) -> None:
        _check(0.0 <= self.lmbda <= 1.0, f"rollout.lmbda={self.lmbda} is outside [0, 1]; pass lmbda=<value in [0, 1]> "
               "(0 = the data only, 1 = every step on the student's own completions)")
        _check(self.max_new_tokens > 0, f"rollout.max_new_tokens={self.max_new_tokens} must be > 0; pass "
               "rollout.max_new_tokens=32 (or another positive count)")
        _check(self.temperature > 0, f"rollout.temperature={self.temperature} must be > 0; pass rollout.temperature=1.0")
        _check(0.0 < self.top_p <= 1.0, f"rollout.top_p={self.top_p} must be in (0, 1]; pass rollout.top_p=1.0")


@dataclass(frozen=True, kw_only=True)
class DownstreamConfig:
    """lm-evaluation-harness tasks scored on the trained student at the end of a completed run (``pip install
    'kdsweep[eval]'``): run.json's ``downstream``, and each task's headline metric as ``lm_eval/<task>`` beside the
    held-out CE in ``eval_after`` and ``test_after``, which a sweep may optimise or confirm on
    (``kdsweep.evaluation.downstream``). The merged student is written to be scored, and removed after unless
    ``checkpoint.export_merged``."""

    tasks: tuple[str, ...] = ()
    """lm-eval tasks: the shipped ``kdsweep_next_word``, one in ``include``, or any lm-eval ships (those read their
    datasets through the Hugging Face cache). Empty: none."""
    include: tuple[str, ...] = ()
    """Directories of a user's own lm-eval task YAML files."""
    batch_size: int = 16
    """lm-eval's batch size."""
    limit: int | None = None
    """Score only the first this many items of each task (None: every item): cheaper and noisier, for a search."""

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, f"downstream.batch_size={self.batch_size} must be >= 1")
        _check(self.limit is None or self.limit >= 1,
               f"downstream.limit={self.limit} must be >= 1 (null: every item of each task)")


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """Set by the sweep controller on the jobs it starts; empty for a plain run."""

    sweep_dir: str = ""
    """The sweep this job is a trial of (its sweep.json names the study and the pruner)."""
    number: int = -1
    """The Optuna trial number."""
    study: str = ""
    """The Optuna study's name (W&B groups the trials of a study)."""

    def __post_init__(self) -> None:
        _check(not self.sweep_dir or self.number >= 0, f"trial.number={self.number} must be >= 0 when trial.sweep_dir is set")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One kdsweep job: what to distil into what, on which data, with which loss and schedule."""

    output_dir: str
    """The run directory: checkpoints, exports, metrics and records go here."""
    model: StudentConfig = field(default_factory=lambda: StudentConfig(zoo="tiny-student"))
    teacher: TeacherConfig = field(default_factory=lambda: TeacherConfig(zoo="tiny-teacher"))
    teachers: tuple[TeacherMember, ...] = ()
    """Several teachers distilled at once, each with its own tokenizer and a weight (their KD term: the weighted
    mean of the divergences to each); when set, ``teacher.path``/``teacher.zoo`` are not read, its ``logits`` and
    ``cache`` apply to every teacher. Empty: the one ``teacher``."""
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)

    def __post_init__(self) -> None:
        _check(bool(self.output_dir), "output_dir is empty; pass hydra.run.dir=<directory>")
        self._check_teachers()
        self._check_cache()
        self._check_rollout()
        _check(not self.train.eval_test or self.data.has_test,
               "train.eval_test=true but data has no test split; set data.test_fraction=0.05 (or data.test_datasets)")
        _check(not self.train.eval_test or self.teacher.logits == "live",
               "train.eval_test=true: teacher.logits=cache holds no test rows; pass teacher.logits=live")
        pr = self.profiler
        _check(
            not pr.enabled or pr.wait + pr.warmup + pr.active <= self.train.max_steps,
            f"profiler.wait+warmup+active={pr.wait + pr.warmup + pr.active} steps exceed train.max_steps="
            f"{self.train.max_steps}, so no trace would be written; lower profiler.active or profiler.wait",
        )

    def loss_chunks(self, vocab: int) -> dict[str, int]:
        """The loss's chunks per training micro-batch and per held-out batch, from the configured sizes (``data``'s
        ``micro_batch_size`` and ``eval_batch_size`` × ``seq_len``), so every rank and batch takes the same path;
        ``vocab``: the student's output rows."""
        d = self.data
        return {"train": self.loss.chunks_for(d.micro_batch_size * d.seq_len, vocab),
                "eval": self.loss.chunks_for(d.eval_batch_size * d.seq_len, vocab)}

    def teacher_gives_hidden(self, vocab: int) -> bool:
        """Whether a live teacher gives its final hidden states (and its output layer) instead of its logits: for the
        fused loss when it splits (:meth:`loss_chunks`), so that no ``[N, V]`` teacher logits exist; otherwise its own
        forward's logits, which the plain graph reads at once."""
        return self.loss.impl == "fused" and max(self.loss_chunks(vocab).values()) > 1

    def teacher_views(self) -> list[tuple[float, "RunConfig"]]:
        """Each teacher's weight and the config as that teacher's alone (``teacher`` is it, ``teachers`` empty):
        one view of weight 1 without ``teachers``."""
        if not self.teachers:
            return [(1.0, self)]
        return [(m.weight, replace(self, teacher=replace(self.teacher, path=m.path, zoo=m.zoo), teachers=()))
                for m in self.teachers]

    def _check_teachers(self) -> None:
        """Weights that make a mean, and what several teachers cannot do yet: one line each."""
        if not self.teachers:
            return
        for i, m in enumerate(self.teachers):
            _check(m.weight >= 0, f"teachers.{i}.weight={m.weight} is negative; a teacher's weight is its share of the "
                                  f"KD term: pass teachers.{i}.weight=<0 or more>")
        weights = [m.weight for m in self.teachers]
        _check(sum(weights) > 0, f"teachers: the weights {weights} sum to {sum(weights):g}; give at least one teacher "
                                 "a positive weight, e.g. teachers.0.weight=1")
        _check(not self.rollout.active, "lmbda and rollout.seq_kd: generation with several teachers is not supported "
                                        "yet; pass lmbda=0 rollout.seq_kd=false, or one teacher")

    @property
    def cache_temperature(self) -> float:
        """The temperature the teacher cache's sparse targets are taken at (teacher.cache.temperature or the loss's)."""
        t = self.teacher.cache.temperature
        return self.loss.temperature if t is None else t

    def _check_cache(self) -> None:
        """What a teacher-logit cache method cannot give the loss: one line naming what would work."""
        c, loss = self.teacher.cache, self.loss
        if self.teacher.logits != "cache" or c.method == "full":
            return
        _check(
            c.method != "sample" or loss.divergence == "forward_kl",
            f"loss.divergence={loss.divergence} cannot be trained from teacher.cache.method=sample: draws from the "
            "teacher estimate only forward_kl without bias (the others need the teacher's probability wherever the "
            "student puts mass); use loss.divergence=forward_kl, or teacher.cache.method=topk (every divergence on "
            "the top k + tail) or full",
        )
        _check(
            self.cache_temperature == loss.temperature,
            f"teacher.cache.temperature={c.temperature} but loss.temperature={loss.temperature}: "
            f"{c.method} targets taken at one temperature are not the teacher at another; set "
            f"teacher.cache.temperature=null (the loss's), or use teacher.cache.method=full (logits: any temperature)",
        )

    def _check_rollout(self) -> None:
        """What generation needs from the data and the teacher: one line naming what would work."""
        r, d = self.rollout, self.data
        if not r.active:
            return
        knob = f"lmbda={r.lmbda}" if r.lmbda > 0 else "rollout.seq_kd=true"
        texts = [ds for ds in d.datasets if ds.format == "text"]
        _check(bool(d.datasets) and not texts and d.sequences != "stream",
               f"{knob} needs prompts to complete, and text data has none; use data=instruction or data=chat "
               "(prompts: instructions, or a chat's last assistant turn), or pass lmbda=0 rollout.seq_kd=false")
        _check(self.teacher.logits == "live",
               f"{knob} needs the teacher on generated tokens, and teacher.logits=cache holds only the fixed data's; "
               "pass teacher.logits=live")
        _check(r.max_new_tokens < d.seq_len,
               f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in data.seq_len={d.seq_len}; "
               f"pass rollout.max_new_tokens=<less than {d.seq_len}>")

    def check_world_size(self, world_size: int) -> None:
        """The global batch must split evenly into micro-batches on every rank."""
        d = self.data
        _check(
            d.batch_size % (d.micro_batch_size * world_size) == 0,
            f"data.batch_size={d.batch_size} does not split over {world_size} ranks × data.micro_batch_size="
            f"{d.micro_batch_size}; make batch_size a multiple of {d.micro_batch_size * world_size} "
            "(or lower micro_batch_size)",
        )
