"""Confirmation after the search: the top points and the CE-only baseline re-run with fresh seeds, the verdict from
their results, a resume in the middle of it, and its share of a budget (a real Optuna study; jobs that end at once)."""

import json
import math
import os
import statistics
from pathlib import Path

import optuna
import pytest
from scipy.stats import t as student_t

from kdsweep.config import ConfigError
from kdsweep.sweep.confirm import SEED_BASE
from kdsweep.sweep.controller import Controller, summary_lines
from kdsweep.sweep.manifest import STORAGE_ENV, Manifest
from kdsweep.sweep.space import parse_space
from kdsweep.sweep.study import SweepSettings

SPACE = {"kd_ratio": "interval(0.0,1.0)", "lora_rank": "choice(4,8,16)"}


@pytest.fixture(autouse=True)
def own_storage_env():
    before = os.environ.get(STORAGE_ENV)
    yield
    os.environ.pop(STORAGE_ENV, None)
    if before is not None:
        os.environ[STORAGE_ENV] = before


def objective(kd_ratio: float, lora_rank: int, seed: int) -> float:
    """What a trial 'measures': best near kd_ratio=0.6, with a seed's noise of a few thousandths."""
    return 4.6 + (kd_ratio - 0.6) ** 2 + 0.001 * lora_rank + 0.004 * math.sin(seed * 7.3)


