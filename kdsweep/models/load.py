"""Load the tokenizer, the frozen teacher and the (LoRA or fully) trainable student from HF directories.

With one rank a model is read straight onto its device. With several, every rank builds it on the meta
device, shards it with FSDP2 and receives its shards from rank 0, the only rank that reads the files, then
every buffer from rank 0 too (rotary frequencies, embedding scales: no state dict carries them all).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kdsweep.config.schema import DistConfig, ModelSource, StudentConfig
from kdsweep.distributed import DistEnv, fsdp, single_process
from kdsweep import hub
from kdsweep.models import targets, zoo

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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


def _from_pretrained(model_dir: Path, dtype: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # kdsweep's own bar and log lines say what happens
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    model.config.use_cache = False  # training never decodes; a KV cache only costs memory
    return model


def _on_meta(model_dir: Path, dtype: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])


def prepare(model: nn.Module, cfg: DistConfig, trainable: bool) -> None:
    """Activation checkpointing (``trainable`` models) and compilation as ``cfg`` asks, in place, before sharding."""
    if cfg.activation_checkpointing and trainable:
        fsdp.hf_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        for layer in fsdp.decoder_layers(model):
            layer.compile()


def _build(
    model_dir: Path, dtype: str, device: torch.device, env: DistEnv, cfg: DistConfig,
    wrap: Callable[[nn.Module], nn.Module], trainable: bool,
) -> nn.Module:
    if env.world_size == 1:
        model = wrap(_from_pretrained(model_dir, dtype))
        prepare(model, cfg, trainable)
        return model.to(device)
    source = wrap(_from_pretrained(model_dir, dtype)) if env.is_main else None
    model = wrap(_on_meta(model_dir, dtype))
    prepare(model, cfg, trainable)
    fsdp.shard(model, cfg)
    model.to_empty(device="cpu" if cfg.cpu_offload else device)  # offloaded shards live on the host
    fsdp.load_from_rank0(model, source.state_dict() if source is not None else {})
    fsdp.broadcast_buffers(model, source)
    return model


def load_teacher(
    model_dir: Path, dtype: str, device: torch.device, env: DistEnv | None = None, dist_cfg: DistConfig | None = None
) -> nn.Module:
    """The teacher: eval mode (no dropout), every parameter frozen, sharded like the student."""

    def freeze(model: nn.Module) -> nn.Module:
        return model.eval().requires_grad_(False)

    return _build(model_dir, dtype, device, env or single_process(), dist_cfg or DistConfig(), freeze, trainable=False)


def student_wrapper(cfg: StudentConfig, seed: int) -> Callable[[nn.Module], nn.Module]:
    """What makes a loaded model the student ``cfg`` asks for: a peft LoRA of rank ``cfg.lora_rank`` on the resolved
    ``cfg.target_modules`` (adapter initialised from ``seed``), or the plain model in train mode (``lora_rank=0``).
    ``load_student`` applies it; so may a harness that builds its own model (benchmarks/gpu)."""

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
            return get_peft_model(model, lora).train()

    return wrap


def load_student(
    model_dir: Path, cfg: StudentConfig, dtype: str, device: torch.device, seed: int,
    env: DistEnv | None = None, dist_cfg: DistConfig | None = None,
) -> nn.Module:
    """The student in train mode: a peft LoRA model (``lora_rank > 0``) or the plain model, fully trainable."""
    model = _build(model_dir, dtype, device, env or single_process(), dist_cfg or DistConfig(),
                   student_wrapper(cfg, seed), trainable=True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("student: %d of %d parameters trainable on this rank (%s)", trainable, total,
             f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "full fine-tune")
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
    model = student_wrapper(cfg, seed)(_from_pretrained(model_dir, dtype))
    model.load_state_dict(state)
    return model
