"""`kdsweep prepare`, then the sweep on the real local SLURM cluster: prepare tokenizes the data and builds (as one
SLURM job of the sweep's launcher settings) the teacher cache of every value of a searched knob in the cache's key (here the loss's temperature, which `sample`
draws at), once, and prints first what it will write; the sweep's trials read those caches and compute no teacher
token. A continuous search over such a knob is refused with the fix."""

import json
import re
from pathlib import Path

import pytest

from conftest import kdsweep, read_run
from test_slurm_jobs import ONE_THREAD, wait_for_states
from test_sweep import manifest, search

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]


def args_for(tmp_path, temperature: str) -> list[str]:
    points = [{"kd_ratio": k, "loss.temperature": t} for k in (0.3, 0.7) for t in (1.0, 2.0)]
    return [*search(tmp_path, "prepared", {
        "n_trials": 4, "max_concurrent": 2, "workers": 2, "sampler": "random", "pruner": "none",
        "confirm": {"top": 0}, "params": {"kd_ratio": "choice(0.3,0.7)", "loss.temperature": temperature},
        "enqueue": points,
    }, {"train": {"max_steps": 4, "eval_every": 4}}), "teacher.logits=cache",
        f"teacher.cache.dir={tmp_path / 'teacher_cache'}"]


def test_prepare_builds_each_cache_once_and_the_sweep_s_trials_only_read_them(tmp_path, zoo_dirs):
    args = args_for(tmp_path, "choice(1.0,2.0)")
    dry = kdsweep("prepare", "--dry-run", *args, cwd=tmp_path)
    planned = [int(b) for b in re.findall(r"over \d+ positions: .* \((\d+) bytes; ", dry.stdout)]
    assert len(planned) == 2 and "k=12 draws at T=1," in dry.stdout and "k=12 draws at T=2," in dry.stdout
    assert not (tmp_path / "teacher_cache").exists() or not any((tmp_path / "teacher_cache").glob("*/meta.json"))
    slurm = ["hydra/launcher=submitit_slurm", "cluster=local_cpu"]
    out = kdsweep("prepare", *args, *slurm, cwd=tmp_path)  # one SLURM job of the sweep's launcher settings
    job = re.search(r"prepare: SLURM job (\d+) builds them", out.stdout)
    assert job, out.stdout  # prepare returns with the job's result; SLURM may still be ending the job
    assert wait_for_states(job[1], {"COMPLETED"}).get(job[1]) == "COMPLETED", out.stdout
    built = re.findall(r"teacher cache built: (\S+)", out.stdout)
    assert len(built) == 2 and len(set(built)) == 2, out.stdout
    for path, size in zip(built, planned):  # what --dry-run said, within 5% of the files written
        written = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
        assert abs(written - size) <= 0.05 * size, (written, size)

    sweep_dir = tmp_path / "sweep"
    kdsweep(*args, *ONE_THREAD, *slurm, "hydra.launcher.tasks_per_node=1", f"hydra.sweep.dir={sweep_dir}",
            cwd=tmp_path, timeout=900)
    trials = manifest(sweep_dir)["trials"]
    assert len(trials) == 4 and all(t["state"] == "COMPLETE" for t in trials.values())
    by_temperature = {}
    for t in trials.values():
        record = read_run(sweep_dir / str(t["number"]))
        targets = record["teacher_targets"]
        assert targets["built"] is False and targets["rows"] == "all", targets
        assert record["cost"]["teacher_tokens_computed"] == 0 and record["cost"]["teacher_tokens_read"] > 0
        by_temperature.setdefault(t["params"]["loss.temperature"], set()).add(targets["dir"])
    assert sorted(d for dirs in by_temperature.values() for d in dirs) == sorted(built)
    assert all(len(dirs) == 1 for dirs in by_temperature.values())
    metas = [json.loads((Path(p) / "meta.json").read_text()) for p in built]
    assert [m["rows"] for m in metas] == ["all", "all"]


def test_a_continuous_search_over_a_knob_of_the_cache_s_key_is_refused_with_the_fix(tmp_path, zoo_dirs):
    proc = kdsweep("prepare", "--dry-run", *args_for(tmp_path, "interval(1.0,2.0)"), cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == ("kdsweep: error: hydra.sweeper.params.loss.temperature: a continuous interval over a knob of "
                        "the teacher cache's key needs a cache per value; search a choice(...) of values instead, or "
                        "use teacher.cache.method=full (any temperature) or teacher.logits=live")
