"""kdsweep.analysis and notebooks/sweep_analysis.ipynb on one real sweep (4 trials on 2 warm workers reading a
``sample`` teacher cache, one pruned, then CE-only at a learning rate of its own, the best point and CE-only confirmed
with 3 seeds each with the live teacher on the test split, W&B offline)."""

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml

from conftest import REPO, kdsweep, read_metrics, read_run
from kdsweep.analysis import load_sweep, load_wandb_runs
from kdsweep.analysis.notebook import execute
from kdsweep.config.schema import ConfigError

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("KDSWEEP_ARTIFACTS") or REPO / "artifacts")
NOTEBOOK = REPO / "notebooks" / "sweep_analysis.ipynb"
STUDY = "analysis"
PNG = b"\x89PNG\r\n\x1a\n"
TRIALS = 4 + 1 + 2 * 3  # the search's 4, a CE-only learning-rate trial, the best point and CE-only with 3 seeds


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, zoo_dirs):
    """4 trials of 4 steps on 2 warm workers, W&B offline; trial 2's lr cannot learn, and it starts only after a
    trial has completed (the median pruner's one startup trial), so it is pruned at its first eval. Then trial 4:
    CE-only at a learning rate of its own; trials 5-10: the best point and CE-only, each with 3 fresh seeds
    (hydra.sweeper.confirm)."""
    root = tmp_path_factory.mktemp("analysis")
    body = {"defaults": [{"override /hydra/sweeper": "kdsweep_optuna"}],
            "train": {"eval_every": 2, "max_steps": 4}, "data": {"test_fraction": 0.05},
            "logger": {"progress_bar": False, "wandb": {"enabled": True, "mode": "offline"}},
            "checkpoint": {"save_every": 0, "export_adapter": False, "export_merged": False},
            "hydra": {"sweeper": {
                "study_name": STUDY, "poll_s": 0.2, "n_trials": 4, "max_concurrent": 2, "workers": 2, "sampler": "random",
                "seed": 0, "pruner": "median", "pruner_startup_trials": 1, "pruner_warmup_steps": 0,
                "confirm": {"top": 1, "seeds": 3, "baseline_trials": 1},
                "params": {"kd_ratio": "interval(0.0,1.0)", "lr": "tag(log, interval(1e-7,3e-2))",
                           "lora_rank": "choice(4,8,16)"},
                "enqueue": [{"kd_ratio": 0.5, "lr": 0.01, "lora_rank": 8}, {"kd_ratio": 0.3, "lr": 0.005, "lora_rank": 4},
                            {"kd_ratio": 0.5, "lr": 1e-7, "lora_rank": 8}]}}}
    (root / "conf" / "hparams_search").mkdir(parents=True)
    (root / "conf" / "hparams_search" / f"{STUDY}.yaml").write_text("# @package _global_\n" + yaml.safe_dump(body))
    kdsweep("-m", f"hparams_search={STUDY}", f"hydra.searchpath=[file://{root / 'conf'}]", "teacher.logits=cache",
            f"hydra.sweep.dir={root / 'sweep'}", cwd=root)  # the search reads a sample cache (k 12)
    return root / "sweep"


def manifest_of(sweep_dir):
    return json.loads((sweep_dir / "sweep.json").read_text())


def test_one_row_per_trial_matching_the_manifest_the_study_and_the_records(sweep_dir):
    sweep = load_sweep(sweep_dir)
    entries = manifest_of(sweep_dir)["trials"]
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{sweep_dir / 'optuna.db'}").trials
    trials = sweep.trials.set_index("number")
    assert list(trials.index) == list(range(TRIALS)) == [t.number for t in study]
    for t in study:
        row, entry, record = trials.loc[t.number], entries[str(t.number)], read_run(sweep_dir / str(t.number))
        assert row["state"] == entry["state"] == t.state.name == row["optuna_state"]
        searched = ("kd_ratio", "lr", "lora_rank")  # CE-only's point also pins loss.kd_ratio, rollout.lmbda, seq_kd
        assert {k: row[f"param.{k}"] for k in searched} == {k: entry["params"][k] for k in searched} == t.params
        assert row["started"].timestamp() == pytest.approx(entry["started"])
        assert row["duration_s"] == pytest.approx(entry["ended"] - entry["started"])
        assert row["run_dir"] == entry["run_dir"] == str(sweep_dir / str(t.number))
        assert row["worker"] == entry["job"]["worker"] == record["environment"]["worker"]["name"]
        assert row["slurm_job_id"] is None
        assert row["status"] == record["status"] and row["steps"] == record["steps"]
        assert row["wandb_run_id"] == record["wandb"]["id"]
        if t.state.name == "COMPLETE":
            assert row["objective.student_ce"] == pytest.approx(t.value) == pytest.approx(record["objective"])
        else:
            assert row["objective.student_ce"] != row["objective.student_ce"]  # NaN: no objective without COMPLETE
    pruned = trials[trials["state"] == "PRUNED"]
    assert 2 in pruned.index and (pruned["pruned_step"] == pruned["steps"]).all()
    assert trials.loc[2, "pruned_step"] == 2 == study[2].last_step
    pruned_evals = [r for r in read_metrics(sweep_dir / "2") if r["kind"] == "eval" and r["step"] == 2]
    assert len(pruned_evals) == 1  # the eval that pruned it is its eval_after: not evaluated twice at one step
    assert read_run(sweep_dir / "2")["eval_after"]["student_ce"] == pruned_evals[0]["student_ce"]
    searched = [t for t in study if t.state.name == "COMPLETE" and "confirm" not in t.user_attrs]
    assert sweep.best_number() == min(searched, key=lambda t: t.value).number
    assert list(trials["confirm.label"].isna()) == [True] * 4 + [False] * 7  # the confirmation's re-runs
    seeds = [None if pd.isna(s) else s for s in trials.loc[4:, "confirm.seed"]]
    assert seeds == [entries[str(n)]["confirm"]["seed"] for n in range(4, TRIALS)] and seeds[0] is None


