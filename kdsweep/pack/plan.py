"""How many trials a pack fits on one device: the memory plan of a packed job, from the models' shapes (nothing is
read but their configs).

A pack of K on one rank holds, once: the live teachers' weights (in their frozen dtype; none for a teacher cache),
the student's frozen base, and one member's step (members step one after another): its activations and its loss
path. Per member: its adapter's weights, their gradients and AdamW's two moments, in the master dtype. So memory
grows as ``fixed + K · per_member``; the usable share of the device is ``1 - dist.memory_headroom`` of
``dist.device_memory_gb`` (or the device's own memory: the GPU's, or the host's over its local ranks).

The step's terms (its activations and loss path) are the memory model's (:mod:`kdsweep.models.memory`), which the
teachers' placement counts too. Growth: linear in K (adapters), in N and in the student's width and depth
(activations), in V (the loss path, up to the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kdsweep.config.schema import RunConfig
from kdsweep.models.memory import activation_bytes, loss_path_bytes, step_bytes


@dataclass(frozen=True)
class PackPlan:
    """One device's memory for a pack: ``fixed + K · per_member`` bytes, against ``usable``."""

    fixed: float
    """Held once: the live teachers' weights, the student's base, one member's activations and loss path."""
    per_member: float
    """Each member's adapter weights, gradients and AdamW moments (the largest member's)."""
    usable: float
    source: str
    """Where the device's memory comes from (``dist.device_memory_gb=…``, the GPU's name, the host's)."""

    def bytes(self, k: int) -> float:
        return self.fixed + k * self.per_member

    def largest(self) -> int:
        """The most members that fit (0: not even one)."""
        return max(0, int((self.usable - self.fixed) // self.per_member)) if self.per_member > 0 else 0

    def fits(self, k: int) -> bool:
        return self.bytes(k) <= self.usable

    def text(self, k: int) -> str:
        gb = lambda b: f"{b / 1e9:.3g} GB"  # noqa: E731
        return (f"a pack of {k} needs {gb(self.bytes(k))} ({gb(self.fixed)} once, {gb(self.per_member)} per member) "
                f"of {gb(self.usable)} usable ({self.source})")


def plan(cfgs: Sequence[RunConfig], device: torch.device | None, device_gb: float | None = None) -> PackPlan:
    """The memory plan of a pack whose members are ``cfgs`` (or the trials a search makes: the largest adapter
    counts for every member) on ``device``; ``device_gb``: its memory when it is not this process's (a SLURM node's
    GPU), else ``dist.device_memory_gb`` or the device's own."""
    from transformers import AutoConfig

    from kdsweep.distributed import single_process
    from kdsweep.distributed.placement import budget_bytes
    from kdsweep.models.load import model_bytes, resolve_dir, student_wrapper
    from kdsweep.models.precision import Precision

    cfg = cfgs[0]
    precision = Precision(cfg.train.dtype)
    student_dir = resolve_dir(cfg.model)
    base = model_bytes(student_dir, precision.student_dtype(False))[0]
    trainable = max(model_bytes(student_dir, precision.student_dtype(False), student_wrapper(c.model, c.train.seed))[1]
                    for c in cfgs)
    master = torch.finfo(precision.master_dtype).bits // 8
    live = cfg.teacher.logits == "live"
    teachers = sum(model_bytes(resolve_dir(view.teacher, "teacher"), precision.frozen_dtype)[0]
                   for _, view in cfg.teacher_views()) if live else 0
    step = step_bytes(cfg, AutoConfig.from_pretrained(student_dir), live)
    if device_gb:
        budget, source = device_gb * 1e9, f"dist.device_memory_gb={device_gb:g}"
    else:
        budget, source = budget_bytes(cfg.dist, device, single_process())
    return PackPlan(fixed=teachers + base + step, per_member=4 * master * trainable,
                    usable=budget * (1 - cfg.dist.memory_headroom), source=source)


def check_fits(plan_: PackPlan, k: int, key: str, fewer: str, unpacked: str) -> None:
    """One line (a ConfigError naming ``key``) when a pack of ``k`` does not fit the device as the plan has it;
    ``fewer``: how to ask for packs of N (``{n}``) instead, ``unpacked``: for no packs."""
    from kdsweep.config.schema import ConfigError

    if plan_.fits(k):
        return
    most = plan_.largest()
    fix = (f"the most that fit is {most}: {fewer.format(n=most)}" if most >= 2 else
           f"not even two fit: {unpacked}" if most == 1 else "not even one trial fits this device")
    raise ConfigError(f"{key}: a pack of {k} will not fit, says the memory plan: {plan_.text(k)}; {fix}")


__all__ = ["PackPlan", "activation_bytes", "check_fits", "loss_path_bytes", "plan"]
