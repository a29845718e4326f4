"""kdsweep's Optuna sweeper on real trials: async refill, pruning (2 ranks), failures, resume, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import yaml

from conftest import kdsweep
from helpers import once, with_sitecustomize

pytestmark = pytest.mark.slow


def search(tmp_path, name, sweeper: dict, overrides: dict | None = None) -> list[str]:
    """Write hparams_search/<name>.yaml beside the test and return the arguments that select it."""
    body = {"defaults": [{"override /hydra/sweeper": "kdsweep_optuna"}],
            "train": {"eval_every": 2}, "logger": {"progress_bar": False},
            "checkpoint": {"save_every": 0, "export_adapter": False, "export_merged": False},
            "hydra": {"sweeper": {"study_name": name, "poll_s": 0.2, **sweeper}}, **(overrides or {})}
    (tmp_path / "conf" / "hparams_search").mkdir(parents=True, exist_ok=True)
    (tmp_path / "conf" / "hparams_search" / f"{name}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(body))
    return ["-m", f"hparams_search={name}", f"hydra.searchpath=[file://{tmp_path / 'conf'}]"]


AT_EXIT = """import atexit, json, os, sys
if sys.argv[1:2] == ["-m"]:  # the sweep's controller, not its trials
    atexit.register(lambda: open(os.environ["KDSWEEP_TEST_MODULES"], "w").write(
        json.dumps({name: name in sys.modules for name in ("torch", "optuna")})))
