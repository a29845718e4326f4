"""What the ranks of a job on several nodes agree on: the master's port before they connect, and after, that they
all see the directories the job writes and reads (its run directory, the caches).

Both go through a directory every node mounts (``$KDSWEEP_CACHE``, which the tokenization and teacher caches need
shared anyway), so a cluster whose nodes do not share it fails at once, in one line naming the path.
"""

from __future__ import annotations

import os
import platform
import socket
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from kdsweep.distributed.env import DistEnv

PORT_TRIES = 200


def _free_from(port: int) -> int:
    """``port`` if nothing listens on it on this host, else the next free one."""
    for candidate in range(port, port + PORT_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", candidate))
                return candidate
            except OSError:
                continue
    raise OSError(f"no free port in {port}..{port + PORT_TRIES - 1}")


def port_file(shared: Path, environ: Mapping[str, str]) -> Path:
    """Where a SLURM step's master port is published: one file per job, step and restart."""
    job, step = environ.get("SLURM_JOB_ID", "0"), environ.get("SLURM_STEP_ID", "0")
    return shared / "rendezvous" / f"{job}.{step}.{environ.get('SLURM_RESTART_COUNT', '0')}.port"


def agree_port(env: DistEnv, shared: Path, timeout_s: float, environ: Mapping[str, str] | None = None) -> DistEnv:
    """Under SLURM: rank 0 keeps the port derived from the job and step ids when it is free on its host, else
    takes the next free one, and publishes it in ``shared``; every other rank reads it there. (torchrun names
    its own master port; one rank needs none.)"""
    from kdsweep.config.schema import ConfigError

    environ = os.environ if environ is None else environ
    if env.source != "slurm":
        return env
    path = port_file(shared, environ)
    if env.is_main:
        port = _free_from(env.master_port)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_text(str(port))
        os.replace(tmp, path)
        return replace(env, master_port=port)
    deadline = time.time() + timeout_s
    while not path.exists():
        if time.time() > deadline:
            raise ConfigError(
                f"rank {env.rank} on {platform.node()} found no master port in {path} after {timeout_s:.0f} s: "
                f"{shared} must be a directory every node of the job sees (set KDSWEEP_CACHE to one)"
            )
        time.sleep(0.2)
    return replace(env, master_port=int(path.read_text()))


def release_port(env: DistEnv, shared: Path, environ: Mapping[str, str] | None = None) -> None:
    """Once every rank has connected (nobody reads it any more), rank 0 removes the published port."""
    if env.source == "slurm" and env.is_main:
        port_file(shared, os.environ if environ is None else environ).unlink(missing_ok=True)


def check_shared(env: DistEnv, paths: dict[str, Path]) -> None:
    """One line when a rank does not see a file rank 0 wrote in one of ``paths`` (``{what: directory}``): a run
    directory or cache local to each node would otherwise fail late and obscurely. A collective."""
    from kdsweep.config.schema import ConfigError

    if env.world_size == 1:
        return
    token = env.broadcast_object(uuid.uuid4().hex if env.is_main else None)
    marks = {what: Path(p) / f".kdsweep-ranks-{token}" for what, p in paths.items()}
    if env.is_main:
        for mark in marks.values():
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.write_text(token)
    env.barrier()
    unseen = [what for what, mark in marks.items() if not mark.exists()]
    everyone = env.gather_objects((env.rank, platform.node(), unseen))
    env.barrier()
    if env.is_main:
        for mark in marks.values():
            mark.unlink(missing_ok=True)
    for rank, host, missing in everyone:
        if missing:
            raise ConfigError(
                f"{paths[missing[0]]} ({missing[0]}) is not shared by the job's nodes: rank {rank} on {host} does "
                "not see what rank 0 wrote there; put it on a file system every node mounts"
            )
