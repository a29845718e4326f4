"""kdsweep's Optuna sweep on the real local SLURM cluster: 2-rank trials, a FAILED job, a trial requeued by SLURM."""

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import kdsweep, read_metrics, read_run
from test_slurm_jobs import ONE_THREAD, sacct_states
from test_sweep import manifest, search, study

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def test_optuna_sweep_of_two_rank_slurm_trials_survives_a_requeue(tmp_path, zoo_dirs):
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "slurm", {
        "n_trials": 3, "max_concurrent": 2, "sampler": "random", "pruner": "none", "poll_s": 0.5,
        "params": {"kd_ratio": "choice(0.3,0.5,0.7)", "train.device": "choice(cpu,cuda)",
                   "train.max_steps": "choice(4,16)"},
        # trial 1 fails inside its job (no CUDA on this machine): SLURM shows it FAILED, the sweep goes on; trial 2
        # only has to start in the slot it frees while trial 0 runs: 4 steps
        "enqueue": [{"kd_ratio": 0.5, "train.device": "cpu", "train.max_steps": 16},
                    {"kd_ratio": 0.3, "train.device": "cuda", "train.max_steps": 16},
                    {"kd_ratio": 0.7, "train.device": "cpu", "train.max_steps": 4}],
    }, {"train": {"max_steps": 16, "eval_every": 8}, "checkpoint": {"save_every": 4, "export_adapter": False,
                                                                      "export_merged": False}})
    cmd = [sys.executable, "-m", "kdsweep", *args, "hydra/launcher=submitit_slurm", "cluster=local_cpu",
           f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not ((sweep_dir / "0" / "metrics.jsonl").exists()
               and any(r["step"] >= 6 for r in read_metrics(sweep_dir / "0") if r["kind"] == "train")):
        assert time.time() < deadline and proc.poll() is None, "trial 0 did not reach step 6"
        time.sleep(0.3)
    job = manifest(sweep_dir)["trials"]["0"]["job"]["slurm_job_id"]
    subprocess.run(["scontrol", "requeue", job], check=True)  # what preemption does to a job
    reference = tmp_path / "reference"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted reference runs while trial 0 waits to be requeued
        reference_done = pool.submit(kdsweep, "hparams_search=slurm", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
                                     "kd_ratio=0.5", *ONE_THREAD, f"hydra.run.dir={reference}", cwd=tmp_path)
        out, _ = proc.communicate(timeout=420)
        reference_done.result()
    assert proc.returncode == 0, out[-3000:]

    trials = study(sweep_dir, "slurm").trials
    assert [(t.number, t.state.name) for t in trials] == [(0, "COMPLETE"), (1, "FAIL"), (2, "COMPLETE")]
    assert "no CUDA device" in trials[1].user_attrs["reason"]  # read from the job's SLURM log
    entries = manifest(sweep_dir)["trials"]
    jobs = [entries[str(n)]["job"]["slurm_job_id"] for n in range(3)]
    assert sacct_states(",".join(jobs)) == dict(zip(jobs, ["COMPLETED", "FAILED", "COMPLETED"]))

    # the requeued trial is the same trial: same SLURM job, not resubmitted, resumed from its checkpoint
    assert jobs[0] == job and entries["0"]["attempts"] == 1
    record = read_run(sweep_dir / "0")
    assert record["world_size"] == 2 and record["status"] == "completed"
    assert [(a["job_id"], a["restart_count"]) for a in record["slurm_attempts"]] == [(job, "0"), (job, "1")]
    # SLURM's SIGTERM made every rank stop at the next step boundary and write a checkpoint there
    assert 6 <= record["start_step"] < 16
    for log in (sweep_dir / "0" / "kdsweep.log", sweep_dir / "0" / "logs" / "rank1.log"):
        text = log.read_text()
        assert "received SIGTERM" in text and f"preempted at step {record['start_step']} (checkpoint written)" in text
    assert [r["step"] for r in read_metrics(sweep_dir / "0") if r["kind"] == "train"] == list(range(1, 17))
    assert set(trials[0].intermediate_values) == {8, 16}
    assert trials[0].values == [pytest.approx(record["objective"])]
    assert read_run(sweep_dir / "2")["world_size"] == 2
    # trial 2 took the slot freed by the failed trial while trial 0 still ran
    assert entries["2"]["started"] < entries["0"]["ended"]

    # the resumed 2-rank SLURM trial equals an uninterrupted local run of the same point
    assert record["objective"] == pytest.approx(read_run(reference)["objective"], abs=1e-5)

    with ThreadPoolExecutor(2) as pool:  # two read-only commands, side by side
        commands = [pool.submit(kdsweep, *args, cwd=tmp_path) for args in (("status", str(sweep_dir)),
                                                                           ("logs", str(sweep_dir), "1"))]
        status, logs = (c.result().stdout for c in commands)
    assert f"slurm {job}" in status and "<- best" in status
    assert f"{jobs[1]}_0_log.err <==" in logs and "no CUDA device" in logs


def test_a_bad_partition_is_one_line(tmp_path):
    args = search(tmp_path, "partition", {"n_trials": 1, "params": {"kd_ratio": "interval(0.0,1.0)"}})
    proc = kdsweep(*args, "hydra/launcher=submitit_slurm", "cluster=local_cpu", "hydra.launcher.partition=nope",
                   f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "SLURM refuses the trials' jobs" in lines[0], proc.stderr
    assert "Invalid partition" in lines[0] and "hydra.launcher" in lines[0]
    assert not (tmp_path / "sweep" / "sweep.json").exists()  # refused before the sweep began
