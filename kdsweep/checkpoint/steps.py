"""Step checkpoints: everything a run needs to continue bit-identically, written atomically.

Layout under ``<run>/checkpoints/``: ``step_00000020/`` holds a ``torch.distributed.checkpoint`` of the
trainable parameters and the optimizer (sharded when the model is), plus ``state_rank<r>.pt`` with the
scheduler, RNG states and counters of each rank. A checkpoint is written into ``.tmp-step_…`` and renamed
when every rank has finished, so a directory named ``step_…`` is always complete; a kill mid-write leaves
only a temp directory, which the next save or load ignores and removes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from kdsweep.config.base import JobError
from kdsweep.distributed import DistEnv, comm
from kdsweep.distributed.waits import from_rank0

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Frozen weights (the LoRA base) come from the model directory, not from checkpoints; loading is therefore
# non-strict about them, while dcp.load itself fails on any trainable key the checkpoint lacks.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


@contextlib.contextmanager
def _single_process_ok() -> Iterator[None]:
    """DCP warns on every single-process save/load; one rank without a process group is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    if not root.is_dir():
        return None
    steps = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
    return steps[-1] if steps else None


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    dist: DistEnv,
    keep_last: int,
) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it) and prune to the last ``keep_last``."""
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"

    def prepare() -> None:  # (a killed save's temp directory may be large to delete)
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    from_rank0(dist, f"prepare the checkpoint {final.name}", prepare)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    try:
        with _single_process_ok():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, no_dist=not dist.active)
        torch.save({**state, "rng": rng_state()}, tmp / f"state_rank{dist.rank}.pt")
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        left, needed = shutil.disk_usage(root).free, comm.nbytes(model_sd) + comm.nbytes(optim_sd)
        shutil.rmtree(tmp, ignore_errors=True)  # never a half checkpoint; and what it wrote is freed for run.json
        full = no_space(e)
        if full is None and (left >= needed or not isinstance(e, (Exception, CheckpointException))):
            raise
        raise disk_full(full, root, final, needed) from e  # (torch's zip writer says ENOSPC as "unexpected pos")
    dist.barrier()  # every rank's files are written

    def put_in_place() -> None:
        if final.exists():  # a rerun reached the same step again: replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _prune(root, keep_last)

    # deleting older checkpoints can take long on a parallel file system: the others wait outside any collective
    from_rank0(dist, f"put the checkpoint {final.name} in place", put_in_place)
    return final


def no_space(error: BaseException) -> OSError | None:
    """The out-of-space OSError (ENOSPC, EDQUOT) behind ``error``, if there is one: its causes, its context, and the
    per-rank failures DCP's CheckpointException carries."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return None


def disk_full(error: OSError | None, root: Path, final: Path, needed: int) -> JobError:
    """One line for a checkpoint the disk had no room for: which file, how much it needed, what is free, the fix."""
    free = shutil.disk_usage(root).free if root.exists() else 0
    last, where = latest(root), getattr(error, "filename", None) or root
    mb = lambda b: f"{b / 2**20:.1f} MB"  # noqa: E731
    return JobError(f"no space left to write the checkpoint {final.name} ({where}): it needs about {mb(needed)} on "
                    f"this rank, {mb(free)} is free in {root}; free some space there (or set output_dir elsewhere) "
                    f"and run the job again: it resumes from {last.name if last is not None else 'the start'}")


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
    for old in steps[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, dist: DistEnv) -> dict[str, Any]:
    """Restore parameters, optimizer and RNG from ``path``; return the saved counters and scheduler state."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    target = {"model": model_sd, "optim": optim_sd}
    with _single_process_ok():
        dcp.load(target, checkpoint_id=path, no_dist=not dist.active)
    set_state_dict(
        model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"], options=_LOAD_OPTIONS
    )
    state = torch.load(path / f"state_rank{dist.rank}.pt", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state
