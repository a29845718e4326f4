"""`python -m kdsweep` from an installed wheel: the conf/ tree and the corpus ship inside the package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_run

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_wheel_ships_conf_and_runs(tmp_path, zoo_dirs):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(REPO)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("kdsweep-*.whl")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    assert (site / "kdsweep" / "conf" / "config.yaml").is_file()
    assert (site / "kdsweep" / "data" / "corpus" / "kjv.txt").is_file()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the wheel's copy shadows the checkout
    where = subprocess.run([sys.executable, "-c", "import kdsweep.app as a; print(a.__file__); print(a.conf_dir())"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert all(p.startswith(str(site)) for p in where), where
    run_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "kdsweep", "train=smoke", "train.max_steps=1", "logger=quiet",
                    "checkpoint.export_merged=false", f"hydra.run.dir={run_dir}"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert read_run(run_dir)["status"] == "completed"
