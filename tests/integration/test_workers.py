"""Warm trial workers (hydra.sweeper.workers): a trial run in a worker right after others (one pruned, one failed,
other kd_ratio, lr and LoRA rank) equals the same trial run as its own process, bit for bit."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from conftest import QUIET, kdsweep, read_metrics, read_run
from test_sweep import manifest, search, study

pytestmark = pytest.mark.slow

TIMING = ("tokens_per_s", "tokens_per_s_per_rank", "step_s", "peak_mem_mb", "peak_mem_mb_per_rank", "generation_s",
          "generation_share")
"""Metrics a process measures (time, memory) rather than computes: everything else must be identical."""


def computed(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING and not k.endswith("_per_s")} for r in rows]


def worker_sweep(tmp_path, name: str, enqueue: list[dict], params: dict, overrides: dict, *args: str,
                 compare: tuple[int, ...] = ()):
    """A sweep of the enqueued points on one warm worker, one trial at a time (the median pruner stops a trial
    worse than the first at an eval), and beside it the points numbered ``compare``, each as its own process.
    Returns the sweep directory, the finished process and {number: the own process's run directory}."""
    sweep_dir = tmp_path / "sweep"
    search_args = search(tmp_path, name, {
        "n_trials": len(enqueue), "max_concurrent": 1, "workers": 1, "sampler": "random", "pruner": "median",
        "pruner_startup_trials": 1, "pruner_warmup_steps": 0, "params": params, "enqueue": enqueue,
    }, overrides)
    base = [*search_args[1:], *args, "train.threads=1", *QUIET]  # what the sweep gives every trial, without -m
    own_dirs = {n: tmp_path / f"alone-{n}" for n in compare}
    with ThreadPoolExecutor(1 + len(compare)) as pool:  # the worker trains on one core: the others use the second
        sweep = pool.submit(kdsweep, *search_args, *args, "train.threads=1", *QUIET, f"hydra.sweep.dir={sweep_dir}",
                            cwd=tmp_path)
        for n, run_dir in own_dirs.items():
            pool.submit(kdsweep, *base, *(f"{k}={v}" for k, v in enqueue[n].items()), f"hydra.run.dir={run_dir}",
                        cwd=tmp_path).result()
        proc = sweep.result()
    for n in own_dirs:  # the same arguments as the trial's (less the trial's own)
        own = [a for a in manifest(sweep_dir)["trials"][str(n)]["args"] if not a.startswith(("trial.", "hydra.run"))]
        assert sorted(own) == sorted([*base, *(f"{k}={v}" for k, v in enqueue[n].items())]), own
    return sweep_dir, proc, own_dirs


def alone(tmp_path, sweep_dir, number: int):
    """Trial ``number``'s arguments run as its own ``python -m kdsweep`` process (not in a sweep): its run dir."""
    args = [a for a in manifest(sweep_dir)["trials"][str(number)]["args"] if not a.startswith(("trial.", "hydra.run.dir"))]
    run_dir = tmp_path / f"alone-{number}"
    kdsweep(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    return run_dir


def assert_identical(warm, cold):
    """The warm trial's numbers are its own process's. A pruned warm trial (its own process ran on): every row up to
    the step it stopped at, and its objective is the evaluation its own process logged at that step."""
    a, b = read_run(warm), read_run(cold)
    rows_a, rows_b = computed(read_metrics(warm)), computed(read_metrics(cold))
    if a["status"] == "pruned":
        rows_b = [r for r in rows_b if r["step"] <= a["steps"]]
        assert rows_b[-1]["kind"] == "eval" and a["objective"] == rows_b[-1]["student_ce"]
    else:
        assert a["objective"] == b["objective"], (a["objective"], b["objective"])
        assert a["eval_after"] == b["eval_after"]
    assert rows_a == rows_b


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, zoo_dirs):
    """The embedded default with the teacher-logit cache, 1 rank: a completed trial, a pruned one (lr 1e-7 cannot
    learn), one that fails in its job (train.device=cuda: no CUDA here), then trial 3, compared below. The first
    learns slowly (lr 1e-5), so the pruner stops the one that cannot learn and lets trial 3 finish."""
    tmp_path = tmp_path_factory.mktemp("workers1")
    sweep_dir, proc, own = worker_sweep(tmp_path, "warm1", [
        {"lr": 1e-5, "kd_ratio": 0.3, "lora_rank": 4, "train.device": "cpu"},
        {"lr": 1e-7, "kd_ratio": 0.5, "lora_rank": 8, "train.device": "cpu"},
        {"lr": 0.01, "kd_ratio": 0.5, "lora_rank": 4, "train.device": "cuda"},
        {"lr": 0.01, "kd_ratio": 0.7, "lora_rank": 8, "train.device": "cpu"},
    ], {"lr": "tag(log, interval(1e-7,1e-1))", "kd_ratio": "interval(0.0,1.0)", "lora_rank": "choice(4,8)",
        "train.device": "choice(cpu,cuda)"},
        {"train": {"eval_every": 2, "max_steps": 6}}, "teacher.logits=cache", compare=(3,))
    return tmp_path, sweep_dir, proc, own


def test_one_worker_runs_every_trial_and_the_controller_judges_them(one_rank):
    tmp_path, sweep_dir, proc, _ = one_rank
    trials = study(sweep_dir, "warm1").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "FAIL", "COMPLETE"]
    assert "train.device=cuda but no CUDA device" in trials[2].user_attrs["reason"]  # its one line
    entries = manifest(sweep_dir)["trials"]
    assert {e["job"]["worker"] for e in entries.values()} == {"w0"}
    state = json.loads((sweep_dir / "workers" / "w0" / "worker.json").read_text())
    assert state["trials_run"] == 4 and state["state"] == "left"  # it left once the sweep was over
    assert "worker w0" in proc.stdout  # the summary names the job of each trial