"""


def said_at_exit(tmp_path) -> dict[str, str]:
    """The environment that has the controller write, as it exits, which of torch and optuna it imported."""
    return {**with_sitecustomize(tmp_path / "at_exit_site", AT_EXIT),
            "KDSWEEP_TEST_MODULES": str(tmp_path / "controller_modules.json")}


def manifest(sweep_dir) -> dict:
    return json.loads((sweep_dir / "sweep.json").read_text())


def study(sweep_dir, name):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{sweep_dir / 'optuna.db'}")


def test_a_freed_slot_is_refilled_while_the_long_trial_runs(tmp_path, zoo_dirs):
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "refill", {
        "n_trials": 4, "max_concurrent": 2, "sampler": "random", "pruner": "none",
        "params": {"train.max_steps": "choice(1,80)"},
        "enqueue": [{"train.max_steps": 80}, {"train.max_steps": 1}, {"train.max_steps": 1}, {"train.max_steps": 1}],
    }, {"train": {"eval_every": 20}})  # the long trial's steps, not its evaluations, keep its slot
    kdsweep(*args, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, env_extra=said_at_exit(tmp_path))
    # the controller (`-m`) plans, starts, polls and judges trials without torch (seconds of a process's imports)
    assert json.loads((tmp_path / "controller_modules.json").read_text()) == {"torch": False, "optuna": True}
    trials = {int(n): t for n, t in manifest(sweep_dir)["trials"].items()}
    assert [trials[n]["state"] for n in range(4)] == ["COMPLETE"] * 4
    long = trials[0]
    assert long["params"]["train.max_steps"] == 80
    assert [trials[n]["params"]["train.max_steps"] for n in (1, 2, 3)] == [1, 1, 1]
    for n in (2, 3):  # each started when a short trial ended, while the long one was still running
        previous_end = max(t["ended"] for t in trials.values() if t["ended"] <= trials[n]["started"])
        assert trials[n]["started"] - previous_end < 3.0
        assert trials[n]["started"] < long["ended"]
    assert trials[3]["ended"] < long["ended"]  # all three short trials ran beside the long one


def test_pruned_two_rank_trial_stops_on_every_rank(tmp_path, zoo_dirs):
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "prune", {
        "n_trials": 2, "max_concurrent": 1, "sampler": "random", "pruner": "median", "pruner_startup_trials": 1,
        "pruner_warmup_steps": 0, "params": {"lr": "tag(log, interval(1e-7,1e-1))"},
        "enqueue": [{"lr": 0.01}, {"lr": 1e-7}],  # a working lr first, then one that cannot learn
    }, {"train": {"eval_every": 2, "max_steps": 8}, "dist": {"nproc_per_node": 2}})
    kdsweep(*args, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    trials = study(sweep_dir, "prune").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED"]
    assert set(trials[0].intermediate_values) == {2, 4, 6, 8} and set(trials[1].intermediate_values) == {2}
    run = sweep_dir / "1"
    assert json.loads((run / "run.json").read_text())["status"] == "pruned"
    rank1 = subprocess.run([sys.executable, "-m", "kdsweep", "logs", str(sweep_dir), "1", "--rank", "1"],
                           capture_output=True, text=True)
    assert rank1.returncode == 0 and "pruned at step 2" in rank1.stdout
    missing = subprocess.run([sys.executable, "-m", "kdsweep", "logs", str(sweep_dir), "7"], capture_output=True, text=True)
    assert missing.returncode == 2 and "trial 7 is not in" in missing.stderr
    for log in (run / "kdsweep.log", run / "logs" / "rank1.log"):
        assert "pruned at step 2 (checkpoint written)" in log.read_text(), log
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2]




def faults_sweep(tmp_path_factory):
    """3 trials of 2 steps, 2 at a time: the first asks for CUDA (none here), the other two run on the CPU. Returns
    the sweep directory and the finished sweep's process.

    Built once per session (helpers.once): test_dashboard.py renders this sweep too."""
    def build():
        tmp_path = tmp_path_factory.mktemp("faults")
        sweep_dir = tmp_path / "sweep"
        args = search(tmp_path, "faults", {
            "n_trials": 3, "max_concurrent": 2, "sampler": "random", "pruner": "none",
            "params": {"train.device": "choice(cpu,cuda)"},
            "enqueue": [{"train.device": "cuda"}, {"train.device": "cpu"}, {"train.device": "cpu"}],
        }, {"train": {"eval_every": 2, "max_steps": 2}})
        return sweep_dir, kdsweep(*args, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)

    return once("faults_sweep", build)


def test_a_failing_trial_is_fail_with_its_reason_and_the_sweep_goes_on(tmp_path_factory, zoo_dirs):
    sweep_dir, proc = faults_sweep(tmp_path_factory)
    trials = study(sweep_dir, "faults").trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert "no CUDA device" in trials[0].user_attrs["reason"]
    assert "FAIL" in proc.stdout and "no CUDA device" in proc.stdout


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, zoo_dirs):
    """A 4-trial sweep of one job per trial (workers=0; test_workers kills one with busy workers) whose controller
    was killed (kill -9) once a trial had completed while another ran, then
    resumed (`kdsweep resume`): what the manifest held then, and the resume's run. The changed-space test below
    reruns its command too. Its directory is on what the mounts table (KDSWEEP_MOUNTS: this machine's, and one line
    more) says is an NFS mount, so the sweep's default storage is a journal file."""
    tmp_path = tmp_path_factory.mktemp("resume")
    sweep_dir = tmp_path / "sweep"
    mounts = tmp_path / "mounts"
    mounts.write_text(Path("/proc/mounts").read_text() + f"server:/export/kd {tmp_path} nfs4 rw,relatime 0 0\n")
    env = {**os.environ, "KDSWEEP_MOUNTS": str(mounts)}
    args = search(tmp_path, "resume", {
        "n_trials": 4, "max_concurrent": 2, "workers": 0, "sampler": "tpe", "seed": 3, "pruner": "none",
        "params": {"kd_ratio": "interval(0.0,1.0)"},
    }, {"train": {"eval_every": 4, "max_steps": 8}})
    cmd = [sys.executable, "-m", "kdsweep", *args, f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 300
    while True:
        assert time.time() < deadline and proc.poll() is None, "no trial finished in time"
        if (sweep_dir / "sweep.json").exists():
            states = [t["state"] for t in manifest(sweep_dir)["trials"].values()]
            if "COMPLETE" in states and "RUNNING" in states:
                break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {n: t for n, t in manifest(sweep_dir)["trials"].items() if t["state"] == "COMPLETE"}
    running = {n: t["job"]["pid"] for n, t in manifest(sweep_dir)["trials"].items() if t["state"] == "RUNNING"}

    out = subprocess.run([sys.executable, "-m", "kdsweep", "resume", str(sweep_dir)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env=env)
    return SimpleNamespace(tmp_path=tmp_path, sweep_dir=sweep_dir, args=args, before=before, running=running, out=out)


def test_resume_after_kill_9_of_the_controller(resumed):
    sweep_dir, before, running, out = resumed.sweep_dir, resumed.before, resumed.running, resumed.out
    assert out.returncode == 0, out.stderr[-3000:]
    after = manifest(sweep_dir)["trials"]
    assert sorted(int(n) for n in after) == [0, 1, 2, 3]  # numbering continued, budget honoured
    assert all(t["state"] == "COMPLETE" for t in after.values())
    for n, t in before.items():  # nothing finished was lost or redone
        assert after[n]["values"] == t["values"] and after[n]["ended"] == t["ended"]
    for n, pid in running.items():  # the jobs still running were re-attached to, not restarted
        assert after[n]["job"]["pid"] == pid and after[n]["attempts"] == 1
    points = [tuple(sorted(t["params"].items())) for t in after.values()]
    assert len(set(points)) == len(points)  # the resumed sampler proposed no old point again
    # the default storage on a shared filesystem: a journal file, recorded with why
    assert manifest(sweep_dir)["storage"] == {
        "url": f"journal://{sweep_dir / 'optuna.journal'}",
        "why": "a journal file: the sweep directory is on nfs4, where SQLite's locks are unsafe"}
    assert not (sweep_dir / "optuna.db").exists()
    from optuna.storages.journal import JournalFileBackend

    journal = optuna.storages.JournalStorage(JournalFileBackend(str(sweep_dir / "optuna.journal")))
    trials = optuna.load_study(study_name="resume", storage=journal).trials
    assert len(trials) == 4 and [t.number for t in trials] == [0, 1, 2, 3]
    status = subprocess.run([sys.executable, "-m", "kdsweep", "status", str(sweep_dir)], capture_output=True, text=True)
    assert status.returncode == 0 and status.stdout.count("COMPLETE") == 4 and "<- best" in status.stdout


BAD = {
    "pruner": (["hydra.sweeper.pruner=sometimes"], "hydra.sweeper.pruner='sometimes' is unknown"),
    "sampler": (["hydra.sweeper.sampler=cmaes2"], "hydra.sweeper.sampler='cmaes2' is unknown"),
    "integer_interval": (["kd_ratio=interval(0,1)"], "integer bounds make an integer space"),
    "bad_point": (["kd_ratio=interval(0.0,1.5)"], "loss.kd_ratio=1.5 is outside [0, 1]"),
    "storage": (["hydra.sweeper.storage=sqlite:////no/such/dir/x.db"], "cannot be reached"),
    "launcher": (["hydra/launcher=submitit_local"], "hydra.launcher=LocalLauncher cannot run kdsweep's trials"),
    "budget": (["hydra.sweeper.budget=0", "hydra.sweeper.n_trials=null"], "hydra.sweeper.budget=0.0 must be > 0 hours"),
    "budget_one_trial": (["hydra.sweeper.budget=0.001", "hydra.sweeper.trial_hours=0.01", "hydra.sweeper.n_trials=null",
                          "hydra.sweeper.confirm.top=0"],
                         "hydra.sweeper.budget=0.001 device-h cannot pay for one trial of hydra.sweeper.trial_hours=0.01"),
    "confirm_top": (["hydra.sweeper.budget=0.1", "hydra.sweeper.trial_hours=0.01", "hydra.sweeper.n_trials=null",
                     "hydra.sweeper.confirm.top=2"], "hydra.sweeper.confirm.top=2 is more than the trials the budget allows"),
    "confirm_pareto": (["hydra.sweeper.objectives=[student_ce,kl]", "hydra.sweeper.directions=[minimize,minimize]",
                        "hydra.sweeper.confirm.top=1"], "must name the one it ranks on: hydra.sweeper.confirm.objective="),
    "lm_eval_task": (["hydra.sweeper.objectives=[lm_eval/no_such_task]", "hydra.sweeper.directions=[maximize]"],
                     "hydra.sweeper's lm_eval/no_such_task: lm-eval knows no task 'no_such_task'; use "
                     "kdsweep_next_word (shipped)"),
    "lm_eval_own_tasks": (["hydra.sweeper.confirm.also=[lm_eval/kdsweep_next_word]",
                           "downstream.tasks=[kdsweep_next_word]"],
                          "downstream.tasks=['kdsweep_next_word']: the sweep scores its trials on "
                          "lm_eval/kdsweep_next_word (hydra.sweeper.objectives, confirm.also) and sets "
                          "downstream.tasks itself; drop it from the command line"),
    "confirm_no_test": (["data.test_fraction=0"], "and that job is refused: train.eval_test=true but data has no "
                        "test split; set data.test_fraction=0.05 (or data.test_datasets); or pass "
                        "hydra.sweeper.confirm.top=0"),
    "pack_too_big": (["hydra.sweeper.pack=3", "hydra.sweeper.max_concurrent=2"],
                     "hydra.sweeper.pack=3: give the trials per packed job, from 2 to max_concurrent (2"),
    "pack_shared_knob": (["hydra.sweeper.pack=2", "train.max_steps=choice(4,8)"],
                         "hydra.sweeper.pack=2 trains the trials in packs, which this search cannot: point 8 sets "
                         "train.max_steps=4 and point 0 train.max_steps=40"),
    "pack_full_fine_tune": (["hydra.sweeper.pack=2", "lora_rank=choice(0,8)"],
                            "has model.lora_rank=0: a full fine-tune"),
    "pack_ranks": (["hydra.sweeper.pack=2", "dist.nproc_per_node=2"],
                   "hydra.sweeper.pack=2: a sweep's packs train on one rank for now, not dist.nproc_per_node=2"),
    "pack_wont_fit": (["hydra.sweeper.pack=2", "dist.device_memory_gb=0.068"],
                      "hydra.sweeper.pack=2: a pack of 2 will not fit, says the memory plan: a pack of 2 needs 0.0515 GB "
                      "(0.0492 GB once, 0.00117 GB per member) of 0.051 GB usable (dist.device_memory_gb=0.068); not "
                      "even two fit: pass hydra.sweeper.pack=null (a job per trial)"),
    "pack_auto_none_fits": (["hydra.sweeper.pack=auto", "dist.device_memory_gb=0.05"],
                            "hydra.sweeper.pack=auto: a pack of 1 will not fit"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sweep_input_is_one_line_before_any_trial(case, tmp_path):
    args, expected = BAD[case]
    sweep_dir = tmp_path / "sweep"
    proc = kdsweep("-m", "hparams_search=kd_optuna", *args, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("kdsweep: error:"), proc.stderr
    assert expected in lines[0]
    assert not any(p.is_dir() and p.name.isdigit() for p in sweep_dir.glob("*")), "no trial may start"


def test_an_empty_search_space_is_one_line(tmp_path):
    args = search(tmp_path, "empty", {"params": {}})
    proc = kdsweep(*args, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "hydra.sweeper.params is empty" in lines[0], proc.stderr


def test_a_changed_search_space_is_refused_on_resume(resumed):
    """The resumed sweep above (its search space kd_ratio=interval(0.0,1.0)), rerun by its command with another."""
    assert resumed.out.returncode == 0, resumed.out.stderr[-3000:]  # it ran to its end
    proc = kdsweep(*resumed.args, "kd_ratio=interval(0.0,0.5)", f"hydra.sweep.dir={resumed.sweep_dir}",
                   cwd=resumed.tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "different search space" in lines[0], proc.stderr
