"""Known answers, end to end on the embedded default: what the sweep's verdict says is what is known to be true,
and its numbers are the run records' (t quantiles written down, not recomputed by the formula under test).

- the embedded default's KD point against CE-only: KD beats it;
- a teacher that is random-init noise at kd_ratio 0.9: CE-only beats it;
- the same KD point with 5% more learning rate: the verdict decides it as the recorded paired differences' t says
  at Holm's level. (It is not "within the noise" under paired seeds: the same seeds give both points the same data
  order and initialisation, so even a 5% learning-rate change shows as a consistent shift; measured at 20 steps:
  t = 7.5 over 3 seeds, and the verdict said so.)
"""

import math
import statistics
from pathlib import Path

import pytest

from conftest import QUIET, REPO, kdsweep, read_run
from test_sweep import manifest, search

pytestmark = pytest.mark.slow

T_975_2DF = 4.303  # t(0.975, 2 df): 95% interval of 3 seeds; the second step of Holm's two
T_9875_2DF = 6.205  # t(0.9875, 2 df): the first step of Holm's correction over two comparisons
STEPS = 20
SECOND = "lm_eval/kdsweep_next_word"
ITEMS = 400  # of the shipped task's items, scored by the confirmation's seeds and by kdsweep eval alike


def confirmed(tmp_path: Path, name: str, enqueue: list[dict], *overrides: str) -> dict:
    """A sweep of the enqueued points (pruning off), then each point and CE-only on 3 seeds; its manifest, with
    ``values[label][seed]``: the test-split CE each confirmation trial's run.json recorded."""
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, name, {
        "n_trials": len(enqueue), "max_concurrent": 2, "workers": 2, "sampler": "random", "pruner": "none",
        "params": {"kd_ratio": "interval(0.0,1.0)", "lr": "tag(log, interval(1e-3,3e-2))"}, "enqueue": enqueue,
        "confirm": {"top": len(enqueue), "seeds": 3, "baseline_trials": 0},
    }, {"train": {"max_steps": STEPS, "eval_every": STEPS}, "data": {"test_fraction": 0.05}})
    kdsweep(*args, *overrides, "train.threads=1", *QUIET, f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    data = manifest(sweep_dir)
    data["values"] = {}
    for t in data["trials"].values():
        if t.get("confirm"):
            record = read_run(Path(t["run_dir"]))
            assert record["config"]["train"]["seed"] == record["config"]["rollout"]["seed"] == t["confirm"]["seed"]
            data["values"].setdefault(t["confirm"]["label"], {})[t["confirm"]["seed"]] = \
                record["test_after"]["student_ce"]  # the verdict's split
    return data


def paired(values: dict, a: str, b: str) -> tuple[float, float, float]:
    """Mean of a − b over the seeds, its unadjusted 95% half-width and its t statistic."""
    diffs = [values[a][s] - values[b][s] for s in sorted(values[a])]
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    return mean, T_975_2DF * se, mean / se


@pytest.fixture(scope="module")
def default_point(tmp_path_factory, zoo_dirs):
    """The embedded default's KD point (kd_ratio 0.5, lr 0.01) and the same with lr 0.0105; the trials keep their
    adapters, as the shipped searches' do (kdsweep eval reads them); the confirmation's seeds are also scored on the
    shipped lm-eval task's first ITEMS items, at kdsweep eval's batch size (``confirm.also``)."""
    return confirmed(tmp_path_factory.mktemp("verdict_default"), "known",
                     [{"kd_ratio": 0.5, "lr": 0.01}, {"kd_ratio": 0.5, "lr": 0.0105}], "checkpoint.export_adapter=true",
                     f"hydra.sweeper.confirm.also=[{SECOND}]", "downstream.batch_size=32", f"downstream.limit={ITEMS}")


def test_kd_at_the_embedded_default_beats_ce_only(default_point):
    line, values = default_point["verdict"]["line"], default_point["values"]
    ce_only = next(p for p in default_point["confirmation"]["points"] if p["label"] == "ce_only")["params"]
    assert ce_only["loss.kd_ratio"] == 0.0 and ce_only["rollout.lmbda"] == 0.0 and ce_only["rollout.seq_kd"] is False
    mean, half, t = paired(values, "ce_only", "top1")
    assert abs(t) > T_9875_2DF  # past Holm's first step whichever comparison takes it
    assert f"beats CE-only by {mean:.4f} ± {half:.4f} (3 seeds; Holm over 2 comparisons" in line, line


def test_learning_rates_5_percent_apart_are_decided_as_their_paired_t_says(default_point):
    line, values = default_point["verdict"]["line"], default_point["values"]
    mean, half, t = paired(values, "top2", "top1")
    t_kd = paired(values, "ce_only", "top1")[2]
    # Holm over the two (same df, so a larger |t| is a smaller p): the larger is tested first at t(0.9875), the other
    # at t(0.975) only if the first was rejected
    first = abs(t) >= abs(t_kd)
    quantile = T_9875_2DF if first else T_975_2DF
    if abs(t) > quantile and (first or abs(t_kd) > T_9875_2DF):
        who = "top1 beats it" if mean > 0 else "beats top1"
        assert f"; top2: {who} by {abs(mean):.4f} ± {half:.4f} (3 seeds; Holm over 2 comparisons: t={quantile})" \
            in line, line
    else:
        assert f"; top2: not distinguishable from top1 ({-mean:+.4f} ± {half:.4f} unadjusted, 3 seeds" in line, line


def test_eval_scores_the_confirmed_point_and_ce_only_over_their_seeds_beside_the_base(default_point, tmp_path):
    """`kdsweep eval <sweep>`: the verdict's point and CE-only, each over its 3 confirmation seeds (mean ± the t
    interval across them), and the base student they trained from, on the shipped lm-eval task."""
    import json

    from kdsweep.evaluation.task import TASK

    sweep = Path(default_point["trials"]["0"]["run_dir"]).parent
    out = kdsweep("eval", str(sweep), "--json", str(tmp_path / "eval.json"), "--limit", str(ITEMS), cwd=tmp_path)
    rows = {r["name"]: r for r in json.loads((tmp_path / "eval.json").read_text())["rows"]}
    base = Path(read_run(Path(default_point["trials"]["0"]["run_dir"]))["models"]["student"]).name
    best = default_point["verdict"]["best"]
    assert set(rows) == {f"{best} (3 seeds)", "ce_only (3 seeds)", f"base: {base}"}
    for name in (f"{best} (3 seeds)", "ce_only (3 seeds)"):
        r = rows[name]
        assert len(r["values"]) == 3 and r["value"] == pytest.approx(statistics.fmean(r["values"]))
        assert r["items"] == ITEMS
        assert r["half_width"] == pytest.approx(T_975_2DF * statistics.stdev(r["values"]) / math.sqrt(3), rel=1e-3)
        assert f"{r['value']:.4f} ± {r['half_width']:.4f}" in out.stdout and r["vs_base"] is not None
    # the verdict's second measure: what each seed's trial scored itself once trained is what kdsweep eval measured
    also = default_point["verdict"]["also"][SECOND]
    assert also["mean"] == pytest.approx(rows[f"{best} (3 seeds)"]["value"], abs=1e-12)
    assert also["ce_only"] == pytest.approx(rows["ce_only (3 seeds)"]["value"], abs=1e-12)
    assert f"; on {SECOND}, top1 {also['mean']:.4f} ± {also['ci95']:.4f}: " in default_point["verdict"]["line"]
    assert not [t for t in default_point["trials"].values()  # only the confirmation's seeds paid for it
                if any(a.startswith("downstream.tasks=") for a in t["args"]) != bool(t.get("confirm"))]
    evaluated = [t for t in default_point["trials"].values()
                 if (t.get("confirm") or {}).get("label") in (best, "ce_only")]
    for t in evaluated:  # each evaluated seed's export's model card
        (card,) = Path(t["run_dir"]).glob("export/*/README.md")  # kdsweep eval exported it from the adapter
        score = read_run(Path(t["run_dir"]))["downstream"]["kdsweep_next_word"]
        assert f"- lm-eval kdsweep_next_word: acc {score['value']:.4g} ± {score['stderr']:.4g} (standard error), " \
               f"{score['items']} items" in card.read_text()
    from kdsweep.analysis import load_sweep

    table = load_sweep(sweep, study=False).confirmation().set_index("label")  # the notebook's confirmation table
    assert table.loc[best, f"{SECOND}.mean"] == also["mean"]
    assert table.loc["ce_only", f"{SECOND}.mean"] == also["ce_only"]
    assert table[f"{SECOND}.mean"].isna().sum() == len(table) - 2  # scored for top1 and CE-only only
    # the sweep keeps the table, and the analysis notebook's cell shows it
    assert json.loads((sweep / "eval.json").read_text()) == json.loads((tmp_path / "eval.json").read_text())
    assert f"saved in {sweep / 'eval.json'}" in out.stdout
    shown = notebook_cell_display(sweep, "evaluation = sweep.evaluation()")
    assert list(shown.index) == [(TASK, name) for name in rows]
    assert list(shown["value"]) == [rows[name]["value"] for name in rows]
    assert list(shown["vs_base_se"].fillna(0.0)) == [rows[name].get("vs_base_se") or 0.0 for name in rows]


def notebook_cell_display(sweep_dir, starts):
    """Run notebooks/sweep_analysis.ipynb's code cell that starts with ``starts`` on this sweep (``sweep`` loaded as
    its first cells load it); what it displays."""
    import nbformat

    from kdsweep.analysis import load_sweep

    nb = nbformat.read(REPO / "notebooks" / "sweep_analysis.ipynb", as_version=4)
    (source,) = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts)]
    shown = []
    exec(source, {"sweep": load_sweep(sweep_dir, study=False), "display": shown.append, "print": shown.append})
    (frame,) = shown
    return frame


def test_a_random_teacher_at_kd_ratio_0_9_loses_to_ce_only(tmp_path, zoo_dirs):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kdsweep.models.zoo import model_dir

    noise = tmp_path / "noise-teacher"
    torch.manual_seed(0)
    source = model_dir("tiny-teacher")
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(noise)
    AutoTokenizer.from_pretrained(source).save_pretrained(noise)
    data = confirmed(tmp_path, "noise", [{"kd_ratio": 0.9, "lr": 0.01}], f"teacher.path={noise}")
    mean, half, t = paired(data["values"], "ce_only", "top1")
    assert mean < 0 and abs(t) > T_975_2DF
    line = data["verdict"]["line"]
    assert f"CE-only beats it by {-mean:.4f} ± {half:.4f} (3 seeds; Holm over 1 comparison: t={T_975_2DF})" in line