def test_a_warm_trial_equals_its_own_process(one_rank):
    tmp_path, sweep_dir, _, own = one_rank
    warm = sweep_dir / "3"
    assert read_run(warm)["environment"]["worker"] == {"name": "w0", "trials_before": 3, "start": "warm", "boot_seconds": 0.0}
    cold = read_run(sweep_dir / "0")
    assert cold["environment"]["worker"]["start"] == "cold"  # the worker's own start-up, before it took trial 0
    assert 0 < cold["environment"]["worker"]["boot_seconds"] < cold["cost"]["startup_seconds"]
    assert_identical(warm, own[3])


def test_a_warm_trial_writes_its_own_directory_and_log(one_rank):
    tmp_path, sweep_dir, _, _ = one_rank
    record = read_run(sweep_dir / "3")
    assert record["status"] == "completed" and record["trial"]["number"] == 3
    assert record["teacher_targets"]["source"] == "cache" and not record["teacher_targets"]["built"]
    logs = subprocess.run([sys.executable, "-m", "kdsweep", "logs", str(sweep_dir), "3"], capture_output=True, text=True)
    assert logs.returncode == 0 and "held-out CE after 6 steps" in logs.stdout
    assert logs.stdout.count("held-out CE after") == 1 and str(sweep_dir / "2") not in logs.stdout  # its own only
    assert "kept by this worker from an earlier trial" in (sweep_dir / "3" / "kdsweep.log").read_text()
    assert record["kept"] == ["tokenizer", "data"] and read_run(sweep_dir / "0")["kept"] == []
    # start-up: the first trial paid the worker's imports (cold), the later ones only their own config and models
    cold, warm = (read_run(sweep_dir / str(n))["cost"]["startup_seconds"] for n in (0, 3))
    assert 0 < warm < cold, (warm, cold)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, zoo_dirs):
    """2 ranks, a live teacher kept by the worker: a slow first trial, a pruned one and a failed one, then a LoRA
    trial and a full fine-tune, compared below."""
    tmp_path = tmp_path_factory.mktemp("workers2")
    sweep_dir, proc, own = worker_sweep(tmp_path, "warm2", [
        {"lr": 1e-5, "lora_rank": 4, "train.device": "cpu"},
        {"lr": 1e-7, "lora_rank": 8, "train.device": "cpu"},
        {"lr": 0.01, "lora_rank": 4, "train.device": "cuda"},
        {"lr": 0.01, "lora_rank": 8, "train.device": "cpu"},
        {"lr": 0.001, "lora_rank": 0, "train.device": "cpu"},
    ], {"lr": "tag(log, interval(1e-7,1e-1))", "lora_rank": "choice(0,4,8)", "train.device": "choice(cpu,cuda)"},
        {"train": {"eval_every": 2, "max_steps": 4}, "dist": {"nproc_per_node": 2}}, compare=(3, 4))
    return tmp_path, sweep_dir, proc, own