class Recorded:
    """Jobs that end at their first poll with the run.json a completed trial writes; ``stop_after`` starts: the
    controller dies (as kill -9 would leave it: nothing after the start is written)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after, self.started = stop_after, []

    def start(self, args, run_dir: Path, alone=False):
        if self.stop_after is not None and len(self.started) >= self.stop_after:
            raise KeyboardInterrupt("the controller dies")
        values = dict(a.split("=", 1) for a in args if "=" in a)
        self.started.append(values)
        run_dir.mkdir(parents=True, exist_ok=True)
        return {"run_dir": str(run_dir), "values": values, "logs": []}

    def poll(self, job):
        v = job["values"]
        ce = objective(float(v["kd_ratio"]), int(v["lora_rank"]), int(v.get("train.seed", 0)))
        record = {"status": "completed", "world_size": 1, "config": {"train": {"max_steps": 4}},
                  "eval_after": {"student_ce": ce, "kl": 1.0 - ce / 10},
                  "cost": {"trial_seconds": 10.0, "device_seconds": 10.0}}
        (Path(job["run_dir"]) / "run.json").write_text(json.dumps(record))
        return 0

    def find(self, args, run_dir):
        return None

    def close(self):
        pass


def settings(**kw):
    return SweepSettings(**{"study_name": "c", "sampler": "random", "seed": 0, "pruner": "none", "poll_s": 0.0,
                            "max_concurrent": 2, "n_trials": 6, "confirm": {"top": 2, "seeds": 3}, **kw})


def sweep(tmp_path, backend, **kw):
    return Controller(settings(**kw), parse_space(SPACE), ["train=smoke"], tmp_path, backend).run()


def interval(xs):
    return statistics.fmean(xs), student_t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def test_the_top_points_and_the_ce_only_baseline_are_rerun_with_fresh_seeds_and_judged(tmp_path):
    backend = Recorded()
    manifest = sweep(tmp_path, backend)
    trials = sorted(manifest.trials.values(), key=lambda t: t["number"])
    search, confirmation = trials[:6], trials[6:]
    assert not any(t.get("confirm") for t in search) and len(confirmation) == 3 * 3
    ranked = sorted(search, key=lambda t: t["values"][0])
    points = {"top1": ranked[0]["params"], "top2": ranked[1]["params"],
              "ce_only": {**ranked[0]["params"], "kd_ratio": 0.0}}
    seen = sorted((t["confirm"]["label"], t["confirm"]["seed"]) for t in confirmation)
    assert seen == sorted((label, SEED_BASE + s) for label in points for s in range(3))  # each exactly once
    for t in confirmation:
        assert t["params"] == points[t["confirm"]["label"]] and f"train.seed={t['confirm']['seed']}" in t["args"]
    # the verdict equals a recomputation from the trials' records
    by = {label: {} for label in points}
    for t in confirmation:
        record = json.loads((Path(t["run_dir"]) / "run.json").read_text())
        by[t["confirm"]["label"]][t["confirm"]["seed"]] = record["eval_after"]["student_ce"]
    verdict = manifest.data["verdict"]
    rows = {r["label"]: r for r in verdict["points"]}
    for label, values in by.items():
        mean, half = interval(list(values.values()))
        assert rows[label]["mean"] == pytest.approx(mean, rel=1e-12) and rows[label]["ci95"] == pytest.approx(half)
    best = min(("top1", "top2"), key=lambda k: rows[k]["mean"])
    gain, gain_ci = interval([by["ce_only"][s] - by[best][s] for s in by[best]])
    assert verdict["best"] == best and rows[best]["vs_ce_only"]["mean"] == pytest.approx(-gain)
    assert f"beats CE-only by {gain:.4f} ± {gain_ci:.4f}" in verdict["line"]  # kd_ratio 0 sits 0.36 worse here
    assert verdict["line"].startswith("kd_ratio=") and "over 3 seeds" in verdict["line"]
    study = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert study.user_attrs["verdict"] == verdict["line"]
    lines = summary_lines(Manifest.load(tmp_path))
    assert lines[-1] == f"verdict: {verdict['line']}" and sum("[confirm " in line for line in lines) == 9
    assert sum("<- best" in line for line in lines) == 1 and "<- best" in next(
        line for line in lines if f"({ranked[0]['run_dir']})" in line)


def test_a_controller_that_dies_during_the_confirmation_is_resumed_and_runs_each_confirmation_trial_once(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        sweep(tmp_path, Recorded(stop_after=6 + 4))  # dies at the 5th confirmation trial's start
    died = Manifest.load(tmp_path)
    assert "confirmation" in died.data and "verdict" not in died.data
    backend = Recorded()
    manifest = sweep(tmp_path, backend)  # `kdsweep resume`: the same command
    confirmation = [t for t in manifest.trials.values() if t.get("confirm")]
    keys = [(t["confirm"]["label"], t["confirm"]["seed"]) for t in confirmation]
    assert len(keys) == len(set(keys)) == 9 and all(t["state"] == "COMPLETE" for t in confirmation)
    assert len(manifest.trials) == 6 + 9 and "verdict" in manifest.data
    study = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert len(study.trials) == 15 and all(t.state.name == "COMPLETE" for t in study.trials)  # none left waiting


def test_a_budget_reserves_the_confirmation_share(tmp_path):
    manifest = sweep(tmp_path, Recorded(), n_trials=None, budget=200 / 3600.0)  # trials of 10 device-s
    search = [t for t in manifest.trials.values() if not t.get("confirm")]
    assert len(search) == 11 and len(manifest.trials) == 11 + 9  # 200 − 9 × 10 reserved: 11 search trials
    assert 200 <= manifest.data["budget"]["device_seconds_spent"] < 210


@pytest.mark.parametrize("kw, message", [
    ({"objectives": ("student_ce", "kl"), "directions": ("minimize", "minimize")},
     "must name the one it ranks on: hydra.sweeper.confirm.objective=student_ce"),
    ({"confirm": {"top": 7, "seeds": 3}}, "hydra.sweeper.confirm.top=7 is more than the sweep's 6 trials"),
    ({"confirm": {"top": 2, "seeds": 1}}, "seeds >= 2"),
    ({"confirm": {"top": 2, "runs": 1}}, "hydra.sweeper.confirm has unknown keys ['runs']"),
])
def test_bad_confirmation_settings_are_one_line(kw, message):
    with pytest.raises(ConfigError, match=None) as e:
        settings(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_pareto_study_confirms_on_the_objective_it_names(tmp_path):
    manifest = sweep(tmp_path, Recorded(), objectives=("student_ce", "kl"), directions=("minimize", "maximize"),
                     confirm={"top": 1, "seeds": 2, "objective": "kl"})
    assert manifest.data["confirmation"]["objective"] == "kl" and manifest.data["verdict"]["best"] == "top1"
    assert len([t for t in manifest.trials.values() if t.get("confirm")]) == 2 * 2


@pytest.mark.parametrize("kw, message", [
    ({"n_trials": None, "budget": 0.01, "trial_hours": 0.02, "confirm": None},
     "hydra.sweeper.budget=0.01 device-h cannot pay for one trial of hydra.sweeper.trial_hours=0.02: raise it to "
     "hydra.sweeper.budget=0.02 or more"),
    ({"n_trials": None, "budget": 0.2, "trial_hours": 0.02},  # 10 trials; top 2 and 3 × 3 confirmation need 11
     "hydra.sweeper.confirm.top=2 is more than the trials the budget allows: 0.2 device-h pays for 10 trials of "
     "0.02 device-h, and 2 search trials and the confirmation's 9 need 11: raise it to hydra.sweeper.budget=0.22 "
     "or lower hydra.sweeper.confirm.top"),
])
def test_a_budget_too_small_for_a_trial_or_the_confirmation_is_one_line_and_its_hint_passes(kw, message):
    with pytest.raises(ConfigError) as e:
        settings(**kw)
    assert str(e.value) == message
    hint = message.split("raise it to hydra.sweeper.budget=")[1].split(" ")[0]
    settings(**{**kw, "budget": float(hint)})  # what the line says to do is accepted


def test_the_trial_estimate_reserves_the_confirmation_before_any_trial_has_ended(tmp_path):
    # 10 device-s trials known from the start: the first trials start only while 9 confirmation trials still fit
    manifest = sweep(tmp_path, Recorded(), n_trials=None, budget=200 / 3600.0, trial_hours=10 / 3600.0)
    search = [t for t in manifest.trials.values() if not t.get("confirm")]
    assert len(search) == 11 and len(manifest.trials) == 11 + 9


def test_ce_only_outside_the_searched_choices_runs_its_point_and_a_resume_keeps_it(tmp_path):
    """kd_ratio searched as choices without 0: the study holds the values its space can (CE-only's other params),
    the trial runs the whole point; a controller killed mid-confirmation resumes the same way."""
    space = {"kd_ratio": "choice(0.3,0.6,0.9)", "lora_rank": "choice(4,8,16)"}
    with pytest.raises(KeyboardInterrupt):
        Controller(settings(), parse_space(space), ["train=smoke"], tmp_path, Recorded(stop_after=6 + 7)).run()
    backend = Recorded()
    manifest = Controller(settings(), parse_space(space), ["train=smoke"], tmp_path, backend).run()
    baseline = [t for t in manifest.trials.values() if (t.get("confirm") or {}).get("label") == "ce_only"]
    assert len(baseline) == 3 and all(t["params"]["kd_ratio"] == 0.0 and "kd_ratio=0.0" in t["args"] for t in baseline)
    study = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    held = [t for t in study.trials if t.user_attrs.get("confirm", {}).get("label") == "ce_only"]
    assert len(held) == 3 and all("kd_ratio" not in t.params and t.state.name == "COMPLETE" for t in held)
    assert "verdict" in manifest.data and len(manifest.trials) == 6 + 9
