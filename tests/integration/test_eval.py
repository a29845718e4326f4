"""`kdsweep eval` through the real lm-evaluation-harness, offline: the embedded default's distilled student, its
CE-only twin and the undistilled base on the shipped task, one table; bad input, one line each."""

import json
import math

import pytest

from conftest import QUIET, kdsweep, read_run
from kdsweep.evaluation.task import TASK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, zoo_dirs):
    """``python -m kdsweep -m kd_ratio=0,0.5``: the embedded default (60 steps) and CE-only, the same otherwise; each
    scores the shipped task once trained (``downstream.tasks``), at ``kdsweep eval``'s batch size."""
    root = tmp_path_factory.mktemp("eval")
    kdsweep("-m", "kd_ratio=0.0,0.5", "train.threads=1", f"downstream.tasks=[{TASK}]", "downstream.batch_size=32",
            *QUIET, f"hydra.sweep.dir={root / 'sweep'}", cwd=root, timeout=900)
    return root


def test_the_distilled_student_beats_the_undistilled_base_on_the_shipped_task(runs):
    out = kdsweep("eval", str(runs / "sweep" / "1"), str(runs / "sweep" / "0"), "--json", str(runs / "eval.json"),
                  cwd=runs)
    rows = {r["name"]: r for r in json.loads((runs / "eval.json").read_text())["rows"]}
    base = next(r for name, r in rows.items() if name.startswith("base: "))
    distilled, ce_only = rows["1"], rows["0"]
    assert {r["task"] for r in rows.values()} == {TASK} and base["items"] >= 500 and base["metric"] == "acc"
    for r in rows.values():  # lm-eval's standard error of a mean of 0/1 scores, and the interval printed from it
        assert r["stderr"] == pytest.approx(math.sqrt(r["value"] * (1 - r["value"]) / (r["items"] - 1)), rel=1e-6)
        assert r["half_width"] == pytest.approx(1.96 * r["stderr"], rel=1e-3)
        assert f"{r['value']:.4f} ± {r['half_width']:.4f}" in out.stdout
    # above the base by more than 2 standard errors of the difference
    assert distilled["vs_base"] == pytest.approx(distilled["value"] - base["value"])
    assert distilled["vs_base"] > 2 * math.hypot(distilled["stderr"], base["stderr"]), (distilled, base)
    assert distilled["vs_base_se"] > 2
    assert ce_only["vs_base"] == pytest.approx(ce_only["value"] - base["value"])
    assert f"vs base {distilled['vs_base']:+.4f} ({distilled['vs_base_se']:+.1f} SE)" in out.stdout
    # what each run scored itself at its end (downstream.tasks) is what kdsweep eval measured on its merged export
    for name in ("0", "1"):
        record = read_run(runs / "sweep" / name)
        own = record["downstream"][TASK]
        assert {k: own[k] for k in ("metric", "value", "stderr", "items")} == \
            {k: rows[name][k] for k in ("metric", "value", "stderr", "items")}
        assert record["eval_after"][f"lm_eval/{TASK}"] == own["value"]
        assert (runs / "sweep" / name / "final" / "merged").is_dir()  # checkpoint.export_merged: kept


def test_bad_input_is_one_line(runs, tmp_path):
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    shadow = tmp_path / "shadow" / "lm_eval"  # lm-eval not installed, as a fresh environment has it
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named lm_eval')\n")
    merged = runs / "sweep" / "1" / "final" / "merged"
    cases = [
        (["eval", str(merged), "--tasks", "no_such_task"], {},
         f"--tasks: lm-eval knows no task 'no_such_task'; use {TASK} (shipped)"),
        (["eval", str(no_weights)], {}, f"eval.path={no_weights} has no weights"),
        (["eval", str(merged)], {"PYTHONPATH": str(shadow.parent)},
         "kdsweep eval runs lm-evaluation-harness, which is not installed; pip install 'kdsweep[eval]'"),
        (["eval", str(tmp_path)], {}, f"{tmp_path} is neither a model directory (config.json), a run directory"),
    ]
    for args, env, expected in cases:
        proc = kdsweep(*args, cwd=tmp_path, check=False, env_extra=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr


def test_a_merged_student_written_only_to_be_scored_is_removed_after_it_is_scored(zoo_dirs, tmp_path):
    """``downstream.tasks`` with ``checkpoint.export_merged=false``: the merged export goes once scored (and when the
    scoring fails), and the exports say so; with ``export_merged`` it stays."""
    import shutil

    from kdsweep.config.schema import DownstreamConfig
    from kdsweep.evaluation import downstream

    merged = tmp_path / "final" / "merged"
    shutil.copytree(zoo_dirs["student"], merged)  # a model directory as the export writes it
    exports = {"adapter": str(tmp_path / "final" / "adapter"), "merged": str(merged)}
    scores, kept = downstream.score(exports, DownstreamConfig(tasks=(TASK,), limit=40), keep_merged=True)
    assert merged.is_dir() and kept == exports and scores[TASK]["items"] == 40
    assert scores[TASK]["metric"] == "acc" and scores[TASK]["higher_is_better"] is True
    again, left = downstream.score(exports, DownstreamConfig(tasks=(TASK,), limit=40), keep_merged=False)
    assert not merged.exists() and left == {"adapter": exports["adapter"]} and again == scores
    shutil.copytree(zoo_dirs["student"], merged)
    (merged / "config.json").write_text("{")  # a model lm-eval cannot load
    with pytest.raises(Exception):
        downstream.score(exports, DownstreamConfig(tasks=(TASK,), limit=40), keep_merged=False)
    assert not merged.exists()
