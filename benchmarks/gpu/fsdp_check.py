"""The GPU check's one-rank sharding part: a process group of one rank (NCCL on a GPU) and kdsweep's FSDP2 sharding
of the embedded student and teacher, against the same models unsharded."""

from __future__ import annotations

import socket
from typing import Any

import torch

from budget import Budget
from shapes import Sizes, free, live, rows, timed_steps


def fsdp(device: torch.device, budget: Budget) -> dict[str, Any]:
    """A one-rank process group (NCCL on a GPU) and kdsweep's FSDP2 sharding of the embedded student and teacher:
    fp32 (equal to the unsharded run), activation checkpointing, and bf16 mixed precision (within 2%)."""
    import torch.distributed as dist

    from kdsweep.config.schema import DistConfig, StudentConfig
    from kdsweep.distributed import fsdp as sharding
    from kdsweep.distributed.env import backend_for
    from kdsweep.models import zoo
    from kdsweep.models.load import prepare, load_student, load_teacher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = backend_for(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        s_dir, t_dir = zoo.model_dir("tiny-student"), zoo.model_dir("tiny-teacher")
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(s_dir))
        sizes = Sizes(teacher={}, student={}, vocab=vocab, seq=128, micro_batch=4, lora_rank=8, warmup_steps=0,
                      timed_steps=8, max_micro_batch=4, cache_rows=0)
        data = rows(32, sizes)
        arms = {"unsharded": None, "fsdp2": DistConfig(), "fsdp2_ac": DistConfig(activation_checkpointing=True),
                "fsdp2_bf16_mixed": DistConfig(mixed_precision=True)}
        out: dict[str, Any] = {}
        for name, cfg in arms.items():
            if budget.left() < 5:
                out[name] = {"status": "skipped: the check's budget is spent"}
                continue
            st = load_student(s_dir, StudentConfig(zoo="tiny-student"), "fp32", device, seed=0)
            te = load_teacher(t_dir, "fp32", device)
            if cfg is not None:
                prepare(st, cfg, trainable=True)
                sharding.shard(st, cfg)
                sharding.shard(te, cfg)
            r = timed_steps(st, live(te, "chunked"), data, sizes, "chunked", device, 4, (0, 8))
            out[name] = {"status": "ok", "loss_after_8_steps": r["loss"], "step_s": r["step_s"]}
            del st, te
            free(device)
        ref = out["unsharded"].get("loss_after_8_steps")
        for name, tolerance in (("fsdp2", 1e-4), ("fsdp2_ac", 1e-4), ("fsdp2_bf16_mixed", 0.02)):
            if "loss_after_8_steps" in out[name] and ref is not None:
                rel = (out[name]["loss_after_8_steps"] - ref) / ref
                out[name].update(relative_to_unsharded=rel, tolerance=tolerance, within=abs(rel) <= tolerance)
        within = sum(bool(a.get("within")) for a in out.values())
        return {"backend": backend, "arms": out, "summary": f"{backend}: {within} of 3 sharded arms within tolerance",
                "rows": [f"{n}: loss {a.get('loss_after_8_steps')} ({a.get('relative_to_unsharded', 0):+.2e})"
                         for n, a in out.items()]}
    finally:
        dist.destroy_process_group()
