"""`kdsweep export`'s choice of runs: a run directory, a sweep's trial, its best, every seed of its confirmed point."""

import json

import pytest

from kdsweep.checkpoint.package import pick
from kdsweep.config import ConfigError


def trial(tmp_path, number, state="COMPLETE", values=(4.5,), confirm=None):
    return {"number": number, "state": state, "values": list(values), "run_dir": str(tmp_path / str(number)),
            "params": {}, **({"confirm": confirm} if confirm else {})}


def write_sweep(tmp_path, trials, directions=("minimize",), confirmation=None, verdict=None):
    data = {"study_name": "s", "settings": {"directions": list(directions)},
            "trials": {str(t["number"]): t for t in trials}}
    if confirmation:
        data["confirmation"], data["verdict"] = confirmation, verdict
    (tmp_path / "sweep.json").write_text(json.dumps(data))


def test_the_best_is_the_search_s_best_trial_and_the_point_the_verdict_reports(tmp_path):
    search = [trial(tmp_path, 0, values=(4.6,)), trial(tmp_path, 1, values=(4.4,)),
              trial(tmp_path, 2, "PRUNED", values=(4.1,)), trial(tmp_path, 3, "FAIL", values=())]
    write_sweep(tmp_path, search)
    assert pick(tmp_path, None, False) == ([("trial1", tmp_path / "1")], {"sweep": str(tmp_path), "verdict": None})
    seeds = [trial(tmp_path, 4 + 2 * s + i, values=(4.3,), confirm={"label": label, "seed": 1000 + s})
             for s in range(3) for i, label in enumerate(("top1", "ce_only"))]
    seeds[4]["state"] = "FAIL"  # top1's third seed (trial 8)
    plan = {"points": [{"label": "top1", "search_trial": 0}, {"label": "ce_only", "search_trial": None}]}
    write_sweep(tmp_path, search + seeds, confirmation=plan, verdict={"best": "top1", "line": "v"})
    runs, about = pick(tmp_path, None, False)  # the plan's top1, however the confirmation's means fell
    assert runs == [("trial0", tmp_path / "0")] and about["verdict"] == "v"
    assert pick(tmp_path, None, True)[0] == [("top1-seed1000", tmp_path / "4"), ("top1-seed1001", tmp_path / "6")]
    assert pick(tmp_path, 5, False)[0] == [("trial5", tmp_path / "5")]


@pytest.mark.parametrize("case, message", [
    ("nothing", "holds neither sweep.json nor run.json: pass a sweep directory or a run directory"),
    ("no_trial", "trial 9 is not in"),
    ("pareto", "is a study of several objectives (no single best): export --trial N"),
    ("unconfirmed", "has no confirmed point (no verdict, or none of its seeds completed): export --best or --trial N"),
    ("run_confirmed", "is a run directory: --trial and --confirmed pick from a sweep directory"),
])
def test_what_cannot_be_exported_is_one_line(tmp_path, case, message):
    if case == "pareto":
        write_sweep(tmp_path, [trial(tmp_path, 0, values=(4.5, 1.0))], directions=("minimize", "minimize"))
    elif case in ("no_trial", "unconfirmed"):
        write_sweep(tmp_path, [trial(tmp_path, 0)])
    elif case == "run_confirmed":
        (tmp_path / "run.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        pick(tmp_path, 9 if case == "no_trial" else None, case in ("unconfirmed", "run_confirmed"))
    assert message in str(e.value) and "\n" not in str(e.value)
