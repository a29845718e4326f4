import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zygote

QUIET = ["logger=quiet"]


def kdsweep(*args: str, cwd: Path, check: bool = True, timeout: float = 600,
            env_extra: dict[str, str] | None = None, fresh: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m kdsweep ARGS`` as a user would, in ``cwd`` (``env_extra``: more environment variables)."""
    proc = python_m(["kdsweep", *args], cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})},
                    timeout=timeout, fresh=fresh)
    if check and proc.returncode != 0:
        raise AssertionError(f"kdsweep {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def python_m(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 600,
             fresh: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([python, "-m", *args], capture_output=True, text=True)``, forked from a zygote that has
    done a job's imports (tests/zygote.py) unless ``fresh``: a test about how the process starts."""
    argv = ["-m", *args]
    proc = None if fresh else zygote.run(argv, cwd, env, timeout)
    if proc is None:
        proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return proc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_run(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture(scope="session")
def zoo_dirs():
    """The embedded teacher and student directories (built once per cache, like a user's first run)."""
    from kdsweep.models import zoo

    return {"teacher": zoo.model_dir("tiny-teacher"), "student": zoo.model_dir("tiny-student")}


@pytest.fixture(scope="session")
def other_teacher(zoo_dirs):
    """The second embedded teacher (its build began in the background at the session's start: tests/conftest.py)."""
    from kdsweep.models import zoo

    return zoo.model_dir("tiny-teacher-other")


REPO = Path(__file__).resolve().parents[2]
SLURM_ROOT = Path(os.environ.get("KDSWEEP_SLURM_ROOT", "/tmp/kdsweep-slurm"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """The real one-machine SLURM cluster of launchers/slurm, up (idempotently) for every test that asks."""
    with open(f"{SLURM_ROOT}.up.lock", "w") as lock:  # the other xdist worker may be bringing it up right now
        fcntl.flock(lock, fcntl.LOCK_EX)
        up = subprocess.run(["bash", str(REPO / "launchers/slurm/up.sh")], capture_output=True, text=True, timeout=600)
        assert up.returncode == 0, f"up.sh failed:\n{up.stdout}\n{up.stderr}"
        # SLURM_CONF and PATH (the sacct shim first) from env.sh (up.sh rewrites it), for this process and so for
        # submitit's calls.
        env = subprocess.run(["bash", "-c", 'source "$1" && printf "%s\\n%s" "$SLURM_CONF" "$PATH"', "_",
                              str(SLURM_ROOT / "env.sh")], capture_output=True, text=True, check=True).stdout
    conf, path = env.split("\n", 1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", conf)
        mp.setenv("PATH", path)
        yield SLURM_ROOT


@pytest.fixture(scope="session")
def postgres_server():
    """The real PostgreSQL server of launchers/postgres, up (idempotently); yields the URL of its `kdsweep`
    database, password included (TCP logins need it)."""
    up = subprocess.run(["bash", str(REPO / "launchers/postgres/up.sh")], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, f"launchers/postgres/up.sh failed:\n{up.stderr}"
    env = dict(line.split("=", 1) for line in up.stdout.splitlines() if "=" in line)
    yield env["KDSWEEP_TEST_PG_URL"]


def tiny_sweep(tmp_path: Path, study_name: str, *args: str, check: bool = True):
    """A real 2-trial Optuna sweep of 2-step jobs in ``tmp_path/sweep`` (study ``study_name``); ARGS are extra
    overrides. Returns the sweep directory and the finished process."""
    import yaml

    body = {"defaults": [{"override /hydra/sweeper": "kdsweep_optuna"}],
            "train": {"eval_every": 2, "max_steps": 2}, "logger": {"progress_bar": False},
            "checkpoint": {"save_every": 0, "export_adapter": False, "export_merged": False},
            "hydra": {"sweeper": {"study_name": study_name, "poll_s": 0.2, "n_trials": 2, "max_concurrent": 2,
                                  "sampler": "random", "pruner": "none", "params": {"kd_ratio": "interval(0.0,1.0)"}}}}
    conf = tmp_path / "conf" / "hparams_search"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / f"{study_name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(body))
    sweep_dir = tmp_path / "sweep"
    proc = kdsweep("-m", f"hparams_search={study_name}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                   f"hydra.sweep.dir={sweep_dir}", *QUIET, *args, cwd=tmp_path, check=check)
    return sweep_dir, proc
