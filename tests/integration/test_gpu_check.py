"""The prepared GPU check (benchmarks/gpu) cannot rot: its dry run runs every check's code on the CPU with tiny
shapes (the same functions the GPU run calls), as whole jobs that see only the packages the GPU machine will have;
the wheels prepare.sh fetches install offline the way run.sh installs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
CHECKS = ["peak_matmul", "embedded", "fsdp", "placement", "precision", "real_shapes", "packed", "max_micro_batch",
          "teacher_cache"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run, shared by the assertions below."""
    work = tmp_path_factory.mktemp("gpu_dry")
    env = {**os.environ, "OUT": str(work / "out"), "GPU_CHECK_WORK": str(work / "work"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(GPU / "check.py"), "--dry-run", "--out", str(work / "gpu.json")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((work / "gpu.json").read_text()), work, proc.stdout


def test_every_check_runs_and_the_results_are_written_twice(dry_run):
    data, work, stdout = dry_run
    assert list(data["checks"]) == CHECKS
    assert {name: r["status"] for name, r in data["checks"].items()} == dict.fromkeys(CHECKS, "ok")
    assert json.loads((work / "out" / "gpu.json").read_text()) == data  # $OUT gets the same file
    assert data["meta"]["dry_run"] is True and data["meta"]["total_s"] > 0
    assert "attention" in data["meta"]["flops_convention"] and "LoRA" in data["meta"]["flops_convention"]
    for name in CHECKS:  # the printed table names each check
        assert any(line.startswith(name) for line in stdout.splitlines()), name


def test_the_embedded_jobs_match_the_cpu_reference_without_the_packages_the_gpu_machine_lacks(dry_run):
    embedded = dry_run[0]["checks"]["embedded"]
    assert embedded["cpu"]["status"] == "completed"
    for arm, r in embedded["arms"].items():
        assert r["status"] == "completed" and r["within"], (arm, r)
        assert r["steps"] == 4 and r["step_s"] > 0
    assert embedded["arms"]["fp32"]["relative_to_cpu"] == 0.0  # the same device: the same numbers


def test_fsdp_arms_equal_the_unsharded_model_and_mixed_precision_is_close(dry_run):
    arms = dry_run[0]["checks"]["fsdp"]["arms"]
    assert dry_run[0]["checks"]["fsdp"]["backend"] == "gloo"
    assert abs(arms["fsdp2"]["relative_to_unsharded"]) < 1e-6 and abs(arms["fsdp2_ac"]["relative_to_unsharded"]) < 1e-6
    assert 0 < abs(arms["fsdp2_bf16_mixed"]["relative_to_unsharded"]) < 0.02  # bf16 compute: close, not equal


def test_the_placement_check_decides_measures_and_counts(dry_run):
    check = dry_run[0]["checks"]["placement"]
    assert check["teacher_bytes"] > 0 and set(check["auto_on_this_device"]) == {"lora", "full"}
    assert all(d["placement"] in ("replicate", "node") for d in check["auto_on_this_device"].values())
    assert check["replicated"]["collectives"] == {}  # a replicated teacher's forward issues no collective
    assert check["sharded_1_rank"]["forward_s"] > 0 and "collectives" in check["sharded_1_rank"]  # (1 rank: none)
    assert check["sharded_at_8_ranks_all_gather_bytes_per_micro_batch"] == check["teacher_bytes"] * 7 / 8


def test_the_precision_check_keeps_fp32_master_state_and_pure_bf16_does_not(dry_run):
    arms = dry_run[0]["checks"]["precision"]["arms"]
    assert arms["bf16"]["weights_dtype"] == "float32" and arms["bf16"]["adamw_state_dtypes"] == ["float32"]
    assert arms["bf16_pure"]["weights_dtype"] == "bfloat16" and arms["bf16_pure"]["adamw_state_dtypes"] == ["bfloat16"]
    assert arms["bf16"]["moved_fraction"] > 0.9 and arms["bf16_pure"]["moved_fraction"] < 0.5  # 14% at tiny shapes


def test_the_real_shape_arms_report_speed_mfu_and_the_loss_alone(dry_run):
    real = dry_run[0]["checks"]["real_shapes"]
    assert set(real["arms"]) == {"lora_chunked", "lora_fused", "full_chunked", "full_fused"}
    for arm, r in real["arms"].items():
        assert r["status"] == "ok" and r["tokens_per_s"] > 0 and 0 < r["mfu_causal"] < r["mfu"] < 1, (arm, r)
        assert r["predicted_peak_gib"] > 0 and {"teacher_weights", "loss_path", "total"} <= set(r["predicted"]), (arm, r)
    lora, full = real["arms"]["lora_chunked"], real["arms"]["full_chunked"]
    assert lora["trainable_params"] < full["trainable_params"] and lora["flops_per_step"] < full["flops_per_step"]
    # the same initial weights and data: chunked and fused give the same loss
    assert abs(real["arms"]["lora_chunked"]["loss"] - real["arms"]["lora_fused"]["loss"]) < 1e-2
    assert real["loss_alone"]["time_ratio"] > 0 and {"chunked", "fused"} <= set(real["loss_alone"])


def test_the_micro_batch_search_and_the_cache_check_ran(dry_run):
    checks = dry_run[0]["checks"]
    mb = checks["max_micro_batch"]
    assert mb["chunked"]["fits"] == mb["fused"]["fits"] == 8 and mb["chunked"]["capped"]  # no OOM on the CPU
    cache = checks["teacher_cache"]
    assert cache["build"]["teacher_tokens"] == 5 * 64 and cache["build_teacher_tokens_per_s"] > 0
    assert cache["cached_step"]["step_s"] > 0 and cache["step_ratio"] > 0


def test_an_absent_package_looks_absent_to_a_job_and_prepare_s_wheels_install_offline(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(GPU / "absent"), "GPU_CHECK_ABSENT": "optuna,wandb"}
    probe = ("import importlib.util, importlib.metadata as m\n"
             "assert importlib.util.find_spec('optuna') is None and importlib.util.find_spec('hydra') is not None\n"
             "try:\n    m.version('wandb'); raise SystemExit('wandb has a version')\nexcept m.PackageNotFoundError: pass\n"
             "import optuna")
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "No module named 'optuna'" in proc.stderr, proc.stderr

    clone = tmp_path / "repo"
    (clone / "benchmarks").mkdir(parents=True)
    os.symlink(GPU, clone / "benchmarks" / "gpu")
    subprocess.run(["bash", str(clone / "benchmarks" / "gpu" / "prepare.sh")], cwd=clone, check=True,
                   capture_output=True, env={**os.environ, "PYTHON": sys.executable})
    wheels = sorted(p.name.split("-")[0] for p in (clone / ".whl").glob("*.whl"))
    assert wheels == ["antlr4_python3_runtime", "cloudpickle", "hydra_core", "hydra_submitit_launcher", "omegaconf",
                      "submitit"]
    site = tmp_path / "site"  # as run.sh installs them: no index, no dependencies
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    *map(str, (clone / ".whl").glob("*.whl"))], check=True, capture_output=True)
    assert (site / "hydra" / "__init__.py").exists() and (site / "antlr4").is_dir()


def test_the_packed_arm_trains_k_members_over_one_base_with_one_teacher_forward_per_step(dry_run):
    r = dry_run[0]["checks"]["packed"]
    assert list(r["arms"]) == ["K1", "K2", "K4", "K8"]
    for name, arm in r["arms"].items():
        k = int(name[1:])
        assert arm["status"] == "ok" and arm["teacher_forwards_per_step"] == 1 and arm["base_shared"], (name, arm)
        assert arm["per_member_s"] == pytest.approx(arm["step_s"] / k, abs=1e-4) and 0 < arm["sharing_bound"] <= 1
    plans = [r["arms"][f"K{k}"]["plan_gb"] for k in (1, 2, 4, 8)]
    assert plans == sorted(plans) and plans[0] < plans[1]  # the plan's memory grows with K
    assert r["arms"]["K1"]["per_trial_over_k1"] == 1.0 and r["plan_largest_k"] is None  # no device memory on a CPU