def test_the_confirmation_table_is_the_verdict_s_and_its_numbers_are_the_records(sweep_dir):
    sweep, verdict = load_sweep(sweep_dir, study=False), manifest_of(sweep_dir)["verdict"]
    table = sweep.confirmation().set_index("label")
    assert sweep.verdict == verdict["line"] and list(table.index) == ["top1", "ce_only"]
    runs = sweep.trials[sweep.trials["confirm.label"].notna()]
    for label, group in runs[runs["confirm.label"] != "ce_lr1"].groupby("confirm.label"):
        values = [read_run(Path(d))["test_after"]["student_ce"] for d in group["run_dir"]]
        on_eval = [read_run(Path(d))["eval_after"]["student_ce"] for d in group["run_dir"]]
        assert table.loc[label, "seeds"] == 3 and table.loc[label, "mean"] == pytest.approx(sum(values) / 3)
        assert table.loc[label, "split"] == "test" and table.loc[label, "eval_mean"] == pytest.approx(sum(on_eval) / 3)
    assert "on the test split over 3 seeds" in verdict["line"]
    assert table.loc["ce_only", "param.kd_ratio"] == 0.0
    assert table.loc["ce_only", "param.lr"] == sweep.trials.loc[4, "param.lr"]  # its own, from trial 4
    assert table.loc["top1", "vs_ce_only.mean"] == pytest.approx(table.loc["top1", "mean"] - table.loc["ce_only", "mean"])


def test_confirmation_trials_train_with_the_live_teacher_on_their_own_seeds_and_ce_only_without_one(sweep_dir):
    entries = manifest_of(sweep_dir)["trials"]
    records = {n: read_run(sweep_dir / str(n)) for n in range(TRIALS)}
    for n, record in records.items():
        seed = (entries[str(n)].get("confirm") or {}).get("seed")
        if seed is None:  # the search and the CE-only learning-rate trial: the sample cache, the eval split only
            assert record["teacher_targets"]["source"] == "cache" and record["teacher_targets"]["method"] == "sample"
            assert "test_after" not in record or record["test_after"] is None
            continue
        config = record["config"]
        assert record["teacher_targets"]["source"] == "live" and config["teacher"]["logits"] == "live"
        assert config["train"]["seed"] == config["rollout"]["seed"] == seed and config["train"]["eval_test"]
        assert record["test_after"]["tokens"] > 0 and record["test_after"] != record["eval_after"]
        if entries[str(n)]["confirm"]["label"] == "ce_only":
            assert config["loss"]["kd_ratio"] == 0.0 and config["rollout"]["lmbda"] == 0.0
            assert config["rollout"]["seq_kd"] is False  # and no teacher in its training steps:
            assert record["teacher_targets"]["training_steps"] == "without the teacher (kd_ratio=0)"
            assert config["optim"]["lr"] == entries["4"]["params"]["lr"]  # the CE-only learning-rate trial's
    data = records[0]["data"]
    assert data["test"]["samples"] == data["train"]["sources"][0]["test"] > 0
    assert data["test"]["sources"][0]["path"] == data["eval"]["sources"][0]["path"]


def test_history_holds_every_logged_row_in_order(sweep_dir):
    sweep = load_sweep(sweep_dir, study=False)
    for n in range(TRIALS):
        rows = read_metrics(sweep_dir / str(n))
        mine = sweep.history[sweep.history["trial"] == n]
        assert len(mine) == len(rows) == len((sweep_dir / str(n) / "metrics.jsonl").read_text().splitlines())
        assert list(zip(mine["kind"], mine["step"])) == [(r["kind"], r["step"]) for r in rows]
        for column in ("loss", "student_ce", "grad_norm", "kl"):
            expected = [r.get(column) for r in rows]
            got = [None if v != v else v for v in mine[column]]  # NaN where a row lacks the metric
            assert got == pytest.approx(expected), (n, column)
    assert set(sweep.history[sweep.history["trial"] == 2]["step"]) == {0, 1, 2}  # pruned at its first eval


