"""The controller with ``hydra.sweeper.pack``: trials asked K at a time and started as one packed job, the budget
counting each member's share, a confirmation packed seed by seed; on a real Optuna study, with jobs that end at once
and write each member's record (the real packed jobs: tests/integration/test_pack_sweep.py)."""

import json
from pathlib import Path

import pytest
from test_budget import Recorded, own_storage_env  # noqa: F401  (the fixture: each sweep its own storage)

from kdsweep.pack.jobs import SPEC, member_dirs
from kdsweep.sweep.controller import Controller
from kdsweep.sweep.space import parse_space
from kdsweep.sweep.study import SweepSettings

SPACE = {"kd_ratio": "interval(0.0,1.0)"}
JOB_S = 100.0  # each job's wall seconds, whatever its members: a member records its share


class Packs(Recorded):
    """Jobs that end at their first poll, each member (a packed job's, or the one trial of a job) having written the
    run.json of a completed trial that paid its share of the job's ``JOB_S``."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: list[list[str]] = []

    def start(self, args, run_dir: Path, alone=False):
        self.jobs.append(args)
        run_dir.mkdir(parents=True, exist_ok=True)
        dirs = member_dirs(run_dir) if args[:1] == ["--pack"] else [run_dir]
        return {"dirs": [str(d) for d in dirs], "logs": []}

    def poll(self, job):
        for d in map(Path, job["dirs"]):
            d.mkdir(parents=True, exist_ok=True)
            (d / "run.json").write_text(json.dumps({
                "status": "completed", "world_size": 1, "eval_after": {"student_ce": 1.0 + len(str(d)) * 1e-3},
                "test_after": {"student_ce": 1.0}, "config": {"train": {"max_steps": 4}},
                "cost": {"trial_seconds": JOB_S, "device_seconds": JOB_S / len(job["dirs"])}}))
        return 0


def sweep(tmp_path, backend, **settings):
    s = SweepSettings(**{"study_name": "p", "sampler": "random", "seed": 0, "pruner": "none", "poll_s": 0.0,
                         "max_concurrent": 2, "pack": 2, **settings})
    return Controller(s, parse_space(SPACE), ["train=smoke"], tmp_path, backend).run()


def test_trials_are_asked_two_at_a_time_and_started_as_one_packed_job(tmp_path):
    backend = Packs()
    manifest = sweep(tmp_path, backend, n_trials=5)
    assert [len(member_dirs(Path(a[1]))) if a[0] == "--pack" else 1 for a in backend.jobs] == [2, 2, 1]
    trials = manifest.trials
    assert [trials[str(n)]["pack"]["members"] for n in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert "pack" not in trials["4"] and all(t["state"] == "COMPLETE" for t in trials.values())
    spec = json.loads((tmp_path / "packs" / "2" / SPEC).read_text())
    assert spec["numbers"] == [2, 3] and spec["members"] == [trials["2"]["args"], trials["3"]["args"]]


@pytest.mark.parametrize("budget_s", [300.0, 460.0])
def test_a_budget_counts_each_member_s_share_and_its_probe_is_a_whole_pack(tmp_path, budget_s):
    """Nothing is known of a trial's cost at first: the probe is one pack (both members), not one trial; each member
    then costs JOB_S / 2, so the budget buys twice the trials it would unpacked, and is overrun by at most a pack."""
    backend = Packs()
    manifest = sweep(tmp_path, backend, budget=budget_s / 3600.0)
    assert [a[0] for a in backend.jobs] == ["--pack"] * len(backend.jobs)
    spent = manifest.data["budget"]["device_seconds_spent"]
    assert spent == pytest.approx(JOB_S * len(backend.jobs)) and budget_s <= spent < budget_s + JOB_S
    assert len(manifest.trials) == 2 * len(backend.jobs)


def test_the_confirmation_packs_its_points_seed_by_seed(tmp_path):
    backend = Packs()
    manifest = sweep(tmp_path, backend, n_trials=4, confirm={"top": 1, "seeds": 3, "baseline_trials": 0})
    confirmation = [t for t in manifest.trials.values() if t.get("confirm")]
    packs = {}
    for t in confirmation:
        packs.setdefault(tuple(t["pack"]["members"]), []).append((t["confirm"]["label"], t["confirm"]["seed"]))
    assert len(packs) == 3 and all(sorted(label for label, _ in items) == ["ce_only", "top1"]
                                   and len({seed for _, seed in items}) == 1 for items in packs.values()), packs
    assert "verdict" in manifest.data
