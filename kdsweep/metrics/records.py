"""``run.json``: what ran, how it ended, and where it came from."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("kdsweep", "torch", "transformers", "peft", "hydra-core", "safetensors", "tokenizers")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_sha() -> str | None:
    """The commit of the kdsweep checkout this code runs from (None for an installed wheel)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


SLURM_VARS = {
    "job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID", "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT", "nodelist": "SLURM_JOB_NODELIST", "ntasks": "SLURM_NTASKS",
    "partition": "SLURM_JOB_PARTITION",
}


def slurm() -> dict[str, str] | None:
    """The SLURM job this attempt runs in (a requeued job keeps its id and counts SLURM_RESTART_COUNT up)."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    info = {k: os.environ[v] for k, v in SLURM_VARS.items() if v in os.environ}
    info.setdefault("restart_count", "0")
    return info


def environment() -> dict[str, Any]:
    return {
        "git_sha": git_sha(), "packages": package_versions(), "host": platform.node(), "pid": os.getpid(),
        "slurm": slurm(),
    }


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class RunRecord:
    """The run's ``run.json``, rewritten atomically whenever its status changes."""

    def __init__(self, path: Path, config: dict[str, Any], overrides: list[str], world_size: int = 1) -> None:
        self.path = path
        previous = json.loads(path.read_text()) if path.exists() else {}
        env = environment()
        self.data: dict[str, Any] = {
            "status": "running",
            "config": config,
            "overrides": overrides,
            "world_size": world_size,
            "environment": env,
            "attempts": previous.get("attempts", 0) + 1,
            # every attempt's SLURM job (ids stay across requeues; restart counts do not)
            "slurm_attempts": previous.get("slurm_attempts", []) + ([env["slurm"]] if env["slurm"] else []),
        }

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        write_json_atomic(self.path, self.data)
