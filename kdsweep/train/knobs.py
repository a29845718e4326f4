"""Options that cannot act in a run's setting: a warning each, instead of ignoring them silently."""

from __future__ import annotations

import logging
from typing import Any

from kdsweep.config.schema import (
    DataConfig, DistConfig, DownstreamConfig, LossConfig, RolloutConfig, RunConfig, StudentConfig, TeacherCacheConfig,
)
from kdsweep.distributed import DistEnv
from kdsweep.teacher.views import reads_chat_in_own_template

log = logging.getLogger(__name__)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def warn_idle_knobs(cfg: RunConfig, dist: DistEnv) -> None:
    """Options that cannot act in this setting: say so instead of ignoring them silently."""

    def changed(section: Any, default: Any, knob: str) -> bool:
        return getattr(section, knob) != getattr(default, knob)

    if dist.world_size == 1:
        for knob in ("reshard_after_forward", "cpu_offload", "teacher_placement", "student_mesh", "device_memory_gb",
                     "memory_headroom"):
            if changed(cfg.dist, DistConfig(), knob):
                log.warning("dist.%s=%s has no effect with one rank (nothing is sharded)", knob,
                            getattr(cfg.dist, knob))
    elif cfg.dist.teacher_placement != "auto":
        for knob in ("device_memory_gb", "memory_headroom"):
            if changed(cfg.dist, DistConfig(), knob):
                log.warning("dist.%s=%s has no effect with dist.teacher_placement=%s (only auto plans against the "
                            "budget)", knob, getattr(cfg.dist, knob), cfg.dist.teacher_placement)
    if dist.nodes == 1 and dist.world_size > 1 and cfg.dist.student_mesh == "hsdp":
        log.warning("dist.student_mesh=hsdp has no effect on one node: the student is sharded over its %d ranks",
                    dist.world_size)
    if not cfg.train.tf32 and cfg.train.device != "cuda" and not _cuda():
        log.warning("train.tf32=false has no effect on CPU (TF32 is a GPU matmul mode)")
    if cfg.train.dtype == "bf16_pure" and cfg.model.lora_rank == 0:
        log.warning("train.dtype=bf16_pure: a full fine-tune keeps bf16 master weights and bf16 AdamW state, so "
                    "updates below bf16's resolution (about 0.4%% of a weight) round away; train.dtype=bf16 computes "
                    "in bf16 with fp32 master weights")
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
                log.warning("rollout.%s has no effect with lmbda=0 and rollout.seq_kd=false (nothing is generated)",
                            knob)
    if cfg.loss.kd_ratio == 0 and cfg.rollout.lmbda == 0:
        for knob in ("divergence", "beta", "temperature"):
            if changed(cfg.loss, LossConfig(), knob):
                log.warning("loss.%s has no effect with kd_ratio=0: the training steps run without the teacher (the "
                            "evaluations measure KL at T=1)", knob)
    if cfg.loss.impl == "dense" and changed(cfg.loss, LossConfig(), "chunk_mb"):
        log.warning("loss.chunk_mb=%g has no effect with loss.impl=dense (the loss is one chunk whatever its size)",
                    cfg.loss.chunk_mb)
    if cfg.teacher.chat_template is not None and not reads_chat_in_own_template(cfg):
        log.warning("teacher.chat_template has no effect: only a teacher with another tokenizer than the student's "
                    "reads chat data in its own template")
    if cfg.data.eval_datasets and changed(cfg.data, DataConfig(), "eval_fraction"):
        log.warning("data.eval_fraction has no effect: data.eval_datasets are the held-out set")
    if cfg.data.test_datasets and changed(cfg.data, DataConfig(), "test_fraction"):
        log.warning("data.test_fraction has no effect: data.test_datasets are the test split")
    if not cfg.downstream.tasks:
        for knob in ("include", "batch_size", "limit"):
            if changed(cfg.downstream, DownstreamConfig(), knob):
                log.warning("downstream.%s has no effect: downstream.tasks is empty (no lm-eval task is scored)", knob)