def test_wandb_offline_runs_read_back_one_per_trial_complete(sweep_dir):
    sweep = load_sweep(sweep_dir, study=False)
    wandb = load_wandb_runs(sweep_dir)
    runs = wandb.runs.set_index("trial")
    assert sorted(runs.index) == list(range(TRIALS))
    assert set(runs["group"]) == {STUDY} and set(runs["state"]) == {"finished"}
    assert list(runs["name"]) == [f"trial-{n}" for n in runs.index]
    assert list(runs["run_id"]) == list(sweep.trials.set_index("number").loc[runs.index, "wandb_run_id"])
    for n in range(TRIALS):
        record = read_run(sweep_dir / str(n))
        assert runs.loc[n, "config"]["kd_ratio"] == record["config"]["kd_ratio"]
        assert runs.loc[n, "summary.objective"] == pytest.approx(record["objective"])
        jsonl = sweep.history[sweep.history["trial"] == n].set_index(["kind", "step"]).sort_index()
        logged = wandb.history[wandb.history["trial"] == n].set_index(["kind", "step"]).sort_index()
        assert list(logged.index) == list(jsonl.index)  # every step, once
        for column in ("loss", "ce", "lr", "student_ce", "kl"):
            assert list(logged[column].fillna(-1)) == pytest.approx(list(jsonl[column].fillna(-1))), (n, column)


def test_notebook_tells_the_story_and_saves_its_figures(sweep_dir, tmp_path):
    figures = tmp_path / "figures"
    nb = execute(NOTEBOOK, {"sweep_dir": str(sweep_dir), "figures_dir": str(figures)}, cwd=tmp_path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert load_sweep(sweep_dir, study=False).reproduce_command() in text.splitlines()
    assert "trial 2 at step 2" in text  # the pruned trials are named
    # not evaluated (an evaluated sweep's table: tests/integration/test_verdict.py)
    assert f"not evaluated downstream: run `kdsweep eval {sweep_dir}`" in text

    assert f"verdict: {manifest_of(sweep_dir)['verdict']['line']}" in text.splitlines()
    names = {"importances", "objective_vs_params", "pairwise", "parallel_coordinates", "learning_curves",
             "confirmation"}
    assert {p.stem for p in figures.glob("*.png")} == names
    shown = sum(1 for o in outputs if "image/png" in o.get("data", {}))
    assert shown == len(names)
    (ARTIFACTS / "analysis").mkdir(parents=True, exist_ok=True)
    for name in names:
        png = (figures / f"{name}.png").read_bytes()
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
        assert png[:8] == PNG and len(png) > 5_000 and width >= 300 and height >= 200, name
        shutil.copy(figures / f"{name}.png", ARTIFACTS / "analysis" / f"{name}.png")
    import nbformat

    nbformat.write(nb, ARTIFACTS / "analysis" / "sweep_analysis.executed.ipynb")


def test_reproduce_command_composes_the_best_trials_config(sweep_dir, tmp_path):
    sweep = load_sweep(sweep_dir, study=False)
    best = sweep.best_number()
    argv = shlex.split(sweep.reproduce_command(best, run_dir=tmp_path / "again"))
    assert argv[:3] == ["python", "-m", "kdsweep"]
    entry = manifest_of(sweep_dir)["trials"][str(best)]
    assert argv[3:-1] == [a for a in entry["args"] if not a.startswith(("trial.", "hydra.run.dir="))]
    out = subprocess.run([sys.executable, *argv[1:], "--cfg", "job", "--resolve"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    composed, ran = yaml.safe_load(out.stdout), read_run(sweep_dir / str(best))["config"]
    ignore = ("output_dir", "trial")
    # loss.impl=auto is chosen before launch (the same choice for the same models), and run.json records the choice
    assert composed["loss"]["impl"] == "auto" and ran["loss"]["impl"] == "fused"
    composed["loss"]["impl"] = "fused"
    assert {k: v for k, v in composed.items() if k not in ignore} == {k: v for k, v in ran.items() if k not in ignore}
    assert argv[-1] == f"hydra.run.dir={tmp_path / 'again'}"


def test_a_copied_sweep_is_read_from_its_new_place_and_a_missing_record_is_one_line(sweep_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sweep_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    moved = load_sweep(copy)
    assert list(moved.trials["run_dir"]) == [str(copy / str(n)) for n in range(TRIALS)]
    assert len(moved.history) == len(load_sweep(sweep_dir, study=False).history)
    assert len(load_wandb_runs(copy).runs) == TRIALS

    (copy / "optuna.db").unlink()
    with pytest.raises(ConfigError, match="study storage .* does not exist"):
        load_sweep(copy)
    assert not (copy / "optuna.db").exists()  # not created empty by trying
    (copy / "0" / "run.json").unlink()
    with pytest.raises(ConfigError, match=r"trial 0 is COMPLETE but .*/copy/0/run.json is missing") as e:
        load_sweep(copy, study=False)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="is not a kdsweep sweep directory"):
        load_sweep(copy / "0")
