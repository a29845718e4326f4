"""kill -9 of a running job at a random step, rerun of the same command: it ends exactly as an uninterrupted run."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run

pytestmark = pytest.mark.slow

ARGS = ["train.max_steps=12", "train.eval_every=4", "checkpoint.save_every=3", "checkpoint.export_merged=false", *QUIET]


def _wait_for_step(run_dir, step, proc, deadline):
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job ended before step {step}: {proc.stderr.read()}")
        path = run_dir / "metrics.jsonl"
        if path.exists():
            rows = [r for r in read_metrics_safe(path) if r["kind"] == "train"]
            if rows and rows[-1]["step"] >= step:
                return rows[-1]["step"]
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in time")


def read_metrics_safe(path):
    import json

    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return out


def test_kill_9_then_rerun_gives_the_uninterrupted_objective(tmp_path, zoo_dirs):
    reference = tmp_path / "reference"
    kdsweep(*ARGS, f"hydra.run.dir={reference}", cwd=tmp_path)
    expected = read_run(reference)["objective"]

    kill_at = random.Random(time.time_ns()).randint(4, 10)
    print(f"killing at step {kill_at}")
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "kdsweep", *ARGS, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    reached = _wait_for_step(run_dir, kill_at, proc, time.time() + 300)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_run(run_dir)["status"] == "running"  # it really died mid-run
    assert not (run_dir / "final").exists()

    kdsweep(*ARGS, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["attempts"] == 2
    # resumed from the last complete checkpoint: the one before the last logged step at least (a step's row is
    # written before its checkpoint, so the kill may have hit that checkpoint half-written)
    assert record["start_step"] % 3 == 0 and 3 * ((reached - 1) // 3) <= record["start_step"] < 12
    assert record["objective"] == pytest.approx(expected, abs=1e-6), (kill_at, reached, record["start_step"])
    steps = [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 13)), "the history must have every step once"
    ref_rows = [r for r in read_metrics(reference) if r["kind"] == "train"]
    got_rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [round(r["loss"], 6) for r in got_rows] == [round(r["loss"], 6) for r in ref_rows]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000009", "step_00000012"]
