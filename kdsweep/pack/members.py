"""A pack's students: one LoRA adapter per member over one frozen base, held once.

Each member is the student its trial would load alone (:func:`kdsweep.models.load.student_wrapper`: the same target
modules, the same adapter from the same seed), built over a copy of the base model's modules that shares the base's
parameter and buffer tensors: the frozen weights exist once, whatever the pack's size, and each member owns only its
adapter (its rank and alpha its own). Memory: the base's bytes once, plus each member's adapter, optimizer state and
activations; a member's step runs its own forward and backward, so time grows with the members.

Only what leaves the base frozen shares it: a LoRA student (``lora_rank > 0``) that is not sharded across ranks (on
several ranks each member is its trial's sharded student).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kdsweep.config.schema import DistConfig, RunConfig, StudentConfig
from kdsweep.distributed import DistEnv
from kdsweep.models.load import prepare, read_model, student_wrapper
from kdsweep.models.precision import Precision
from kdsweep.train.trial import ALONE


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules whose parameters and buffers are ``model``'s own tensors (tied weights stay
    tied): wrapping the copy in an adapter changes its modules, never the shared weights."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


class OverOneBase:
    """A pack's students (:class:`~kdsweep.pack.job.Member` seats them): each member's student wrapped over one frozen
    base, read on the first member's load and shared by the rest (:func:`sharing_copy`). A member's export merges a
    copy of it, never the shared base. Its members have LoRA ranks: :func:`~kdsweep.pack.job.check_pack` refuses
    ``lora_rank=0`` before any member loads.

    On several ranks each member's student is loaded and sharded as its trial alone loads it (FSDP2 takes over the
    parameters of the modules it shards, so members cannot share them yet): the base is held once per member, in
    shards; the teacher's pass is still shared."""

    def __init__(self) -> None:
        self.base: nn.Module | None = None

    def load(self, cfg: RunConfig, src: Any, device: torch.device, dist: DistEnv) -> nn.Module:
        if dist.world_size > 1:
            return ALONE.load(cfg, src, device, dist)
        if self.base is None:
            self.base = read_model(src.student_dir, Precision(cfg.train.dtype).student_dtype(False))
        return member(self.base, cfg.model, cfg.train.dtype, device, cfg.train.seed, cfg.dist)

    def own(self, student: nn.Module) -> nn.Module:
        if self.base is None:  # several ranks: each member's base is its own
            return student
        return host_copy(student)  # merging folds the adapter into the base: the others' base stays untouched


def host_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the host, made without a second copy on the device
    (a member's merged export: its student's base is the pack's, and a device may hold only one)."""
    memo: dict[int, Any] = {}
    for tensor in (*model.parameters(), *model.buffers()):  # each once: tied weights stay one tensor
        host = tensor.detach().to("cpu", copy=True)
        memo[id(tensor)] = nn.Parameter(host, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else host
    return copy.deepcopy(model, memo=memo)


def students_over_one_base(model_dir: Path, cfgs: list[StudentConfig], dtype: str, device: torch.device, seed: int,
                           dist_cfg: DistConfig | None = None) -> list[nn.Module]:
    """One student per ``cfgs`` entry, each as :func:`~kdsweep.models.load.load_student` would load it on one rank
    (its adapter from ``seed``), over one read of ``model_dir``'s weights that all of them share."""
    full = [i for i, cfg in enumerate(cfgs) if cfg.lora_rank == 0]
    if full:
        raise ValueError(f"a pack's members share the student's frozen base: member {full[0]} has lora_rank=0 "
                         "(a full fine-tune trains the base); give every member a LoRA rank, or run it unpacked")
    base = read_model(model_dir, Precision(dtype).student_dtype(False))
    return [member(base, cfg, dtype, device, seed, dist_cfg or DistConfig()) for cfg in cfgs]


def member(base: nn.Module, cfg: StudentConfig, dtype: str, device: torch.device, seed: int,
           dist_cfg: DistConfig) -> nn.Module:
    """The student ``cfg`` asks for, as :func:`~kdsweep.models.load.load_student` would load it on one rank (its
    adapter from ``seed``), over ``base``'s weights (shared, not copied)."""
    student = student_wrapper(cfg, seed, dtype)(sharing_copy(base))
    prepare(student, dist_cfg, True)
    return student.to(device)


def shares_base(students: list[nn.Module]) -> bool:
    """Whether every student's frozen parameters are the same tensors as the first's (a pack holds its base once)."""
    frozen = [{p.data_ptr() for p in s.parameters() if not p.requires_grad} for s in students]
    return all(f == frozen[0] for f in frozen[1:])
