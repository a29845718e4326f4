"""The GPU check's whole-process part: the embedded default as ``python -m kdsweep`` jobs, on the CPU (the
reference, run alongside) and on the device in fp32, with bf16 weights, with activation checkpointing, compiled,
and with the ``dist=fsdp2_gpu_bf16`` preset."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from budget import Budget

HERE = Path(__file__).resolve().parent
ABSENT = "optuna,sqlalchemy,alembic,colorlog,mako,wandb,datasets,optuna_dashboard"
"""What the GPU machine lacks and prepare.sh does not bring: a job must not import it (the dry run checks)."""

ARMS = {  # arm -> (overrides, the objective's tolerance relative to the CPU's)
    "fp32": ([], 1e-3),
    "bf16_weights": (["train.dtype=bf16"], 0.02),  # bf16 compute, fp32 master weights (autocast on one GPU)
    "activation_checkpointing": (["dist.activation_checkpointing=true"], 1e-3),
    "compile": (["dist.compile=true"], 1e-3),
    "preset_fsdp2_gpu_bf16": (["dist=fsdp2_gpu_bf16"], 0.02),  # the GPU preset as a one-GPU job takes it (bf16)
}
QUIET = ["logger=quiet", "checkpoint.save_every=0", "checkpoint.export_merged=false", "checkpoint.export_adapter=false"]


def _command(args: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "kdsweep", *QUIET, *args, f"hydra.run.dir={run_dir}"]


def _env(dry: bool) -> dict[str, str]:
    env = dict(os.environ)
    if dry:  # the job sees only what the GPU machine will have
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "absent"), env.get("PYTHONPATH", "")]))
        env["GPU_CHECK_ABSENT"] = ABSENT
    return env


def numbers(run_dir: Path) -> dict[str, Any]:
    """A finished job's objective and its step times (the first step pays compilation and warm-up)."""
    record = json.loads((run_dir / "run.json").read_text())
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    steady = statistics.median(r["step_s"] for r in train[3:] or train)
    return {"objective": record["objective"], "status": record["status"], "steps": len(train),
            "first_step_s": round(train[0]["step_s"], 3), "step_s": round(steady, 4),
            "first_step_extra_s": round(train[0]["step_s"] - steady, 2),
            "peak_mem_mb": max(r["peak_mem_mb"] for r in train)}


def _failure(proc: subprocess.CompletedProcess | None, why: str = "") -> dict[str, Any]:
    tail = (proc.stderr or "").strip().splitlines()[-3:] if proc is not None else []
    return {"status": f"failed: {why or ' | '.join(tail)[:400]}"}


def _finished(proc: subprocess.Popen, run_dir: Path, budget: Budget, late: str) -> dict[str, Any]:
    """The numbers of a job started in the background, once it ends (killed when the check's budget runs out)."""
    try:
        _, err = proc.communicate(timeout=max(budget.left(), 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        return _failure(None, late)
    return numbers(run_dir) if proc.returncode == 0 else _failure(subprocess.CompletedProcess([], 1, "", err))


def embedded(work: Path, dry: bool, budget: Budget) -> dict[str, Any]:
    common = ["train=smoke", "train.max_steps=4"] if dry else []  # the dry run: a few steps
    device = "cpu" if dry else "cuda"
    root = work / "embedded"
    cpu_dir = root / "cpu"
    threads = max(1, min(8, (os.cpu_count() or 2) - 2))
    cpu = subprocess.Popen(_command([*common, "train.device=cpu", f"train.threads={threads}"], cpu_dir), cwd=work,
                           env=_env(dry), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    arms: dict[str, dict[str, Any]] = {}
    started: dict[str, subprocess.Popen] = {}
    for arm, (overrides, _) in ARMS.items():
        if budget.left() < 15:
            arms[arm] = {"status": "skipped: the check's budget is spent"}
            continue
        command = _command([*common, f"train.device={device}", *overrides], root / arm)
        if dry:  # on the CPU the arms only check code paths, not speed: all at once, beside the reference
            started[arm] = subprocess.Popen(command, cwd=work, env=_env(dry), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True)
            continue
        try:  # on the device one at a time, so that each arm's step times are its own
            proc = subprocess.run(command, cwd=work, env=_env(dry), capture_output=True, text=True,
                                  timeout=budget.left())
        except subprocess.TimeoutExpired:
            arms[arm] = _failure(None, "ran past the check's budget")
            continue
        arms[arm] = numbers(root / arm) if proc.returncode == 0 else _failure(proc)
        print(f"   {arm}: {arms[arm].get('objective', arms[arm]['status'])}", flush=True)
    for arm, proc in started.items():
        arms[arm] = _finished(proc, root / arm, budget, "ran past the check's budget")
        print(f"   {arm}: {arms[arm].get('objective', arms[arm]['status'])}", flush=True)
    arms = {arm: arms[arm] for arm in ARMS}
    reference = _finished(cpu, cpu_dir, budget, "the CPU reference ran past the check's budget")
    rows = [f"cpu: objective {reference.get('objective')}"]
    for arm, (_, tolerance) in ARMS.items():
        r = arms[arm]
        if "objective" in r and "objective" in reference:
            r["relative_to_cpu"] = (r["objective"] - reference["objective"]) / reference["objective"]
            r["tolerance"], r["within"] = tolerance, abs(r["relative_to_cpu"]) <= tolerance
            rows.append(f"{arm}: objective {r['objective']:.5f} ({r['relative_to_cpu']:+.2e} vs cpu, "
                        f"{'within' if r['within'] else 'OUTSIDE'} {tolerance:g}), step {r['step_s'] * 1e3:.1f} ms, "
                        f"first step +{r['first_step_extra_s']} s, peak {r['peak_mem_mb']:.0f} MB")
        else:
            rows.append(f"{arm}: {r['status']}")
    ok = [a for a in arms.values() if a.get("within")]
    return {"cpu": reference, "arms": arms, "rows": rows,
            "summary": f"{len(ok)} of {len(ARMS)} arms within tolerance of the CPU objective"}
