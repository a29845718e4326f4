"""kdsweep.analysis on hand-made sweep directories: a two-objective study in a journal file, bad input, plots
with too few trials, the committed notebook."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import nbformat
import optuna
import pytest
from matplotlib.figure import Figure

from kdsweep.analysis import load_sweep, plots
from kdsweep.analysis.notebook import with_parameters
from kdsweep.config.schema import ConfigError
from kdsweep.sweep.study import SweepSettings

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "sweep_analysis.ipynb"
SPACE = [{"key": "kd_ratio", "kind": "float", "low": 0.0, "high": 1.0},
         {"key": "lr", "kind": "float", "low": 1e-4, "high": 1e-1, "log": True},
         {"key": "lora_rank", "kind": "categorical", "choices": [4, 8]}]
DISTRIBUTIONS = {"kd_ratio": optuna.distributions.FloatDistribution(0.0, 1.0),
                 "lr": optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True),
                 "lora_rank": optuna.distributions.CategoricalDistribution([4, 8])}


def make_sweep(root: Path, points: list[tuple[str, list[float] | None]], directions=("minimize", "maximize"),
               objectives=("student_ce", "kl")) -> Path:
    """A sweep directory as the controller leaves it, with its study in a journal file: one trial per point
    (state, values), each with run.json and a 4-step metrics.jsonl (evals at 0, 2, 4)."""
    sweep_dir = root / "sweep"
    url = f"journal://{sweep_dir / 'study.log'}"
    settings = SweepSettings(study_name="handmade", storage=url, objectives=tuple(objectives), directions=tuple(directions))
    from kdsweep.sweep.study import make_storage

    study = optuna.create_study(study_name="handmade", storage=make_storage(url), directions=list(directions))
    trials = {}
    for n, (state, values) in enumerate(points):
        params = {"kd_ratio": 0.1 * (n + 1), "lr": 10 ** -(1 + n % 3), "lora_rank": [4, 8][n % 2]}
        last = 4 if state == "COMPLETE" else 2
        study.add_trial(optuna.trial.create_trial(
            state=getattr(optuna.trial.TrialState, state), values=values, params=params,
            distributions=DISTRIBUTIONS, intermediate_values={s: 5.0 - 0.1 * s for s in range(2, last + 1, 2)}))
        run_dir = sweep_dir / str(n)
        run_dir.mkdir(parents=True)
        ce = values[0] if values else 5.0
        (run_dir / "run.json").write_text(json.dumps({
            "status": {"COMPLETE": "completed", "PRUNED": "pruned", "FAIL": "failed"}[state], "steps": last,
            "world_size": 1, "eval_after": {"student_ce": ce, "kl": 0.5, "teacher_ce": 4.0, "tokens": 10},
            "environment": {"host": "h", "slurm": None}}))
        rows = [{"kind": "eval", "step": 0, "student_ce": 5.0, "kl": 0.9, "teacher_ce": 4.0, "tokens": 10}]
        for step in range(1, last + 1):
            rows.append({"kind": "train", "step": step, "loss": 3.0 - 0.1 * step, "lr": 0.01})
            if step % 2 == 0:
                rows.append({"kind": "eval", "step": step, "student_ce": 5.0 - 0.1 * step, "kl": 0.8, "teacher_ce": 4.0, "tokens": 10})
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        trials[str(n)] = {"number": n, "params": params, "run_dir": str(run_dir), "state": state, "attempts": 1,
                          "job": {"slurm_job_id": str(100 + n), "logs": []}, "started": 1000.0 + n,
                          "ended": 1010.0 + 2 * n, "values": values, "reason": "boom" if state == "FAIL" else ""}
    (sweep_dir / "sweep.json").write_text(json.dumps({
        "study_name": "handmade", "settings": {**asdict(settings)}, "space": SPACE,
        "base_overrides": ["hparams_search=kd_optuna_pareto", "train.max_steps=4"], "trials": trials}))
    return sweep_dir


POINTS = [("COMPLETE", [4.0, 0.2]), ("COMPLETE", [3.0, 0.1]), ("COMPLETE", [5.0, 0.9]), ("COMPLETE", [4.5, 0.1]),
          ("PRUNED", None), ("FAIL", None)]


def test_two_objective_sweep_in_a_journal_file(tmp_path):
    sweep = load_sweep(make_sweep(tmp_path, POINTS))
    t = sweep.trials.set_index("number")
    assert sweep.objective_columns == ["objective.student_ce", "objective.kl"]
    assert list(t["state"]) == [s for s, _ in POINTS] == list(t["optuna_state"])
    assert list(t["slurm_job_id"]) == [str(100 + n) for n in range(6)]
    assert list(t["duration_s"]) == [10.0 + n for n in range(6)]
    assert t.loc[4, "pruned_step"] == 2 and t.loc[5, "reason"] == "boom"
    # minimise CE, maximise KL: 3 (4.5, 0.1) is dominated by 1 (3.0, 0.1); 0, 1 and 2 trade one for the other
    front = set(sweep.pareto()["number"])
    assert front == {t.number for t in sweep.study.best_trials} == {0, 1, 2}
    assert sweep.best_number() == 1  # the Pareto trial with the lowest CE
    assert len(sweep.history) == 4 * 7 + 4 + 4  # complete: 4 train + 3 eval; pruned and failed: 2 train + 2 eval
    fig = plots.pareto_front(sweep)
    fig.savefig(tmp_path / "pareto.png")
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    none_done = load_sweep(make_sweep(tmp_path / "b", [("FAIL", None)]))
    assert none_done.pareto().empty and none_done.best_number() is None
    assert isinstance(plots.pareto_front(none_done), Figure)
    command = sweep.reproduce_command()
    assert command == ("python -m kdsweep hparams_search=kd_optuna_pareto train.max_steps=4 kd_ratio=0.2 lr=0.01 "
                       f"lora_rank=8 hydra.run.dir={sweep.sweep_dir}/reproduce/trial-1")


@pytest.mark.parametrize("points", [[], [("FAIL", None)], [("COMPLETE", [4.0]), ("PRUNED", None)]])
def test_every_plot_draws_with_too_few_trials(tmp_path, points):
    sweep = load_sweep(make_sweep(tmp_path, points, directions=("minimize",), objectives=("student_ce",)))
    for name in ("objective_vs_params", "pairwise", "learning_curves", "importances", "parallel_coordinates"):
        fig = getattr(plots, name)(sweep)
        assert isinstance(fig, Figure)
        fig.savefig(tmp_path / f"{name}.png")
    assert sweep.best_number() == (0 if points and points[0][0] == "COMPLETE" else None)
    with pytest.raises(ConfigError, match="two objectives"):
        plots.pareto_front(sweep)


def test_bad_input_is_one_config_error_line(tmp_path):
    def error(path):
        with pytest.raises(ConfigError) as e:
            load_sweep(path)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "does not exist" in error(tmp_path / "nowhere")
    assert "no sweep.json" in error(tmp_path)
    (tmp_path / "sweep.json").write_text("{not json")
    assert "not valid JSON" in error(tmp_path)
    (tmp_path / "sweep.json").write_text("{}")
    assert "not a kdsweep manifest" in error(tmp_path)

    sweep_dir = make_sweep(tmp_path / "a", [("COMPLETE", [4.0, 0.1]), ("COMPLETE", [3.0, 0.2])])
    metrics = sweep_dir / "1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines) + '\n{"kind": "train", "st')  # a write cut off by a kill: skipped
    assert len(load_sweep(sweep_dir, study=False).history) == 14
    metrics.write_text("\n".join([lines[0], "garbage", *lines[1:]]) + "\n")
    assert f"{metrics}:2 is not a JSON line" in error(sweep_dir)
    metrics.write_text('{"kind": "test", "step": 1}\n')
    assert "is not a metrics row" in error(sweep_dir)
    (sweep_dir / "1" / "run.json").unlink()
    assert "trial 1 is COMPLETE but" in error(sweep_dir)


def test_the_committed_notebook_has_no_outputs_and_one_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert not any("execution" in c.metadata for c in nb.cells)
    injected = with_parameters(nb, {"sweep_dir": "/x", "figures_dir": "/y"})
    cell = next(c for c in injected.cells if "parameters" in c.metadata.get("tags", []))
    scope: dict = {}
    exec(cell.source, scope)
    assert (scope["sweep_dir"], scope["figures_dir"]) == ("/x", "/y")
    with pytest.raises(ConfigError, match=r"unknown notebook parameter\(s\) \['sweepdir'\]"):
        with_parameters(nb, {"sweepdir": "/x"})


def test_analysis_imports_neither_torch_nor_wandb():
    code = ("import sys, kdsweep.analysis, kdsweep.analysis.plots, kdsweep.analysis.notebook; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'wandb', 'hydra', 'nbclient'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
