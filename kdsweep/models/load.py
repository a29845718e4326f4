"""Load the tokenizer, the frozen teacher and the (LoRA or fully) trainable student from HF directories."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
from torch import nn

from kdsweep.config.schema import ModelSource, StudentConfig
from kdsweep.models import zoo

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dir(src: ModelSource) -> Path:
    """The HF directory of a model source; zoo models are built on first use."""
    return Path(src.path) if src.path is not None else zoo.model_dir(src.zoo)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {model_dir} has no EOS token; documents cannot be separated")
    return tok


def _load_causal_lm(model_dir: Path, dtype: str, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # kdsweep's own bar and log lines say what happens

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    model.config.use_cache = False  # training never decodes; a KV cache only costs memory
    return model.to(device)


def load_teacher(model_dir: Path, dtype: str, device: torch.device) -> nn.Module:
    """The teacher: eval mode (no dropout), every parameter frozen."""
    model = _load_causal_lm(model_dir, dtype, device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_student(model_dir: Path, cfg: StudentConfig, dtype: str, device: torch.device, seed: int) -> nn.Module:
    """The student in train mode: a peft LoRA model (``lora_rank > 0``) or the plain model, fully trainable."""
    model = _load_causal_lm(model_dir, dtype, device)
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.target_modules),
            task_type="CAUSAL_LM",
        )
        torch.manual_seed(seed)  # LoRA A matrices are random: same seed, same initial adapter
        with warnings.catch_warnings():
            # peft still asks transformers for a renamed attribute; the warning is not the user's to act on
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            model = get_peft_model(model, lora)
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    log.info("student: %d of %d parameters trainable (%s)", trainable, total,
             f"LoRA rank {cfg.lora_rank}" if cfg.lora_rank else "full fine-tune")
    return model
