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
        if v.get("train.eval_test") == "true":  # the test split: other rows, another value
            test = ce + 0.02 + 0.003 * math.cos(int(v["train.seed"]) * 3.1)
            record["test_after"] = {"student_ce": test, "kl": 1.0 - test / 10}
        (Path(job["run_dir"]) / "run.json").write_text(json.dumps(record))
        return 0

    def find(self, args, run_dir):
        return None

    def release_idle(self, why=""):
        pass

    def close(self):
        pass


def settings(**kw):
    return SweepSettings(**{"study_name": "c", "sampler": "random", "seed": 0, "pruner": "none", "poll_s": 0.0,
                            "max_concurrent": 2, "n_trials": 6, "confirm": {"top": 2, "seeds": 3}, **kw})


def sweep(tmp_path, backend, **kw):
    return Controller(settings(**kw), parse_space(SPACE), ["train=smoke"], tmp_path, backend).run()


def interval(xs):
    return statistics.fmean(xs), student_t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


T_975_2DF = 4.303  # t(0.975, 2 df): the 95% interval of 3 seeds
T_9875_2DF = 6.205  # t(0.9875, 2 df): the first step of Holm's correction over two comparisons at 3 seeds


def test_the_top_points_and_the_ce_only_baseline_are_rerun_with_fresh_seeds_and_judged(tmp_path):
    backend = Recorded()
    manifest = sweep(tmp_path, backend)
    trials = sorted(manifest.trials.values(), key=lambda t: t["number"])
    search, confirmation = trials[:6], trials[6:]
    assert not any(t.get("confirm") for t in search) and len(confirmation) == 3 * 3
    ranked = sorted(search, key=lambda t: t["values"][0])
    # CE-only: the best point's other values, no KD term, no generation, whatever the search set
    ce_only = {**ranked[0]["params"], "kd_ratio": 0.0, "loss.kd_ratio": 0.0, "rollout.lmbda": 0.0,
               "rollout.seq_kd": False}
    points = {"top1": ranked[0]["params"], "top2": ranked[1]["params"], "ce_only": ce_only}
    seen = sorted((t["confirm"]["label"], t["confirm"]["seed"]) for t in confirmation)
    assert seen == sorted((label, SEED_BASE + s) for label in points for s in range(3))  # each exactly once
    for t in confirmation:
        seed = t["confirm"]["seed"]
        assert t["params"] == points[t["confirm"]["label"]]
        assert f"train.seed={seed}" in t["args"] and f"rollout.seed={seed}" in t["args"]  # every random source
        assert "teacher.logits=live" in t["args"] and "train.eval_test=true" in t["args"]  # unbiased, on the test split
        assert t["test"] != t["values"]
    assert not any(a in t["args"] for t in search for a in ("train.eval_test=true", "teacher.logits=live"))
    baseline = next(t for t in confirmation if t["confirm"]["label"] == "ce_only")["args"]
    assert all(a in baseline for a in ("loss.kd_ratio=0.0", "rollout.lmbda=0.0", "rollout.seq_kd=False"))
    assert baseline.index("loss.kd_ratio=0.0") > baseline.index("train=smoke")  # after the base overrides: it wins
    # the verdict equals a recomputation from the trials' records, t quantiles written down
    by = {label: {} for label in points}
    for t in confirmation:
        record = json.loads((Path(t["run_dir"]) / "run.json").read_text())
        by[t["confirm"]["label"]][t["confirm"]["seed"]] = record["test_after"]["student_ce"]
    verdict = manifest.data["verdict"]
    rows = {r["label"]: r for r in verdict["points"]}
    for label, values in by.items():
        xs = list(values.values())
        half = T_975_2DF * statistics.stdev(xs) / math.sqrt(3)
        assert rows[label]["mean"] == pytest.approx(statistics.fmean(xs), rel=1e-12)
        assert rows[label]["ci95"] == pytest.approx(half, rel=1e-3, abs=1e-12)
    # the reported point is the search's best, whatever the confirmation's means say
    assert verdict["best"] == "top1" and rows["top1"]["search_trial"] == ranked[0]["number"]
    diffs = [by["ce_only"][s] - by["top1"][s] for s in by["top1"]]
    gain, gain_ci = statistics.fmean(diffs), T_975_2DF * statistics.stdev(diffs) / math.sqrt(3)
    assert rows["top1"]["vs_ce_only"]["mean"] == pytest.approx(-gain)
    # top1 against CE-only and top2 against top1: two comparisons; top1's, the smaller p, tested first
    assert (f"beats CE-only by {gain:.4f} ± {gain_ci:.4f} (3 seeds; Holm over 2 comparisons: t={T_9875_2DF})"
            in verdict["line"])  # kd_ratio 0 sits 0.36 worse here
    assert verdict["line"].startswith("kd_ratio=") and "on the test split over 3 seeds" in verdict["line"]
    search_best = statistics.fmean(t["values"][0] for t in confirmation if t["confirm"]["label"] == "top1")
    assert rows["top1"]["eval_mean"] == pytest.approx(search_best) and rows["top1"]["split"] == "test"
    assert "baseline: CE-only (kd_ratio=0, lmbda=0, no seq_kd) at the best point's learning rate" in verdict["line"]
    study = optuna.load_study(study_name="c", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert study.user_attrs["verdict"] == verdict["line"]
    lines = summary_lines(Manifest.load(tmp_path))
    assert lines[-1] == f"verdict: {verdict['line']}" and sum("[confirm " in line for line in lines) == 9
    assert sum("<- best" in line for line in lines) == 1 and "<- best" in next(
        line for line in lines if f"({ranked[0]['run_dir']})" in line)


class LearningRates(Recorded):
    """A trial's objective also depends on its learning rate (best at 0.01, a decade off costs 0.05)."""

    def poll(self, job):
        super().poll(job)
        record = json.loads((Path(job["run_dir"]) / "run.json").read_text())
        record["eval_after"]["student_ce"] += 0.05 * (math.log10(float(job["values"]["lr"])) + 2) ** 2
        (Path(job["run_dir"]) / "run.json").write_text(json.dumps(record))
        return 0


def test_ce_only_gets_its_own_learning_rate_from_trials_over_the_searched_range_before_its_seeds(tmp_path):
    space = {**SPACE, "lr": "tag(log, interval(1e-4,1e-1))"}
    kw = {"params": space, "confirm": {"top": 1, "seeds": 3, "baseline_trials": 4}}
    manifest = Controller(settings(**kw), parse_space(space), ["train=smoke"], tmp_path, LearningRates()).run()
    trials = sorted(manifest.trials.values(), key=lambda t: t["number"])
    plan = manifest.data["confirmation"]
    lr_trials = [t for t in trials if (t.get("confirm") or {}).get("label", "").startswith("ce_lr")]
    values = [t["params"]["lr"] for t in lr_trials]
    assert len(lr_trials) == 4 and all(1e-4 <= v <= 1e-1 for v in values) and len(set(values)) == 4
    assert all(t["params"]["loss.kd_ratio"] == 0.0 and t["confirm"]["seed"] is None for t in lr_trials)
    assert not any(a.startswith("train.seed=") for t in lr_trials for a in t["args"])  # the search's own seed
    best = min(lr_trials, key=lambda t: t["values"][0])
    seeds = [t for t in trials if (t.get("confirm") or {}).get("label") == "ce_only"]
    assert len(seeds) == 3 and all(t["params"]["lr"] == best["params"]["lr"] for t in seeds)
    assert min(t["number"] for t in seeds) > max(t["number"] for t in lr_trials)  # asked once the lr is known
    top1 = next(t for t in trials if (t.get("confirm") or {}).get("label") == "top1")
    assert top1["params"]["lr"] == plan["points"][0]["params"]["lr"]  # the KD point keeps its searched lr
    assert plan["baseline_search"]["settled"] == {"value": best["params"]["lr"], "how": "the best of 4 CE-only trials",
                                                  "completed": 4}
    assert f"at lr={best['params']['lr']:.4g}, the best of 4 CE-only trials" in manifest.data["verdict"]["line"]
    # the same sweep seed draws the same learning rates (a resumed controller's plan is the saved one anyway)
    again = Controller(settings(**kw), parse_space(space), ["train=smoke"], tmp_path / "again", LearningRates()).run()
    assert [p["params"]["lr"] for p in again.data["confirmation"]["baseline_search"]["points"]] == values
    assert len(trials) == 6 + 4 + 2 * 3


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


class Priced(Recorded):
    """Trials whose override ``key=value`` is set cost ``seconds`` device-s, the others 10."""

    def __init__(self, key: str, value: str, seconds: float) -> None:
        super().__init__()
        self.key, self.value, self.seconds = key, value, seconds

    def poll(self, job):
        super().poll(job)
        if job["values"].get(self.key) == self.value:
            record = json.loads((Path(job["run_dir"]) / "run.json").read_text())
            record["cost"] = {"trial_seconds": self.seconds, "device_seconds": self.seconds}
            (Path(job["run_dir"]) / "run.json").write_text(json.dumps(record))
        return 0


# Confirmation trials cost 25 device-s where the search's cost 10 (a live teacher after a cheap search, or a loaded
# machine): the reserve priced at the search's cost cannot pay for all 9.
DEARER_CONFIRMATION = ("train.eval_test", "true", 25.0)
# CE-only trials cost 4 device-s where a KD trial costs 10 (no teacher in training): the reserve, which prices CE-only
# as KD before it ran, holds 18 device-s more than the confirmation spends.
CHEAPER_BASELINE = ("loss.kd_ratio", "0.0", 4.0)


def test_a_confirmation_the_budget_cuts_short_still_pairs_the_best_point_with_ce_only(tmp_path):
    manifest = sweep(tmp_path, Priced(*DEARER_CONFIRMATION), n_trials=None, budget=200 / 3600.0)
    confirmation = sorted((t for t in manifest.trials.values() if t.get("confirm")), key=lambda t: t["number"])
    ran = [(t["confirm"]["label"], t["confirm"]["seed"] - SEED_BASE) for t in confirmation]
    # seed by seed, CE-only right after top1; the budget stops it after 4 (11 × 10 + 4 × 25 = 210 ≥ 200)
    assert ran == [("top1", 0), ("ce_only", 0), ("top2", 0), ("top1", 1)][:len(ran)] and len(ran) == 4
    rows = {r["label"]: r for r in manifest.data["verdict"]["points"]}
    assert rows["top1"]["seeds"] == [SEED_BASE, SEED_BASE + 1] and rows["ce_only"]["seeds"] == [SEED_BASE]
    assert manifest.data["verdict"]["line"].endswith("; 4 of its 9 trials ran: the device budget was spent before "
                                                     "the rest")


@pytest.mark.parametrize("more", [0, 3])
def test_what_the_budget_leaves_after_the_confirmation_buys_more_seeds_of_top1_and_ce_only(tmp_path, more):
    confirm = {"top": 2, "seeds": 3, "more_seeds": more}
    manifest = sweep(tmp_path, Priced(*CHEAPER_BASELINE), n_trials=None, budget=200 / 3600.0, confirm=confirm)
    confirmation = sorted((t for t in manifest.trials.values() if t.get("confirm")), key=lambda t: t["number"])
    ran = [(t["confirm"]["label"], t["confirm"]["seed"] - SEED_BASE) for t in confirmation]
    spent, line = manifest.data["budget"]["device_seconds_spent"], manifest.data["verdict"]["line"]
    # 11 search trials (110) and the 9 reserved at 10 each; the 9 spend 6 × 10 + 3 × 4 = 72: 18 left
    assert ran[:9] == [(label, s) for s in range(3) for label in ("top1", "ce_only", "top2")]
    if not more:  # what the reserve over-priced is left unspent: more than one full trial (10)
        assert len(ran) == 9 and spent == pytest.approx(182) and "more seed" not in line
        return
    # one pair (10 + 4) fits the 18 left, a second does not: the sweep ends within one trial of its budget
    assert ran[9:] == [("top1", 3), ("ce_only", 3)] and spent == pytest.approx(196)
    rows = {r["label"]: r for r in manifest.data["verdict"]["points"]}
    assert rows["top1"]["vs_ce_only"]["seeds"] == 4 and rows["top2"]["vs_best"]["seeds"] == 3
    assert "over 4 seeds" in line and "; 1 more seed of top1 and CE-only from what the budget left; baseline:" in line


@pytest.mark.parametrize("kw, message", [
    ({"objectives": ("student_ce", "kl"), "directions": ("minimize", "minimize")},
     "must name the one it ranks on: hydra.sweeper.confirm.objective=student_ce"),
    ({"confirm": {"top": 7, "seeds": 3}}, "hydra.sweeper.confirm.top=7 is more than the sweep's 6 trials"),
    ({"confirm": {"top": 2, "seeds": 2}}, "seeds >= 3 (two seeds give an interval 12.7 standard errors wide)"),
    ({"confirm": {"top": 2, "runs": 1}}, "hydra.sweeper.confirm has unknown keys ['runs']"),
    ({"confirm": {"top": 2, "more_seeds": -1}}, "hydra.sweeper.confirm.more_seeds=-1 must be >= 0"),
])
def test_bad_confirmation_settings_are_one_line(kw, message):
    with pytest.raises(ConfigError, match=None) as e:
        settings(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_pareto_study_confirms_on_the_objective_it_names(tmp_path):
    manifest = sweep(tmp_path, Recorded(), objectives=("student_ce", "kl"), directions=("minimize", "maximize"),
                     confirm={"top": 1, "seeds": 3, "objective": "kl"})
    assert manifest.data["confirmation"]["objective"] == "kl" and manifest.data["verdict"]["best"] == "top1"
    assert len([t for t in manifest.trials.values() if t.get("confirm")]) == 2 * 3


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


def judged(top1, top2, ce_only, direction="minimize"):
    """The verdict on three seeds' objectives of each point (a plan as :func:`plan` writes it, trials as recorded)."""
    from kdsweep.sweep.confirm import verdict

    values = {"top1": top1, "top2": top2, "ce_only": ce_only}
    plan = {"objective": "student_ce", "index": 0, "direction": direction, "asked_top": 2,
            "points": [{"label": label, "params": {"kd_ratio": k, "lr": 0.01}, "search_trial": None}
                       for label, k in (("top1", 0.5), ("top2", 0.6), ("ce_only", 0.0))],
            "items": [{"label": label, "seed": SEED_BASE + s} for label in values for s in range(3)]}
    trials = [{"state": "COMPLETE" if v is not None else "FAIL", "confirm": {"label": label, "seed": SEED_BASE + s},
               "values": [v] if v is not None else None}  # None: that seed's trial failed
              for label, vs in values.items() for s, v in enumerate(vs)]
    return verdict(plan, trials, ("student_ce",))


def test_holm_s_first_step_tests_the_smaller_p_at_t_0_9875_and_the_second_at_t_0_975():
    # top1 against CE-only: differences 0.20, 0.19, 0.22 (t = 23.1 > 6.205): beats it; top2 against top1: 0.005,
    # -0.005, 0.010 (t = 0.76 < 4.303): not distinguishable
    v = judged([4.50, 4.52, 4.51], [4.505, 4.515, 4.52], [4.70, 4.71, 4.73])
    diffs = [0.20, 0.19, 0.22]
    half = T_975_2DF * statistics.stdev(diffs) / math.sqrt(3)
    assert f"beats CE-only by {statistics.fmean(diffs):.4f} ± {half:.4f} (3 seeds; Holm over 2 comparisons: " \
           f"t={T_9875_2DF})" in v["line"]
    assert "; top2: not distinguishable from top1 (-0.0033" in v["line"] and f"t={T_975_2DF})" not in v["line"]
    assert "t=4.303;" in v["line"]  # the second step, at the unadjusted level
    # the smallest difference 3 seeds of differences with sd s could see: (t(0.975, 2) + t(0.8, 2))·s/√3
    sd = statistics.stdev([0.005, -0.005, 0.010])
    shown = float(v["line"].split("detectable: ")[1].split(";")[0])
    assert shown == pytest.approx((T_975_2DF + 1.0607) * sd / math.sqrt(3), abs=1e-4)


def test_ce_only_that_is_better_is_said_to_beat_the_point():
    v = judged([4.70, 4.71, 4.73], [4.90, 4.95, 4.93], [4.50, 4.52, 4.51])
    assert "CE-only beats it by 0.2033" in v["line"] and v["best"] == "top1"
    assert "; top2: top1 beats it by 0.2133" in v["line"]  # 0.20, 0.24, 0.20 worse than top1


def test_an_interval_clear_of_zero_is_still_not_distinguishable_after_holm():
    # top1 - CE-only: -0.10, -0.14, -0.06 (t = 4.33: past 4.303 unadjusted, short of Holm's 6.205 as the first of
    # two); top2 against top1 is further from significance, so it comes second and cannot be rejected either
    v = judged([4.40, 4.36, 4.44], [4.41, 4.35, 4.46], [4.50, 4.50, 4.50])
    row = next(r for r in v["points"] if r["label"] == "top1")
    assert -row["vs_ce_only"]["mean"] - row["vs_ce_only"]["ci95"] > 0  # the unadjusted interval excludes 0
    assert "not distinguishable from CE-only (+0.1000 ± 0.0994 unadjusted, 3 seeds; Holm over 2 comparisons: " \
           "t=6.205" in v["line"]
    # 4 seeds resolve 0.1 at this spread: (t(0.975, 3) + t(0.8, 3))·0.04/√4 = 0.0832 ≤ 0.1 < 0.1239 at 3
    assert "1 more seeds would resolve 0.1000" in v["line"]


def test_paired_differences_use_only_the_seeds_both_points_completed():
    v = judged([4.50, 4.52, 4.51], [4.505, None, 4.52], [4.70, 4.71, 4.73])
    top2 = next(r for r in v["points"] if r["label"] == "top2")
    assert top2["seeds"] == [SEED_BASE, SEED_BASE + 2] and top2["vs_best"]["seeds"] == 2
    assert top2["vs_best"]["mean"] == pytest.approx(statistics.fmean([0.005, 0.01]))
    assert "completed" not in v["line"].split("baseline: ")[1]  # nothing missing is reported


def test_a_point_asked_but_never_completed_and_trials_never_run_are_said_so():
    v = judged([4.50, 4.52, 4.51], [None, None, None], [4.70, 4.71, 4.73])
    assert v["line"].endswith("; no seed of top2 completed")
    from kdsweep.sweep.confirm import verdict

    plan = {"objective": "student_ce", "index": 0, "direction": "minimize", "asked_top": 2,
            "points": [{"label": "top1", "params": {}}, {"label": "ce_only", "params": {}}],
            "items": [{"label": label, "seed": SEED_BASE + s} for label in ("top1", "ce_only") for s in range(3)],
            "cut": "the device budget was spent", "search_ended_by": "the budget (its confirmation's reserve included)"}
    trials = [{"state": "COMPLETE", "confirm": {"label": label, "seed": SEED_BASE + s}, "values": [4.5 + s / 100]}
              for label in ("top1", "ce_only") for s in range(2)]
    assert verdict(plan, trials, ("student_ce",))["line"].endswith(
        "; the search completed 1 distinct point(s) of the 2 asked for confirmation before the budget (its "
        "confirmation's reserve included) ended it; 4 of its 6 trials ran: the device budget was spent before the rest")


class Scored(Recorded):
    """A trial given ``downstream.tasks`` also records each task's headline, as the trained student's lm-eval score
    would be: higher with more KD here (accuracy, so higher is better), with a seed's noise."""

    def poll(self, job):
        super().poll(job)
        v, path = job["values"], Path(job["run_dir"]) / "run.json"
        record = json.loads(path.read_text())
        for task in filter(None, v.get("downstream.tasks", "[]").strip("[]").split(",")):
            acc = 0.30 + 0.2 * float(v["kd_ratio"]) + 0.01 * math.cos(int(v.get("train.seed", 0)) * 1.7)
            for split in ("eval_after", "test_after"):
                if split in record:
                    record[split][f"lm_eval/{task}"] = acc + (0.005 if split == "test_after" else 0.0)
        path.write_text(json.dumps(record))
        return 0


def test_a_second_measure_scores_only_the_confirmation_seeds_and_the_verdict_compares_it_paired(tmp_path):
    task = "kdsweep_next_word"
    manifest = sweep(tmp_path, Scored(), confirm={"top": 1, "seeds": 3, "also": f"lm_eval/{task}"})
    trials = sorted(manifest.trials.values(), key=lambda t: t["number"])
    scored = [t for t in trials if f"downstream.tasks=[{task}]" in t["args"]]
    assert scored == [t for t in trials if t.get("confirm")] and len(scored) == 2 * 3  # the search pays nothing
    by = {"top1": {}, "ce_only": {}}
    for t in scored:
        record = json.loads((Path(t["run_dir"]) / "run.json").read_text())
        by[t["confirm"]["label"]][t["confirm"]["seed"]] = record["test_after"][f"lm_eval/{task}"]
        assert t["also"] == {f"lm_eval/{task}": record["test_after"][f"lm_eval/{task}"]}  # the test split's
    diffs = [by["top1"][s] - by["ce_only"][s] for s in sorted(by["top1"])]  # higher is better
    mean, half = statistics.fmean(by["top1"].values()), T_975_2DF * statistics.stdev(by["top1"].values()) / 3 ** .5
    gain, gain_ci = statistics.fmean(diffs), T_975_2DF * statistics.stdev(diffs) / math.sqrt(3)
    line = manifest.data["verdict"]["line"]
    # its own family of one: t(0.975, 2); the verdict's decision on student_ce is unchanged (Holm over 1 too)
    assert (f"; on lm_eval/{task}, top1 {mean:.4f} ± {half:.4f}: beats CE-only by {gain:.4f} ± {gain_ci:.4f} "
            f"(3 seeds; Holm over 1 comparison: t={T_975_2DF})") in line, line
    assert line.index("beats CE-only") < line.index(f"on lm_eval/{task}")
    assert manifest.data["verdict"]["also"][f"lm_eval/{task}"]["ce_only"] == pytest.approx(
        statistics.fmean(by["ce_only"].values()))


def test_an_lm_eval_objective_is_scored_by_every_trial_ranks_the_search_and_prunes_nothing(tmp_path):
    from kdsweep.sweep.study import make_pruner

    name = "lm_eval/kdsweep_next_word"
    kw = {"objectives": (name,), "directions": ("maximize",), "pruner": "halving",
          "confirm": {"top": 1, "seeds": 3}}
    manifest = sweep(tmp_path, Scored(), **kw)
    trials = sorted(manifest.trials.values(), key=lambda t: t["number"])
    assert all("downstream.tasks=[kdsweep_next_word]" in t["args"] for t in trials)
    search = trials[:6]
    best = max(search, key=lambda t: t["values"][0])  # maximize: the highest score, here the highest kd_ratio
    assert best["params"]["kd_ratio"] == max(t["params"]["kd_ratio"] for t in search)
    assert manifest.data["confirmation"]["points"][0]["search_trial"] == best["number"]
    assert not settings(**kw).prunes and type(make_pruner(settings(**kw))).__name__ == "NopPruner"
    assert settings(pruner="halving").prunes


@pytest.mark.parametrize("kw, message", [
    ({"objectives": ("lm_eval/",), "directions": ("maximize",)},
     "hydra.sweeper.objectives=['lm_eval/']: each must be one of student_ce, kl, teacher_ce or lm_eval/<task>"),
    ({"objectives": ("lm_eval/kdsweep_next_word",)},
     "hydra.sweeper.directions=['minimize']: lm_eval/kdsweep_next_word is an lm-eval task's accuracy, where higher is "
     "better; pass hydra.sweeper.directions=[maximize]"),
    ({"confirm": {"top": 1, "seeds": 3, "also": "accuracy"}},
     "hydra.sweeper.confirm.also=['accuracy']: 'accuracy' is not a second measure; use kl or lm_eval/<task>"),
    ({"confirm": {"top": 1, "seeds": 3, "also": ["student_ce"]}}, "'student_ce' is not a second measure"),
    ({"confirm": {"top": 1, "seeds": 3, "also": ["teacher_ce"]}}, "'teacher_ce' is not a second measure"),
])
def test_bad_lm_eval_measures_are_one_line(kw, message):
    with pytest.raises(ConfigError) as e:
        settings(**kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    if "pass hydra.sweeper.directions=" in message:  # what the line says to pass is accepted
        settings(**kw, directions=tuple(message.split("directions=[")[-1].rstrip("]").split(",")))


def test_a_trial_whose_lm_eval_measure_is_lower_is_better_fails_with_one_line(tmp_path):
    from kdsweep.sweep.judge import judge

    record = {"status": "completed", "eval_after": {"student_ce": 4.5, "lm_eval/wikitext": 25.0},
              "downstream": {"wikitext": {"metric": "word_perplexity", "value": 25.0, "stderr": None,
                                          "higher_is_better": False, "items": 62}}}
    (tmp_path / "run.json").write_text(json.dumps(record))
    outcome = judge(tmp_path, 0, ("lm_eval/wikitext",), attempts=1, retries=1)
    assert outcome.state == "FAIL" and outcome.reason == (
        "lm_eval/wikitext: the task's headline metric, word_perplexity, is lower-is-better, and a sweep ranks lm-eval "
        "tasks by a higher-is-better one (acc); pick a task scored by accuracy")
    assert judge(tmp_path, 0, ("student_ce",), attempts=1, retries=1).state == "COMPLETE"  # a plain run's record
