"""Metric sinks on real runs: W&B offline (read back with wandb's own tool), TensorBoard, resume, the profiler."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run

pytestmark = pytest.mark.slow
WANDB = str(Path(sys.executable).with_name("wandb"))


def wandb_records(offline_run: Path, summary: bool = False) -> list[dict]:
    """What wandb's own reader (``wandb leet inspect``) finds in an offline run."""
    out = subprocess.run([WANDB, "leet", "inspect", *(["--summary"] if summary else []), "--json", str(offline_run)],
                         capture_output=True, text=True, check=True).stdout
    return [json.loads(out)] if summary else [json.loads(line) for line in out.splitlines() if line.strip()]


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


RUN = ["kd_ratio=0.5", "train.max_steps=12", "train.eval_every=4", "checkpoint.save_every=4",
       "checkpoint.export_merged=false", "logger.wandb.enabled=true", "logger.tensorboard=true", *QUIET]


def start_and_wait(cmd, cwd, env, run_dir, step):
    """Start the job; return it once metrics.jsonl shows ``step``."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while not ((run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in read_metrics(run_dir))):
        assert time.time() < deadline and proc.poll() is None, f"the run did not reach step {step}"
        time.sleep(0.1)
    return proc


def test_wandb_and_tensorboard_histories_survive_kill_and_preemption(tmp_path, zoo_dirs):
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_API_KEY": "fake-key-0123456789abcdef0123456789abcdef01234567"}
    cmd = [sys.executable, "-m", "kdsweep", *RUN, f"hydra.run.dir={run_dir}"]
    # attempt 1: killed without warning after step 5 (last checkpoint: step 4)
    proc = start_and_wait(cmd, tmp_path, env, run_dir, 5)
    proc.kill()
    proc.communicate(timeout=60)
    # attempt 2: resumes at step 4, gets SLURM's warning signal after step 6, checkpoints at the next step, stops
    proc = start_and_wait(cmd, tmp_path, env, run_dir, 6)
    proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and read_run(run_dir)["status"] == "preempted", out[-2000:]
    assert "W&B offline (" in out and "wandb sync" in out  # no network here: auto mode went offline, said so
    stopped = read_run(run_dir)["steps"]
    assert 6 <= stopped < 12
    # attempt 3 (the requeued job): the same command on the same directory resumes from that checkpoint
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = read_run(run_dir)
    assert record["status"] == "completed" and record["start_step"] == stopped and record["attempts"] == 3

    # W&B: one run id for all attempts; the clean attempts hold every step once, in order
    attempts = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(attempts) == 3 and {a.name.split("-", 3)[-1] for a in attempts} == {record["wandb"]["id"]}
    assert record["wandb"]["mode"] == "offline"
    killed, *clean = [[r["history"]["item"] for r in wandb_records(a) if r["type"] == "history"] for a in attempts]
    history = [row for rows in clean for row in rows]
    assert [row["_step"] for row in history] == list(range(0, 13))  # what the killed attempt lost was replayed
    assert [row["_step"] for row in history if "eval/student_ce" in row] == [0, 4, 8, 12]
    assert all({"train/loss", "train/ce", "train/kd", "train/kl", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/tokens_per_s_per_rank", "train/peak_mem_mb"} <= set(row) for row in history if row["_step"])
    jsonl = {r["step"]: r for r in read_metrics(run_dir) if r["kind"] == "train"}
    assert [row["train/loss"] for row in history[1:]] == pytest.approx([jsonl[s]["loss"] for s in range(1, 13)])
    last = wandb_records(attempts[-1], summary=True)[0]
    assert last["summary"]["objective"] == pytest.approx(record["objective"])
    assert last["summary"]["eval/student_ce"] == pytest.approx(record["eval_after"]["student_ce"])
    assert last["config"]["loss"]["kd_ratio"] == 0.5 and last["config"]["train"]["max_steps"] == 12
    assert last["name"] == "run" and last["state"] == "finished"

    # TensorBoard: each resumed writer purged what the attempt before wrote after its checkpoint
    assert tensorboard_steps(run_dir, "train/loss") == list(range(1, 13))
    assert tensorboard_steps(run_dir, "eval/student_ce") == [0, 4, 8, 12]

    # the fake key is nowhere on disk
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and env["WANDB_API_KEY"].encode() in p.read_bytes()]


@pytest.fixture(scope="module")
def grid(tmp_path_factory, zoo_dirs):
    """A Hydra grid of two smoke runs (W&B on, the profiler over steps 2-3), both run by one process: the grid
    test reads their W&B runs, the profiler test their traces."""
    sweep = tmp_path_factory.mktemp("grid") / "grid"
    kdsweep("-m", "kd_ratio=0.3,0.7", "train=smoke", "logger.wandb.enabled=true", "profiler.enabled=true",
            "profiler.wait=1", "profiler.warmup=1", "profiler.active=2", "checkpoint.export_merged=false", *QUIET,
            f"hydra.sweep.dir={sweep}", cwd=sweep.parent)
    return sweep


def test_profiled_run_writes_a_chrome_trace(grid):
    for run_dir in (grid / "0", grid / "1"):  # the second job of the process too
        trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())  # chrome://tracing's format
        events = trace["traceEvents"]
        assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")} == {"ProfilerStep#2", "ProfilerStep#3"}
        assert any(e.get("ph") == "X" and e.get("name", "").startswith("aten::") for e in events)  # real ops, timed
        assert read_run(run_dir)["status"] == "completed"


def test_a_hydra_grid_groups_its_runs_by_sweep_directory(grid):
    sweep = grid
    runs = []
    for job in ("0", "1"):
        (attempt,) = (sweep / job / "wandb").glob("offline-run-*")
        (run,) = [r["run"] for r in wandb_records(attempt) if r["type"] == "run"]
        runs.append(run)
        assert read_run(sweep / job)["wandb"]["group"] == str(sweep)
    assert {r["run_group"] for r in runs} == {str(sweep)} and len({r["run_id"] for r in runs}) == 2