def test_two_rank_warm_trials_equal_their_own_processes(two_ranks):
    tmp_path, sweep_dir, _, own = two_ranks
    assert [t.state.name for t in study(sweep_dir, "warm2").trials] == ["COMPLETE", "PRUNED", "FAIL", "COMPLETE",
                                                                         "COMPLETE"]
    for number in (3, 4):  # LoRA rank 8, then a full fine-tune, after a pruned trial and a failed one
        warm = sweep_dir / str(number)
        record = read_run(warm)
        assert record["world_size"] == 2 and record["environment"]["worker"]["trials_before"] == number
        assert_identical(warm, own[number])
        assert record["kept"] == ["tokenizer", "data", "live_teacher"]  # the teacher's weights stay loaded
    assert math.isfinite(read_run(sweep_dir / "4")["objective"])


def test_status_says_what_a_two_rank_step_moves(two_ranks):
    """The trials' counted collectives: the student's all-gathers and reduce-scatters, and nothing for the teacher,
    which ``auto`` replicated on both ranks (it fits)."""
    _, sweep_dir, _, _ = two_ranks
    out = subprocess.run([sys.executable, "-m", "kdsweep", "status", str(sweep_dir)], capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("collectives per training step"))
    assert "student" in line and "all-gather" in line and "reduce-scatter" in line, line
    assert "teacher none (replicated, or a cache)" in line, line
    record = read_run(sweep_dir / "3")
    assert record["placement"]["teacher"]["placement"] == "replicate" and "teacher" not in record["comm"]["train"]
    assert record["comm"]["per_step"]["student"]["reduce_scatter"]["bytes"] > 0


def wait_for(condition, what: str, proc=None, timeout: float = 300):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        assert proc is None or proc.poll() is None, f"the sweep ended before {what}"
        time.sleep(0.1)


def worker_state(sweep_dir, name: str) -> dict:
    path = sweep_dir / "workers" / name / "worker.json"
    return json.loads(path.read_text()) if path.exists() else {}


def train_steps(run_dir) -> list[int]:
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r["step"] for r in read_metrics(run_dir) if r["kind"] == "train"]


