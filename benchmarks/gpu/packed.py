"""The GPU check's packed arm: K LoRA students over one frozen 1B-shaped base with the 8B-shaped teacher, trained
together by kdsweep's own ``train_step`` (one teacher forward per micro-batch for all K: a pack's step,
:mod:`kdsweep.pack`), for K = 1, 2, 4, 8.

Per K: the pack's step time and its time per member against K=1's (a trial's device-seconds per step, packed over
unpacked), beside the sharing bound (T/K + S)/(T + S) from the teacher's forward T measured on the same batch and the
rest S of the K=1 step; the teacher's forwards per step (1, whatever K); the peak device memory beside the memory
plan's ``fixed + K · per_member`` (:mod:`kdsweep.pack.plan`'s terms over these shapes: the teacher's and the base's
weights, one member's activations and loss path, each member's fp32 adapter with its gradients and AdamW moments);
and the largest K the plan fits on this device at ``dist.memory_headroom=0.25``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from budget import Budget, Skip
from shapes import Sizes, free, live, llama, loss_cfg, peak_gb, reset_peak, rows, sync, teacher

KS = (1, 2, 4, 8)
IMPL = "fused"  # the pinned presets' loss
HEADROOM = 0.25


def members(base: nn.Module, k: int, sizes: Sizes) -> list[nn.Module]:
    """K students as a pack holds them: each its own LoRA adapter (seeds 0..K-1) over ``base``'s shared weights."""
    from kdsweep.config.schema import StudentConfig
    from kdsweep.models.load import student_wrapper
    from kdsweep.pack.members import sharing_copy

    cfg = StudentConfig(zoo="tiny-student", lora_rank=sizes.lora_rank, lora_alpha=2.0 * sizes.lora_rank)
    return [student_wrapper(cfg, seed=i)(sharing_copy(base)) for i in range(k)]


def pack_step_s(students: list[nn.Module], source: Any, data: Any, sizes: Sizes, device: torch.device,
                steps: tuple[int, int]) -> float:
    """The median time of ``train_step`` over every student at once (each its own AdamW and schedule)."""
    from kdsweep.config.schema import OptimConfig
    from kdsweep.distributed import single_process
    from kdsweep.train import schedule
    from kdsweep.train.step import Learner, train_step

    learners = []
    for s in students:
        opt = torch.optim.AdamW([p for p in s.parameters() if p.requires_grad], lr=1e-5)
        learners.append(Learner(s, source, opt, schedule.build(opt, OptimConfig(lr=1e-5), 1000), loss_cfg(IMPL),
                                max_grad_norm=1.0))
    warmup, timed = steps
    times = []
    for k in range(warmup + timed):
        batch = data.batch([(k * sizes.micro_batch + j) % len(data) for j in range(sizes.micro_batch)]).to(device)
        sync(device)
        t0 = time.perf_counter()
        train_step(learners, [batch], dist=single_process())
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def forward_s(source: Any, data: Any, sizes: Sizes, device: torch.device, repeats: int = 3) -> float:
    """The teacher's forward on one micro-batch, as the step makes its targets (median)."""
    batch = data.batch(list(range(sizes.micro_batch))).to(device)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        with source.targets(batch):
            sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def plan_terms(t: nn.Module, base: nn.Module, adapter: list[nn.Parameter], sizes: Sizes) -> tuple[float, float]:
    """(fixed, per member) bytes, as :func:`kdsweep.pack.plan.plan` counts them, over these models."""
    from kdsweep.config.schema import LossConfig
    from kdsweep.pack.plan import activation_bytes, loss_path_bytes

    weights = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    tokens = sizes.micro_batch * sizes.seq
    step = (activation_bytes(tokens, sizes.student["num_hidden_layers"], sizes.student["hidden_size"], False,
                             torch.finfo(sizes.dtype).bits // 8)
            + loss_path_bytes(tokens, sizes.vocab, IMPL, LossConfig().chunk_mb, live_teacher=True))
    return weights(t) + weights(base) + step, 4.0 * sum(p.numel() * p.element_size() for p in adapter)


def packed(sizes: Sizes, device: torch.device, budget: Budget) -> dict[str, Any]:
    from kdsweep.pack.members import shares_base
    from kdsweep.pack.plan import PackPlan

    budget.need(20, "building the teacher")
    t = teacher(sizes, device)
    base = llama(sizes.student, sizes, device)
    data = rows(4 * sizes.micro_batch, sizes)
    source = live(t, IMPL)
    t_s = forward_s(source, data, sizes, device)
    probe = members(base, 1, sizes)[0]
    fixed, per_member = plan_terms(t, base, [p for p in probe.parameters() if p.requires_grad], sizes)
    del probe
    forwards: list[int] = []
    hook = t.get_input_embeddings().register_forward_pre_hook(lambda *a: forwards.append(1))
    arms: dict[str, Any] = {}
    steps = (1, 3)
    try:
        for k in KS:
            one = arms["K1"]["step_s"] if arms else 2 * t_s  # K=1's step, or a guess before it ran
            if budget.left() < 10 + sum(steps) * (t_s + k * max(one - t_s, t_s)) * 1.5:
                if not arms:
                    raise Skip(f"{budget.left():.0f} s of the budget left: not enough for one unpacked step")
                arms[f"K{k}"] = {"status": "skipped: the check's budget is spent"}
                continue
            students = members(base, k, sizes)
            free(device)
            reset_peak(device)
            forwards.clear()
            step_s = pack_step_s(students, source, data, sizes, device, steps)
            arms[f"K{k}"] = {"status": "ok", "step_s": round(step_s, 4), "per_member_s": round(step_s / k, 4),
                             "teacher_forwards_per_step": len(forwards) / sum(steps),
                             "base_shared": shares_base(students), "peak_mem_gb": peak_gb(device, 0),
                             "plan_gb": round((fixed + k * per_member) / 2**30, 6)}
            del students
            free(device)
    finally:
        hook.remove()
    one = arms["K1"]["step_s"]
    s_s = max(one - t_s, 0.0)
    for k in KS:
        arm = arms[f"K{k}"]
        if arm["status"] == "ok":
            arm["per_trial_over_k1"] = round(arm["per_member_s"] / one, 3)
            arm["sharing_bound"] = round((t_s / k + s_s) / (t_s + s_s), 3)
    usable = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0) * (1 - HEADROOM)
    largest = PackPlan(fixed, per_member, usable, str(device)).largest() if usable else None
    del base
    free(device)
    rows_out = [f"K={k}: {a['step_s'] * 1e3:.0f} ms/step, {a['per_trial_over_k1']}x K=1 per trial (bound "
                f"{a['sharing_bound']}), {a['teacher_forwards_per_step']:g} teacher forward/step, peak "
                f"{a['peak_mem_gb']} GiB (plan {a['plan_gb']})" if a["status"] == "ok" else f"K={k}: {a['status']}"
                for k, a in zip(KS, arms.values())]
    best = max((k for k in KS if arms[f"K{k}"]["status"] == "ok"), default=1)
    return {"impl": IMPL, "lora_rank": sizes.lora_rank, "teacher_forward_s": round(t_s, 4), "arms": arms,
            "plan_largest_k": largest, "rows": rows_out,
            "summary": f"K={best}: {arms[f'K{best}'].get('per_trial_over_k1')}x an unpacked step per trial (bound "
                       f"{arms[f'K{best}'].get('sharing_bound')}); the plan fits {largest} members"}
