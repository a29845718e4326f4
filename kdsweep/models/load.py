"""Load the tokenizer, the frozen teacher and the (LoRA or fully) trainable student from HF directories.

With one rank a model is read straight onto its device. With several, every rank builds it empty, places it
(sharded with FSDP2, over every rank or within each node, as its :class:`~kdsweep.distributed.placement.Placement`
says, or a whole copy) and reads from the files only the rows it holds (:mod:`kdsweep.models.shards`); the ranks then
meet outside any collective. ``train.dtype`` decides the dtypes (:mod:`kdsweep.models.precision`).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kdsweep.config.schema import DistConfig, ModelSource, RunConfig, StudentConfig
from kdsweep.distributed import DistEnv, comm, fsdp, single_process, waits
from kdsweep.distributed.placement import (Placement, TeacherSize, parameter_bytes, student_placement,
                                           teacher_placements)
from kdsweep import hub
from kdsweep.models import shards, targets, zoo
from kdsweep.models.precision import Precision

log = logging.getLogger(__name__)


def resolve_dir(src: ModelSource, section: str = "model") -> Path:
    """The HF directory of a model source: a local directory, the cached snapshot of a hub id (read from the cache
    only: the launching process filled it), or a zoo model, built on first use."""
    return hub.model_dir(f"{section}.path", src.path) if src.path is not None else zoo.model_dir(src.zoo)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {model_dir} has no EOS token; documents cannot be separated")
    return tok


def read_model(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The model in ``model_dir`` as transformers reads it, whole, on the host, in ``dtype`` (no KV cache)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # kdsweep's own bar and log lines say what happens
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.config.use_cache = False  # training never decodes; a KV cache only costs memory
    return model


def _on_meta(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def prepare(model: nn.Module, cfg: DistConfig, trainable: bool) -> None:
    """Activation checkpointing (``trainable`` models) and compilation as ``cfg`` asks, in place, before sharding."""
    if cfg.activation_checkpointing and trainable:
        fsdp.hf_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        for layer in fsdp.decoder_layers(model):
            layer.compile()


def _build(
    model_dir: Path, dtype: torch.dtype, device: torch.device, env: DistEnv, cfg: DistConfig,
    wrap: Callable[[nn.Module], nn.Module], trainable: bool, placement: Placement, precision: Precision, owner: str,
) -> nn.Module:
    if env.world_size == 1:
        model = wrap(read_model(model_dir, dtype))
        prepare(model, cfg, trainable)
        return model.to(device)
    model, kept = shards.empty(model_dir, dtype, wrap)
    rows = shards.rows_of(model_dir, model, dtype)
    prepare(model, cfg, trainable)
    if placement.sharded:
        fsdp.shard(model, cfg, mesh=placement.mesh(device), mp_policy=precision.fsdp_policy(trainable))
        comm.label(model, owner)
        if placement.two_dimensional and trainable:  # HSDP: the gradients' all-reduce across nodes is the student's
            comm.own_group(placement.mesh(device).get_group("replicate"), owner)
        model.to_empty(device="cpu" if cfg.cpu_offload else device)  # offloaded shards live on the host
    else:  # a whole copy on every rank: no collective ever
        shards.materialise(model, device)
    shards.fill(model, rows, kept)  # each rank its own rows, from the files, as long as it takes
    waits.together(env, f"load its share of the {owner}")  # no rank goes on to a collective before all are loaded
    return model


def model_bytes(model_dir: Path, dtype: torch.dtype,
                wrap: Callable[[nn.Module], nn.Module] = lambda m: m) -> tuple[int, int]:
    """(bytes of the model's weights as held, its trainable parameters), counted on the meta device (no weights
    read)."""
    model = wrap(_on_meta(model_dir, dtype))
    return parameter_bytes(model), sum(p.numel() for p in model.parameters() if p.requires_grad)


@dataclass(frozen=True)
class Plan:
    """Where the job's student and each of its teachers live (``distributed.placement``), and why."""

    student: Placement
    teachers: list[Placement]

    def record(self) -> dict[str, Any]:
        """run.json's ``placement``."""
        teachers = [t.record() for t in self.teachers]
        return {"student": self.student.record(), "teacher": teachers[0] if len(teachers) == 1 else teachers}


def teacher_size(model: nn.Module) -> TeacherSize:
    """What a teacher (on the meta device) holds on a rank by placement: all its weights, and what a sharded copy
    gathers whole while it runs (its output layer, two decoder layers)."""
    head, weights = fsdp.hf_model(model).get_output_embeddings(), parameter_bytes(model)
    try:
        layer = max(parameter_bytes(layer) for layer in fsdp.decoder_layers(model))
    except ValueError:  # no decoder layers kdsweep can find (sharding it would fail): as if whole
        return TeacherSize(weights, weights)
    return TeacherSize(weights, (parameter_bytes(head) if head is not None else 0) + 2 * layer)


