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
    return out.stdout.strip() or None if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    return {"git_sha": git_sha(), "packages": package_versions(), "host": platform.node(), "pid": os.getpid()}


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class RunRecord:
    """The run's ``run.json``, rewritten atomically whenever its status changes."""

    def __init__(self, path: Path, config: dict[str, Any], overrides: list[str]) -> None:
        self.path = path
        previous = json.loads(path.read_text()) if path.exists() else {}
        self.data: dict[str, Any] = {
            "status": "running",
            "config": config,
            "overrides": overrides,
            "environment": environment(),
            "attempts": previous.get("attempts", 0) + 1,
        }

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        write_json_atomic(self.path, self.data)
