"""A packed sweep on the real local SLURM cluster (hydra.sweeper.pack=4): 8 search trials in 2 packs of 4 on a warm
worker job, pruning (a member that learns nothing is pruned at its first evaluation, its pack goes on), a device
budget, and a confirmation (top 1 and CE-only, 3 seeds: a pack of the two per seed); the controller killed (kill -9)
as it launched the first confirmation pack, then `kdsweep resume`: every member is its own trial in the study, in
`kdsweep status` and in the budget, and nothing ran twice."""

import json
from pathlib import Path

import pytest

from conftest import kdsweep, read_metrics, read_run
from test_slurm_jobs import ONE_THREAD
from test_sweep import manifest, search, study

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

LEARNS = [{"kd_ratio": k, "lr": 0.01} for k in (0.2, 0.5, 0.8, 1.0)]
POINTS = [*LEARNS, *LEARNS[:3], {"kd_ratio": 0.5, "lr": 1e-6}]
"""The enqueued points: the first pack trains with nothing to prune against; in the second, the last member (a learning
rate that learns nothing) is worse at its first evaluation than the 90th percentile of the 4 completed trials."""


def test_a_packed_budgeted_sweep_prunes_confirms_and_resumes_on_slurm(tmp_path, zoo_dirs):
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "packs", {
        "n_trials": 8, "budget": 1.0, "max_concurrent": 4, "pack": 4, "workers": 1, "sampler": "random",
        "pruner": "percentile", "pruner_percentile": 90.0, "pruner_startup_trials": 2, "pruner_warmup_steps": 0,
        "poll_s": 0.5, "confirm": {"top": 1, "seeds": 3, "baseline_trials": 0}, "enqueue": POINTS,
        "params": {"kd_ratio": "choice(0.2,0.5,0.8,1.0)", "lr": "choice(1e-6,0.01)"},
    }, {"train": {"max_steps": 4, "eval_every": 2}, "data": {"test_fraction": 0.05}})
    cmd = [*args, *ONE_THREAD, "hydra/launcher=submitit_slurm", "cluster=local_cpu", "hydra.launcher.tasks_per_node=1",
           f"hydra.sweep.dir={sweep_dir}"]
    killed = kdsweep(*cmd, cwd=tmp_path, check=False, env_extra={"KDSWEEP_TEST_CRASH_AT": "after_launch:confirm0"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    died = manifest(sweep_dir)["trials"]
    assert sorted(t["state"] for t in died.values() if t.get("confirm")) == ["STARTING", "STARTING"]
    resumed = kdsweep("resume", str(sweep_dir), cwd=tmp_path, check=False, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]

    data = manifest(sweep_dir)
    trials = sorted(data["trials"].values(), key=lambda t: t["number"])
    states = [t.state.name for t in study(sweep_dir, "packs").trials]
    assert states == ["COMPLETE"] * 7 + ["PRUNED"] + ["COMPLETE"] * 6, states
    # 2 search packs of 4, then one pack per confirmation seed: top1 and CE-only on the same batches
    packs = {tuple(t["pack"]["members"]) for t in trials}
    assert packs == {(0, 1, 2, 3), (4, 5, 6, 7), (8, 9), (10, 11), (12, 13)}, packs
    confirmation = [t for t in trials if t.get("confirm")]
    by_pack = {}
    for t in confirmation:
        by_pack.setdefault(tuple(t["pack"]["members"]), []).append(t["confirm"])
    assert all(sorted(c["label"] for c in cs) == ["ce_only", "top1"] and len({c["seed"] for c in cs}) == 1
               for cs in by_pack.values()), by_pack
    assert all(t["attempts"] == 1 for t in trials)  # the killed controller's pack adopted, not submitted again
    for t in trials:  # every row once; each member its own record
        rows = [(r["kind"], r["step"]) for r in read_metrics(Path(t["run_dir"]))]
        assert len(rows) == len(set(rows)), t["number"]
    pruned = read_run(sweep_dir / "7")
    assert pruned["status"] == "pruned" and pruned["steps"] == 2
    assert data["verdict"]["best"] == "top1"
    # the budget counts each member's share of its pack's job, not the pack's whole time per member
    records = [read_run(Path(t["run_dir"])) for t in trials]
    members = sum(r["cost"]["device_seconds"] for r in records)
    walls = sum(max(r["cost"]["trial_seconds"] for r, t in zip(records, trials) if t["pack"]["members"] == list(p))
                for p in packs)
    assert members == pytest.approx(walls, rel=0.1), (members, walls)
    idle = data["cost"]["worker_idle_device_seconds"]
    assert data["budget"]["device_seconds_spent"] == pytest.approx(members + idle, rel=0.05)
    status = kdsweep("status", str(sweep_dir), cwd=tmp_path).stdout
    for t in trials:
        line = next(line for line in status.splitlines() if line.split()[:1] == [str(t["number"])])
        assert t["state"] in line and f"[pack {'+'.join(map(str, t['pack']['members']))}]" in line, line
    tasks = [json.loads(p.read_text()) for p in sorted((sweep_dir / "workers").glob("*/task-*.json"))]
    assert sorted(t["args"][1] for t in tasks if not t.get("stop")) == sorted(
        str(sweep_dir / "packs" / str(p[0])) for p in packs)  # one task per pack, none twice
