"""Offline W&B runs made by wandb itself, read back by kdsweep.analysis: a resumed run's segments merged, a step
logged twice kept once (the later value), NaN, a run killed before wandb flushed, the trial number."""

import math
import subprocess
import sys

import pytest

from kdsweep.analysis import load_wandb_runs
from kdsweep.config.schema import ConfigError

MAKER = r"""
import os, sys, time, wandb
root = sys.argv[1]

def run(run_id, name, rows, config=None, summary=None, kill=False):
    r = wandb.init(mode="offline", dir=root, id=run_id, name=name, group="study", project="p", config=config or {},
                   resume="allow", settings=wandb.Settings(console="off", silent=True))
    for step, row in rows:
        r.log(row, step=step)
    if kill:
        os.kill(os.getpid(), 9)
    r.summary.update(summary or {})
    r.finish()

if sys.argv[2:] == ["kill"]:  # a job killed (SIGKILL) before wandb flushed anything
    run("kd-c", "trial-3", [(1, {"train/loss": 1.0})], kill=True)

trial = {"trial": {"sweep_dir": "/sweep", "number": 7, "study": "study"}, "kd_ratio": 0.5}
run("kd-a", "trial-7", [(0, {"eval/student_ce": 5.0}), (1, {"train/loss": 3.0}),
                        (2, {"train/loss": 2.9, "eval/student_ce": 4.9}), (3, {"train/loss": 2.8, "train/lr": 0.01})], trial)
time.sleep(1.1)  # the requeued attempt: a new offline-run-<second>-<id> directory, the same id
run("kd-a", "trial-7", [(3, {"train/loss": 2.75, "eval/student_ce": 4.8}), (4, {"train/loss": 2.7, "eval/student_ce": 4.7})], trial,
    {"objective": 4.7})
run("kd-b", "trial-2", [(1, {"train/loss": float("nan"), "train/lr": 0.01}), (2, {"train/loss": float("inf")})])
"""


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("wandb")
    subprocess.run([sys.executable, "-c", MAKER, str(root)], check=True, timeout=120)
    killed = subprocess.run([sys.executable, "-c", MAKER, str(root), "kill"], timeout=120)
    assert killed.returncode == -9
    return root


def test_offline_runs_merged_by_id_with_every_step_once(runs_root):
    wandb = load_wandb_runs(runs_root)
    runs = wandb.runs.set_index("run_id")
    assert sorted(runs.index) == ["kd-a", "kd-b"]  # kd-c was killed before wandb wrote its run record
    a = runs.loc["kd-a"]
    assert (a["trial"], a["name"], a["group"], a["segments"], a["state"]) == (7, "trial-7", "study", 2, "finished")
    assert a["config"]["kd_ratio"] == 0.5 and a["summary.objective"] == 4.7
    assert runs.loc["kd-b", "trial"] == 2  # no trial in its config: from its name

    history = wandb.history[wandb.history["run_id"] == "kd-a"]
    assert list(zip(history["kind"], history["step"])) == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("eval", 3), ("train", 4), ("eval", 4)]
    train = history[history["kind"] == "train"].set_index("step")
    assert list(train["loss"]) == [3.0, 2.9, 2.75, 2.7]  # step 3's loss from the later attempt ...
    assert train.loc[3, "lr"] == 0.01  # ... and its lr, which only the first attempt logged, kept
    assert list(history[history["kind"] == "eval"]["student_ce"]) == [5.0, 4.9, 4.8, 4.7]
    b = wandb.history[wandb.history["run_id"] == "kd-b"]
    assert math.isnan(b["loss"].iloc[0]) and b["loss"].iloc[1] == math.inf and b["lr"].iloc[0] == 0.01


def test_a_directory_without_offline_runs_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no offline W&B run under .*logger.wandb.enabled=true"):
        load_wandb_runs(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_wandb_runs(tmp_path / "nowhere")
