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


REPO = Path(__file__).resolve().parents[2]
SLURM_ROOT = Path(os.environ.get("KDSWEEP_SLURM_ROOT", "/tmp/kdsweep-slurm"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """The real one-machine SLURM cluster of launchers/slurm, up (idempotently) for every test that asks."""
    up = subprocess.run(["bash", str(REPO / "launchers/slurm/up.sh")], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}"
    # SLURM_CONF and PATH (the sacct shim first) from env.sh, for this process and so for submitit's calls.
    env = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\n%s" "$SLURM_CONF" "$PATH"', "_",
                          str(SLURM_ROOT / "env.sh")], capture_output=True, text=True, check=True).stdout
    conf, path = env.split("\n", 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        mp.setenv("PATH", path)
        yield SLURM_ROOT
