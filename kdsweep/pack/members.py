"""A pack's students: one LoRA adapter per member over one frozen base, held once.

Each member is the student its trial would load alone (:func:`kdsweep.models.load.student_wrapper`: the same target
modules, the same adapter from the same seed), built over a copy of the base model's modules that shares the base's
parameter and buffer tensors: the frozen weights exist once, whatever the pack's size, and each member owns only its
adapter (its rank and alpha its own). Memory: the base's bytes once, plus each member's adapter, optimizer state and
activations; a member's step runs its own forward and backward, so time grows with the members.

Only what leaves the base frozen shares it: a LoRA student (``lora_rank > 0``) that is not sharded across ranks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from kdsweep.config.schema import DistConfig, StudentConfig
from kdsweep.models.load import prepare, read_model, student_wrapper
from kdsweep.models.precision import Precision


def sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules whose parameters and buffers are ``model``'s own tensors (tied weights stay
    tied): wrapping the copy in an adapter changes its modules, never the shared weights."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo=shared)


def students_over_one_base(model_dir: Path, cfgs: list[StudentConfig], dtype: str, device: torch.device, seed: int,
                           dist_cfg: DistConfig | None = None) -> list[nn.Module]:
    """One student per ``cfgs`` entry, each as :func:`~kdsweep.models.load.load_student` would load it on one rank
    (its adapter from ``seed``), over one read of ``model_dir``'s weights that all of them share."""
    full = [i for i, cfg in enumerate(cfgs) if cfg.lora_rank == 0]
    if full:
        raise ValueError(f"a pack's members share the student's frozen base: member {full[0]} has lora_rank=0 "
                         "(a full fine-tune trains the base); give every member a LoRA rank, or run it unpacked")
    base = read_model(model_dir, Precision(dtype).student_dtype(False))
    students = []
    for cfg in cfgs:
        student = student_wrapper(cfg, seed, dtype)(sharing_copy(base))
        prepare(student, dist_cfg or DistConfig(), True)
        students.append(student.to(device))
    return students


def shares_base(students: list[nn.Module]) -> bool:
    """Whether every student's frozen parameters are the same tensors as the first's (a pack holds its base once)."""
    frozen = [{p.data_ptr() for p in s.parameters() if not p.requires_grad} for s in students]
    return all(f == frozen[0] for f in frozen[1:])
