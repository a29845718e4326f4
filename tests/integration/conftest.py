import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

QUIET = ["logger=quiet"]


def kdsweep(*args: str, cwd: Path, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m kdsweep ARGS`` as a user would, in ``cwd``."""
    proc = subprocess.run(
        [sys.executable, "-m", "kdsweep", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kdsweep {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_run(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def zoo_dirs():
    """The embedded teacher and student directories (built once per cache, like a user's first run)."""
    from kdsweep.models import zoo

    return {"teacher": zoo.model_dir("tiny-teacher"), "student": zoo.model_dir("tiny-student")}
