"""The GPU check's one-rank sharding part: a process group of one rank (NCCL on a GPU) and kdsweep's FSDP2 sharding
of the embedded student and teacher, against the same models unsharded; and the teacher's placement: what ``auto``
decides on this device for the 8B→1B preset, and what a replicated teacher costs against a sharded one."""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from typing import Any, Iterator

import torch

from budget import Budget
from shapes import Sizes, free, live, llama, rows, sync, timed_steps


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A process group of this one rank (NCCL and gloo on a GPU, as kdsweep's jobs make it); its backend."""
    import torch.distributed as dist

    from kdsweep.distributed.env import backend_for

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = backend_for(device)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kw)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def fsdp(device: torch.device, budget: Budget) -> dict[str, Any]:
    """A one-rank process group (NCCL on a GPU) and kdsweep's FSDP2 sharding of the embedded student and teacher:
    fp32 (equal to the unsharded run), activation checkpointing, and ``train.dtype=bf16`` (fp32 master shards, bf16
    compute through FSDP2's mixed precision; within 2%)."""
    from kdsweep.config.schema import DistConfig, StudentConfig
    from kdsweep.distributed import fsdp as sharding
    from kdsweep.models import zoo
    from kdsweep.models.load import prepare, load_student, load_teacher
    from kdsweep.models.precision import Precision

    with one_rank_group(device) as backend:
        s_dir, t_dir = zoo.model_dir("tiny-student"), zoo.model_dir("tiny-teacher")
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(s_dir))
        sizes = Sizes(teacher={}, student={}, vocab=vocab, seq=128, micro_batch=4, lora_rank=8, warmup_steps=0,
                      timed_steps=8, max_micro_batch=4, cache_rows=0)
        data = rows(32, sizes)
        arms = {"unsharded": None, "fsdp2": DistConfig(), "fsdp2_ac": DistConfig(activation_checkpointing=True),
                "fsdp2_bf16_mixed": DistConfig()}
        out: dict[str, Any] = {}
        for name, cfg in arms.items():
            if budget.left() < 5:
                out[name] = {"status": "skipped: the check's budget is spent"}
                continue
            dtype = "bf16" if name == "fsdp2_bf16_mixed" else "fp32"
            st = load_student(s_dir, StudentConfig(zoo="tiny-student"), dtype, device, seed=0)
            te = load_teacher(t_dir, dtype, device)
            if cfg is not None:
                prepare(st, cfg, trainable=True)
                sharding.shard(st, cfg, mp_policy=Precision(dtype).fsdp_policy(trainable=True))
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


def placement(sizes: Sizes, device: torch.device, budget: Budget) -> dict[str, Any]:
    """What ``dist.teacher_placement=auto`` decides on this device for the 8B teacher beside the 1B student (8 GPUs
    a node, LoRA and a full fine-tune), and the teacher's memory and forward time replicated (a plain module: no
    collective) against sharded by kdsweep's FSDP2 on a one-rank group (its all-gather path, without a network),
    with the collectives counted; the all-gathers a sharded teacher would move at 8 ranks, from its bytes."""
    from kdsweep.config.schema import DistConfig
    from kdsweep.distributed import comm, fsdp as sharding
    from kdsweep.distributed.env import DistEnv
    from kdsweep.distributed.placement import parameter_bytes, teacher_placements
    from kdsweep.models.load import teacher_size

    from memory import per_rank

    budget.need(20, "building two teachers")
    node = DistEnv(rank=0, world_size=8, local_world_size=8, source="local")
    with one_rank_group(device):
        comm.install(1, 0)
        replicated = llama(sizes.teacher, sizes, device).eval().requires_grad_(False)
        t_bytes = parameter_bytes(replicated)
        decisions = {}
        for name, lora in (("lora", sizes.lora_rank), ("full", 0)):
            student = per_rank(sizes.teacher, sizes.student, sizes.vocab, lora_rank=lora, seq=sizes.seq,
                               micro_batch=sizes.micro_batch, ranks=8, live_teacher=False)
            (p,) = teacher_placements(DistConfig(), node, [teacher_size(replicated)], student.total, device)
            decisions[name] = p.record()
        batch = rows(sizes.micro_batch, sizes).batch(list(range(sizes.micro_batch))).to(device)
        out: dict[str, Any] = {"teacher_bytes": t_bytes, "auto_on_this_device": decisions}
        sharded = llama(sizes.teacher, sizes, device).eval().requires_grad_(False)
        sharding.shard(sharded, DistConfig())
        comm.label(sharded, "teacher")
        for name, model in (("replicated", replicated), ("sharded_1_rank", sharded)):
            times = []
            before = comm.TALLY.copy()
            with torch.no_grad():
                for _ in range(4):
                    sync(device)
                    t0 = time.perf_counter()
                    model(**batch.inputs())
                    sync(device)
                    times.append(time.perf_counter() - t0)
            out[name] = {"forward_s": round(statistics.median(times[1:]), 4),
                         "collectives": comm.TALLY.since(before).record()}
        out["sharded_at_8_ranks_all_gather_bytes_per_micro_batch"] = t_bytes * 7 / 8
        if device.type == "cuda":
            out["allocated_gb_two_teachers"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
        del replicated, sharded
        free(device)
    out["summary"] = (f"auto on this device: {decisions['lora']['placement']} (LoRA), {decisions['full']['placement']} "
                      f"(full); teacher forward {out['replicated']['forward_s'] * 1e3:.0f} ms replicated, "
                      f"{out['sharded_1_rank']['forward_s'] * 1e3:.0f} ms through FSDP2 on one rank")
    return out
