"""Start N local ranks of a job through torch's elastic launcher, after checking they can start at all."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kdsweep.config.schema import ConfigError, DistConfig, RanksFailed
from kdsweep.distributed.env import LOCAL_RANKS, RANKS_PER_NODE
from kdsweep.startup import RANK_IMPORTS


def available_devices(device: torch.device) -> tuple[int, str]:
    """(how many ranks this machine can host, what they are)."""
    if device.type == "cuda":
        return torch.cuda.device_count(), "GPUs"
    return len(os.sched_getaffinity(0)), "CPUs"


def check_local_launch(cfg: DistConfig, device: torch.device) -> None:
    """One line for the ways a local multi-rank launch would fail after starting."""
    have, what = available_devices(device)
    per_node = int(os.environ.get(RANKS_PER_NODE) or cfg.nproc_per_node)  # simulated nodes: each must fit
    if min(per_node, cfg.nproc_per_node) > have:
        raise ConfigError(
            f"dist.nproc_per_node={cfg.nproc_per_node} but this machine has {have} {what}; "
            f"pass dist.nproc_per_node=<at most {have}>"
        )
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((cfg.master_addr, cfg.master_port))
    except OSError as e:
        raise ConfigError(
            f"dist.master_addr={cfg.master_addr}:{cfg.master_port} cannot be bound on this machine "
            f"({e.strerror or e}); local ranks rendezvous on this machine: pass dist.master_addr=127.0.0.1 "
            "(and dist.master_port=0 for any free port)"
        ) from None


def check_master_resolves(addr: str) -> None:
    """Under torchrun or SLURM the launcher names the master; an unresolvable name would only time out later."""
    try:
        socket.getaddrinfo(addr, None)
    except OSError as e:
        raise ConfigError(
            f"the master address {addr!r} (MASTER_ADDR / the job's first node) does not resolve ({e.strerror or e}); "
            "fix MASTER_ADDR or the node list the launcher passes"
        ) from None


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _fresh_forkserver() -> Iterator[None]:
    """The ranks are forked from a server started for this launch (multiprocessing's forkserver), which imports
    :data:`RANK_IMPORTS` once for all of them: a rank started by ``spawn`` imports them itself (seconds of CPU per
    rank). Not forked from this process: in a multirun it may already have trained a job, and a fork after OpenMP
    kernels ran can deadlock the child's first matmul. The server is this launch's (started with this process's
    environment and directory now, as spawn's ranks would be) and is stopped after it."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    forkserver._forkserver._stop()  # noqa: SLF001 - one a previous launch left (stopped below) or none
    try:
        yield
    finally:
        forkserver._forkserver._stop()  # noqa: SLF001


def _importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as the forked ranks can unpickle it: a function of ``python -m pkg.mod``'s ``__main__`` is
    ``pkg.mod``'s (the forkserver's ``__main__`` is its own)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if fn.__module__ == "__main__" and spec is not None:
        return getattr(importlib.import_module(spec.name), fn.__qualname__)
    return fn


def spawn(fn: Callable[..., Any], args: tuple, cfg: DistConfig, run_dir: Path | None = None) -> Any:
    """Run ``fn(*args)`` in ``cfg.nproc_per_node`` local ranks (RANK, WORLD_SIZE, ... set); rank 0's return value.

    If any rank fails, the others are stopped at once (whatever collective they wait in) and the launch raises
    :class:`RanksFailed` with the line the failed ranks' records in ``run_dir`` make (``distributed.failure``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from kdsweep.metrics.records import describe_failure, rank_failures

    port = cfg.master_port or _free_port(cfg.master_addr)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc_per_node, run_id=f"kdsweep-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static", rdzv_endpoint=f"{cfg.master_addr}:{port}", rdzv_configs={"rank": 0},
        max_restarts=0, monitor_interval=0.1,
        start_method="forkserver",  # see _fresh_forkserver
    )
    os.environ[LOCAL_RANKS] = "1"  # the ranks inherit it: they know dist.nproc_per_node started them, not torchrun
    # a rank that ends itself after a failure (distributed.failure) leaves the launcher's semaphores to the resource
    # tracker, which would print a warning below the job's one line
    quiet = "ignore:::multiprocessing.resource_tracker"
    if quiet not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))
    agent_log = logging.getLogger("torch.distributed.elastic")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)  # its report of a failed rank is a table and a traceback: the line says it
    try:
        with _fresh_forkserver():
            return elastic_launch(launch, _importable(fn))(*args)[0]
    except ChildFailedError as e:
        found = rank_failures(run_dir) if run_dir is not None else []
        if not found:
            codes = sorted({f.exitcode for f in e.failures.values()})
            raise RanksFailed(f"rank(s) {sorted(e.failures)} of the job ended with exit code(s) {codes} before they "
                              f"could say why" + (f"; see {run_dir / 'logs'}" if run_dir else ""), False) from None
        raise RanksFailed(describe_failure(found[0]), bool(found[0].get("config_error"))) from None
    finally:
        agent_log.setLevel(level)
        os.environ.pop(LOCAL_RANKS, None)