@pytest.fixture(scope="module")
def faults(tmp_path_factory, zoo_dirs):
    """3 trials of 30 steps on 2 workers. The controller is killed (kill -9) while both workers are busy and resumed
    (`kdsweep resume`); then the worker running trial 0 is killed (kill -9) mid-trial, after its checkpoint at step
    10: what was seen, and the resume's run."""
    tmp_path = tmp_path_factory.mktemp("workers_faults")
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "faults", {
        "n_trials": 3, "max_concurrent": 2, "workers": 2, "sampler": "random", "pruner": "none",
        "params": {"kd_ratio": "interval(0.0,1.0)"}, "enqueue": [{"kd_ratio": 0.3}, {"kd_ratio": 0.6}, {"kd_ratio": 0.9}],
    }, {"train": {"eval_every": 15, "max_steps": 30}, "checkpoint": {"save_every": 5, "export_adapter": False,
                                                                     "export_merged": False}})
    cmd = [sys.executable, "-m", "kdsweep", *args, "train.threads=1", *QUIET, f"hydra.sweep.dir={sweep_dir}"]
    controller = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reference = tmp_path / "alone-0"  # trial 0 uninterrupted, as its own process, beside the sweep
    pool = ThreadPoolExecutor(1)
    reference_done = pool.submit(kdsweep, *args[1:], "train.threads=1", *QUIET, "kd_ratio=0.3",
                                 f"hydra.run.dir={reference}", cwd=tmp_path)
    wait_for(lambda: all(worker_state(sweep_dir, w).get("state") == "busy" for w in ("w0", "w1")),
             "both workers busy", controller)
    os.kill(controller.pid, signal.SIGKILL)
    controller.wait()
    busy = {t["number"]: t["job"] for t in manifest(sweep_dir)["trials"].values() if t["state"] == "RUNNING"}

    resume = subprocess.Popen([sys.executable, "-m", "kdsweep", "resume", str(sweep_dir)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: len(train_steps(sweep_dir / "0")) >= 12, "trial 0 past its checkpoint at step 10", resume)
    victim = manifest(sweep_dir)["trials"]["0"]["job"]["worker"]
    os.kill(json.loads((sweep_dir / "workers" / victim / "launch.json").read_text())["pid"], signal.SIGKILL)
    out, err = resume.communicate(timeout=600)
    reference_done.result()
    pool.shutdown()
    return SimpleNamespace(tmp_path=tmp_path, sweep_dir=sweep_dir, busy=busy, victim=victim, code=resume.returncode,
                           out=out, err=err, reference=reference)


def test_a_resumed_controller_reattaches_to_busy_workers_and_a_killed_workers_trial_resumes(faults):
    sweep_dir = faults.sweep_dir
    assert faults.code == 0, faults.err[-3000:]
    assert sorted(faults.busy) == [0, 1]  # both were running when the controller died
    trials = manifest(sweep_dir)["trials"]
    assert [trials[str(n)]["state"] for n in range(3)] == ["COMPLETE"] * 3
    assert [t.number for t in study(sweep_dir, "faults").trials] == [0, 1, 2]  # exactly the asked trials
    assert trials["1"]["attempts"] == 1 and trials["2"]["attempts"] == 1  # re-attached to, never restarted
    assert trials["1"]["job"] == faults.busy[1]
    # the killed worker's trial: one more attempt, on another worker, from its checkpoint; no step twice
    assert trials["0"]["attempts"] == 2 and trials["0"]["job"]["worker"] != faults.victim
    record = read_run(sweep_dir / "0")
    assert record["resumed_from"] and record["start_step"] >= 10
    assert train_steps(sweep_dir / "0") == list(range(1, 31))
    assert record["objective"] == pytest.approx(read_run(faults.reference)["objective"], abs=1e-5)


def test_workers_that_cannot_start_stop_the_sweep_with_one_line(tmp_path, zoo_dirs):
    """Every worker dies before it is ready (the sweep's device does not exist here): the sweep stops, saying why."""
    args = search(tmp_path, "nostart", {"n_trials": 2, "max_concurrent": 1, "workers": 1, "sampler": "random",
                                        "pruner": "none", "params": {"kd_ratio": "interval(0.0,1.0)"}},
                  {"train": {"max_steps": 2}})
    proc = kdsweep(*args, "train.device=cuda", *QUIET, f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path,
                   check=False, timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("kdsweep: error: no trial worker could start"), proc.stderr[-2000:]
    assert "train.device=cuda but no CUDA device" in last and "worker.log" in last


def test_a_trial_invalid_for_the_workers_model_or_data_fails_in_one_line_and_the_worker_goes_on(tmp_path, zoo_dirs):
    """On one worker: a LoRA target the student lacks, then a seq_len the data cannot fill, each refused in its own
    one line as its trial's reason (the sweep's up-front checks read neither the zoo student nor the tokens); the
    worker runs the next trial, warm."""
    text = tmp_path / "short.jsonl"  # a few hundred tokens: rows of 32 fill both splits, rows of 512 cannot
    text.write_text("".join(json.dumps({"text": f"in the beginning was the word number {i}"}) + "\n" for i in range(60)))
    args = search(tmp_path, "refused", {
        "n_trials": 4, "max_concurrent": 1, "workers": 1, "sampler": "random", "pruner": "none",
        "params": {"model.target_modules": "choice(all-linear,nope)", "data.seq_len": "choice(32,512)"},
        "enqueue": [{"model.target_modules": "all-linear", "data.seq_len": 32},
                    {"model.target_modules": "nope", "data.seq_len": 32},
                    {"model.target_modules": "all-linear", "data.seq_len": 512},
                    {"model.target_modules": "all-linear", "data.seq_len": 32}],
    }, {"train": {"max_steps": 2}})
    sweep_dir = tmp_path / "sweep"
    data = ["data=text", f"data.datasets.0.path={text}", "data.eval_fraction=0.2", "data.seq_len=32",
            "data.batch_size=4", "data.micro_batch_size=2"]
    proc = kdsweep(*args, *data, "train.threads=1", *QUIET,
                   f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path, timeout=600)
    trials = study(sweep_dir, "refused").trials
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "FAIL", "COMPLETE"], proc.stdout[-2000:]
    for number, words, fix in ((1, "model.target_modules: LlamaForCausalLM has no module named nope", "use a preset"),
                               (2, "data: the eval split makes no rows of data.seq_len=512", "pass data.seq_len=")):
        reason = trials[number].user_attrs["reason"]  # the job's one line, or the error its run.json recorded
        assert "\n" not in reason and words in reason and fix in reason, reason
    entries = manifest(sweep_dir)["trials"]
    assert {e["job"]["worker"] for e in entries.values()} == {"w0"} and all(e["attempts"] == 1 for e in entries.values())
    assert read_run(sweep_dir / "3")["environment"]["worker"] == {"name": "w0", "trials_before": 3, "start": "warm", "boot_seconds": 0.0}
    assert json.loads((sweep_dir / "workers" / "w0" / "worker.json").read_text())["trials_run"] == 4