def plan(cfg: RunConfig, student_dir: Path, teacher_dirs: list[Path], env: DistEnv, device: torch.device) -> Plan:
    """Each model's placement: the student sharded as ``dist.student_mesh`` says, each teacher placed by its size
    against the rank's budget (``dist.teacher_placement``): a live teacher beside the student's share and a training
    step (the memory model, :mod:`kdsweep.models.memory`) and the teachers placed before it; a teacher that builds
    a cache beside that build alone (the student is loaded after it, and each teacher's build after the one before
    it is unloaded). Costs nothing on one rank."""
    from transformers import AutoConfig

    from kdsweep.models.heads import logit_transform
    from kdsweep.models.memory import build_bytes, step_bytes

    d, precision = cfg.dist, Precision(cfg.train.dtype)
    if env.world_size == 1:
        return Plan(student_placement(d, env),
                    teacher_placements(d, env, [TeacherSize(0)] * len(teacher_dirs), 0, device))
    s_bytes, trainable = model_bytes(student_dir, precision.student_dtype(cfg.model.lora_rank == 0),
                                     student_wrapper(cfg.model, cfg.train.seed))
    s_place = student_placement(d, env, s_bytes)
    teachers = [_on_meta(t, precision.frozen_dtype) for t in teacher_dirs]
    if cfg.teacher.logits != "live":
        return Plan(s_place, [teacher_placements(d, env, [teacher_size(t)], build_bytes(
            cfg, t.config, logit_transform(t) is not None), device, "its cache build's")[0] for t in teachers])
    master = torch.finfo(precision.master_dtype).bits // 8
    share = (s_bytes + trainable * 3 * master) / s_place.shard_ranks  # weights, and a gradient and 2 AdamW moments
    step = step_bytes(cfg, AutoConfig.from_pretrained(student_dir), live_teacher=True)
    return Plan(s_place, teacher_placements(d, env, [teacher_size(t) for t in teachers], share + step, device,
                                            "the student's share and a step's"))


def load_teacher(
    model_dir: Path, dtype: str, device: torch.device, env: DistEnv | None = None, dist_cfg: DistConfig | None = None,
    placement: Placement | None = None, owner: str = "teacher",
) -> nn.Module:
    """The teacher: eval mode (no dropout), every parameter frozen, in the frozen dtype of ``train.dtype``, placed as
    ``placement`` says (default: as ``dist.teacher_placement`` would place it alone)."""
    env, cfg, precision = env or single_process(), dist_cfg or DistConfig(), Precision(dtype)

    def freeze(model: nn.Module) -> nn.Module:
        return model.eval().requires_grad_(False)

    if placement is None:
        held = teacher_size(_on_meta(model_dir, precision.frozen_dtype)) if env.world_size > 1 else TeacherSize(0)
        placement = teacher_placements(cfg, env, [held], 0, device)[0]
    return _build(model_dir, precision.frozen_dtype, device, env, cfg, freeze, False, placement, precision, owner)


def student_wrapper(cfg: StudentConfig, seed: int, dtype: str = "fp32") -> Callable[[nn.Module], nn.Module]:
    """What makes a loaded model the student ``cfg`` asks for: a peft LoRA of rank ``cfg.lora_rank`` on the resolved
    ``cfg.target_modules`` (adapter initialised from ``seed``; fp32 unless ``dtype=bf16_pure``), or the plain model in
    train mode (``lora_rank=0``). ``load_student`` applies it; so may a harness that builds its own model
    (benchmarks/gpu)."""

    def wrap(model: nn.Module) -> nn.Module:
        if cfg.lora_rank == 0:
            return model.train()
        from peft import LoraConfig, get_peft_model

        names = targets.resolve(model, cfg.target_modules)
        lora = LoraConfig(
            r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
            target_modules=targets.peft_targets(model, names), task_type="CAUSAL_LM",
        )
        torch.manual_seed(seed)  # LoRA A matrices are random: same seed, same initial adapter
        with warnings.catch_warnings():
            # peft still asks transformers for a renamed attribute; the warning is not the user's to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # LoRA on a tied output layer: the merged export unties it (checkpoint.export), as peft advises
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*", category=UserWarning)
            # peft holds adapters in fp32 over a bf16 base (their master weights); bf16_pure keeps them in bf16
            return get_peft_model(model, lora, autocast_adapter_dtype=dtype != "bf16_pure").train()

    return wrap


def load_student(
    model_dir: Path, cfg: StudentConfig, dtype: str, device: torch.device, seed: int,
    env: DistEnv | None = None, dist_cfg: DistConfig | None = None, placement: Placement | None = None,
) -> nn.Module:
    """The student in train mode: a peft LoRA model (``lora_rank > 0``) or the plain model, fully trainable, its
    trainable parameters in the master dtype of ``train.dtype`` (fp32 unless ``bf16_pure``)."""
    env, dist_cfg, precision = env or single_process(), dist_cfg or DistConfig(), Precision(dtype)
    placement = placement or student_placement(dist_cfg, env)
    model = _build(model_dir, precision.student_dtype(cfg.lora_rank == 0), device, env, dist_cfg,
                   student_wrapper(cfg, seed, dtype), True, placement, precision, "student")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
    log.info("student: %d of %d parameters trainable on this rank (%s, trainable in %s)", trainable, total,
             f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "full fine-tune", "/".join(dtypes))
    if cfg.lora_rank:
        reached = targets.adapted(model)
        log.info("LoRA reached %d modules (model.target_modules=%s): %s", len(reached),
                 ",".join(cfg.target_modules), targets.describe(reached))
    return model


def unsharded_on_rank0(
    student: nn.Module, model_dir: Path, cfg: StudentConfig, dtype: str, seed: int, env: DistEnv
) -> nn.Module | None:
    """The trained student as one ordinary CPU model on rank 0 (for export); None on other ranks.

    A collective when sharded: every rank must call it.
    """
    if env.world_size == 1:
        return student
    state = fsdp.gather_to_rank0(student)
    if not env.is_main:
        return None
    precision = Precision(dtype)
    model = student_wrapper(cfg, seed, dtype)(read_model(model_dir, precision.student_dtype(cfg.lora_rank == 0)))
    model.load_state_dict(state)
    return model
