"""The teacher-logit cache in real jobs: ``method=full`` trains exactly as the live teacher (every divergence, 1 and 2
ranks, packed and padded rows, the cache's loss in 3 chunks and the live one's in one); a cache built by 2 ranks is
the cache built by 1; editing the teacher gives a new cache, moving it does not; a sweep runs one teacher pass and no
other trial loads the teacher (local trials, and 2-rank SLURM trials); bad input is one line before anything runs."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import QUIET, kdsweep, read_metrics, read_run, tiny_sweep
from helpers import WORDS, chunk_mb_for, gloo_ranks, once, run_each, save_hf_model, word_tokenizer

pytestmark = pytest.mark.slow

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "jsd_normalized", "tvd", "symmetric")
ROWS = ("pack", "pad")
SPLIT = chunk_mb_for(3, 2 * 24, 22)
"""The cached cells' loss budget: each micro-batch (2 rows of 24 tokens, a 22-token vocabulary) in 3 chunks, so every
comparison of a cached cell with a live one (the plain graph: one chunk) checks the chunk paths against it too."""


def cell(root: Path, ranks: int, rows: str, logits: str, divergence: str = "forward_kl", method: str = "full",
         impl: str = "chunked"):
    from kdsweep.config.schema import (CheckpointConfig, DataConfig, DatasetConfig, LoggerConfig, LossConfig,
                                       OptimConfig, RunConfig, StudentConfig, TeacherCacheConfig, TeacherConfig,
                                       TrainConfig)

    name = f"{ranks}-{rows}-{logits}-{method}-{divergence}-{impl}"
    return RunConfig(
        output_dir=str(root / "cells" / name),
        model=StudentConfig(path=str(root / "student"), lora_rank=4, target_modules=("all-linear", "lm_head")),
        # the teacher's output layer has 8 padded rows: the cache keeps the student's vocabulary, as live does
        teacher=TeacherConfig(path=str(root / "teacher"), logits=logits,
                              cache=TeacherCacheConfig(method=method, k=6, dir=str(root / f"cache{ranks}"))),
        data=DataConfig(datasets=(DatasetConfig(path=str(root / "docs.jsonl")),), sequences=rows, seq_len=24,
                        batch_size=4, micro_batch_size=2, eval_batch_size=4, eval_fraction=0.15,
                        cache_dir=str(root / "data")),
        loss=LossConfig(kd_ratio=0.6, divergence=divergence, beta=0.3, temperature=1.5, impl=impl,
                        chunk_mb=SPLIT if logits == "cache" else LossConfig.chunk_mb),
        optim=OptimConfig(lr=1e-2),
        train=TrainConfig(max_steps=4, eval_every=2, device="cpu", threads=1),
        logger=LoggerConfig(progress_bar=False),
        checkpoint=CheckpointConfig(save_every=0, export_adapter=False, export_merged=False),
    )


def cells(root: Path, ranks: int) -> list:
    out = [cell(root, ranks, rows, logits, divergence) for rows in ROWS for divergence in DIVERGENCES
           for logits in ("live", "cache")]
    for rows in ROWS:  # the sparse methods, and the fused loss reading a cache
        out += [cell(root, ranks, rows, "cache", method="sample"), cell(root, ranks, rows, "cache", method="topk"),
                cell(root, ranks, rows, "cache", method="topk", impl="fused"),
                cell(root, ranks, rows, "cache", method="full", impl="fused")]
    return out


def build_models(root: Path) -> None:
    """The cells' documents, student and teacher in ``root`` (tests/loops/gloo_ranks.py too)."""
    rng = random.Random(0)
    # documents of very different lengths: packed rows mix several, padded rows are mostly padding
    (root / "docs.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.choice([3, 5, 9, 17, 30])))}) + "\n" for _ in range(90)))
    tok = word_tokenizer()
    save_hf_model(root / "student", tok, hidden=32, layers=2, seed=0)
    save_hf_model(root / "teacher", tok, hidden=48, layers=2, seed=1, pad_vocab=8)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every cell, 1-rank ones here (they build cache1), 2-rank ones in two spawned ranks (they build cache2)."""
    from kdsweep.train import run

    root = tmp_path_factory.mktemp("teacher_cache")
    build_models(root)
    torch.set_num_threads(1)
    for cfg in cells(root, 1):
        run(cfg)
    gloo_ranks(run_each, cells(root, 2), tmp_path=root)
    return root


def metrics(cfg):
    run_dir = Path(cfg.output_dir)
    return read_run(run_dir), [r for r in read_metrics(run_dir) if r["kind"] == "train"], \
        [r for r in read_metrics(run_dir) if r["kind"] == "eval"]


def assert_same(a, b, tol=1e-5):
    (ra, ta, ea), (rb, tb, eb) = metrics(a), metrics(b)
    assert [r["step"] for r in ta] == [r["step"] for r in tb] == [1, 2, 3, 4]
    for x, y in zip(ta, tb):
        for key in ("loss", "ce", "kd", "kl", "grad_norm"):
            assert x[key] == pytest.approx(y[key], abs=tol, rel=tol), (a.output_dir, x["step"], key)
    for x, y in zip(ea, eb):
        for key in ("student_ce", "kl", "teacher_ce"):
            assert x[key] == pytest.approx(y[key], abs=tol, rel=tol), (a.output_dir, x["step"], key)
    assert ra["objective"] == pytest.approx(rb["objective"], abs=tol)


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_a_full_cache_trains_exactly_as_the_live_teacher(jobs, divergence, rows, ranks):
    live, cached = cell(jobs, ranks, rows, "live", divergence), cell(jobs, ranks, rows, "cache", divergence)
    assert_same(live, cached)
    record = read_run(Path(cached.output_dir))
    assert record["teacher_targets"]["source"] == "cache" and record["teacher_targets"]["kl"] == "exact (T=1)"
    assert record["cost"]["teacher_tokens_read"] > 0
    assert read_run(Path(live.output_dir))["teacher_targets"] == {"source": "live", "teacher_ce": "exact",
                                                                 "kl": "exact (T=1)", "weights_dtype": ["float32"]}


@pytest.mark.parametrize("rows", ROWS)
def test_one_build_per_group_and_two_ranks_build_the_same_cache(jobs, rows):
    """Within each group exactly one job built each cache; 2 ranks (each writing its share of the rows) wrote the
    cache one rank wrote, and train the sparse and fused cells as one rank does."""
    from kdsweep.teacher.cache import read_meta

    for ranks in (1, 2):
        built = [c for c in cells(jobs, ranks) if (read_run(Path(c.output_dir))["teacher_targets"].get("built"))]
        methods = sorted({(c.teacher.cache.method, c.data.sequences) for c in built})
        assert methods == sorted((m, r) for m in ("full", "sample", "topk") for r in ROWS), ranks
    for method in ("full", "sample", "topk"):
        one = Path(read_run(Path(cell(jobs, 1, rows, "cache", method=method).output_dir))["teacher_targets"]["dir"])
        two = Path(read_run(Path(cell(jobs, 2, rows, "cache", method=method).output_dir))["teacher_targets"]["dir"])
        assert one.name == two.name  # the same key: it does not depend on the ranks that build it
        assert [p["rank"] for p in read_meta(two)["splits"]["train"]["parts"]] == [0, 1]
        if method != "sample":  # draws are seeded per row; logits agree to float rounding of other batch shapes
            for f in sorted(one.glob("train.*.0")):
                a = f.read_bytes()
                b = b"".join((two / f"{f.name[:-2]}.{r}").read_bytes() for r in (0, 1))
                if "ids" in f.name:
                    assert a == b, f.name
                else:
                    dtype = torch.float16 if ".logp." in f.name else torch.float32
                    ta, tb = (torch.frombuffer(bytearray(x), dtype=dtype) for x in (a, b))
                    assert torch.allclose(ta.float(), tb.float(), atol=1e-3 if dtype == torch.float16 else 1e-5), f.name
    meta = read_meta(Path(read_run(Path(cell(jobs, 1, rows, "cache").output_dir))["teacher_targets"]["dir"]))
    train, held_out = meta["splits"]["train"], meta["splits"]["eval"]
    assert train["rows"] == 4 * 4 < train["of_rows"]  # rows=used: the rows of its 4 steps of 4, not the split
    assert held_out["rows"] == held_out["of_rows"]  # every held-out row
    for method, impl in (("sample", "chunked"), ("topk", "chunked"), ("topk", "fused"), ("full", "fused")):
        assert_same(cell(jobs, 1, rows, "cache", method=method, impl=impl),
                    cell(jobs, 2, rows, "cache", method=method, impl=impl), tol=2e-5)
    assert_same(cell(jobs, 1, rows, "cache", method="full", impl="fused"), cell(jobs, 1, rows, "live"))


def test_editing_the_teacher_gives_a_new_cache_and_moving_it_does_not(jobs, tmp_path):
    from safetensors.torch import load_file, save_file

    from kdsweep.teacher.cache import Spec, cache_dir

    base = cell(jobs, 1, "pack", "cache")
    spec = Spec.of(base, 26)
    key = cache_dir(base, spec, jobs / "teacher", "rows").name
    moved = tmp_path / "elsewhere" / "teacher"
    shutil.copytree(jobs / "teacher", moved)
    assert cache_dir(base, spec, moved, "rows").name == key
    weights = load_file(moved / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    assert cache_dir(base, spec, moved, "rows").name != key  # never a stale cache

    from kdsweep.train import run

    cfg = replace(base, output_dir=str(tmp_path / "edited"), teacher=replace(base.teacher, path=str(moved)))
    run(cfg)
    record = read_run(tmp_path / "edited")
    assert record["teacher_targets"]["built"] and record["teacher_targets"]["dir"] != \
        read_run(Path(base.output_dir))["teacher_targets"]["dir"]
    assert record["objective"] != pytest.approx(read_run(Path(base.output_dir))["objective"], abs=1e-7)


SWEEP = ["teacher.logits=cache", "teacher.cache.method=sample", "hydra.sweeper.n_trials=3"]


def assert_one_teacher_pass(sweep_dir: Path, out: str, trials: int = 3) -> None:
    records = [read_run(sweep_dir / str(n)) for n in range(trials)]
    assert all(r["status"] == "completed" for r in records)
    built = [n for n, r in enumerate(records) if r["teacher_targets"]["built"]]
    assert len(built) == 1, [r["teacher_targets"] for r in records]
    assert f"teacher cache: trial {built[0]} builds it" in out
    assert len({r["teacher_targets"]["dir"] for r in records}) == 1
    builder = records[built[0]]
    for n, r in enumerate(records):
        if n in built:
            continue
        log = (sweep_dir / str(n) / "kdsweep.log").read_text()
        assert "(the teacher is not loaded)" in log and "pre-training" not in log
        assert r["cost"]["teacher_tokens_computed"] == 0 and r["cost"]["teacher_tokens_read"] > 0
        assert r["timings"]["teacher_s"] < builder["timings"]["teacher_s"]  # start-up: no teacher to load
        assert r["eval_before"] == builder["eval_before"]
    # the untrained student's evaluation: once per sweep, by whichever trial got to it first (the trials behind
    # the build start before it ends and take turns on the baseline's lock)
    assert sum(not r["timings"]["baseline_reused"] for r in records) == 1, [r["timings"] for r in records]
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert sweep["cost"]["cache_builds"] == 1 and sweep["cost"]["teacher_tokens_read"] > 0


def local_cache_sweep(tmp_path_factory) -> SimpleNamespace:
    """The sweep of local trials below, its study in a journal file, and its `kdsweep status` (run without
    KDSWEEP_STORAGE_URL): ``sweep_dir``, ``out`` (the sweep's output), ``journal``, ``status``.

    Built once per session (helpers.once): test_storages.py checks the journal storage on it."""
    def build() -> SimpleNamespace:
        root = tmp_path_factory.mktemp("cache_local")
        journal = root / "journal" / "study.log"
        sweep_dir, proc = tiny_sweep(root, "cache_local", *SWEEP, f"teacher.cache.dir={root / 'tc'}",
                                     f"hydra.sweeper.storage=journal://{journal}")
        status = subprocess.run([sys.executable, "-m", "kdsweep", "status", str(sweep_dir)], cwd=root,
                                capture_output=True, text=True, timeout=120,
                                env={k: v for k, v in os.environ.items() if k != "KDSWEEP_STORAGE_URL"})
        return SimpleNamespace(sweep_dir=sweep_dir, out=proc.stdout + proc.stderr, journal=journal, status=status)

    return once("local_cache_sweep", build)


def test_a_sweep_runs_one_teacher_pass_with_local_trials(tmp_path_factory, zoo_dirs):
    """3 local trials (their study in a journal file: the storage does not matter here)."""
    sweep = local_cache_sweep(tmp_path_factory)
    assert_one_teacher_pass(sweep.sweep_dir, sweep.out)
    assert sweep.status.returncode == 0, sweep.status.stderr
    status = sweep.status.stdout
    assert "teacher: " in status and "(1 cache build)" in status and "saved (estimates)" in status


@pytest.mark.usefixtures("slurm_cluster")
def test_a_sweep_runs_one_teacher_pass_with_two_rank_slurm_trials(tmp_path, zoo_dirs):
    sweep_dir, proc = tiny_sweep(tmp_path, "cache_slurm", *SWEEP, "hydra/launcher=submitit_slurm", "cluster=local_cpu",
                                 f"teacher.cache.dir={tmp_path / 'tc'}")
    assert_one_teacher_pass(sweep_dir, proc.stdout + proc.stderr)
    records = [read_run(sweep_dir / str(n)) for n in range(3)]
    assert all(r["environment"]["slurm"] and r["world_size"] == 2 for r in records)
    built = next(r for r in records if r["teacher_targets"]["built"])
    assert built["teacher_targets"]["build"]["ranks"] == 2  # the builder's ranks shared the rows


@pytest.fixture(scope="module")
def mounts(tmp_path_factory):
    """A read-only file system, and a 4 MiB one: real mounts (root passes every permission check, so a chmod
    would prove nothing)."""
    root = tmp_path_factory.mktemp("mounts")
    (root / "ro").mkdir()
    (root / "small").mkdir()
    for path, options in ((root / "ro", "ro,size=1m"), (root / "small", "size=4m")):
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    yield root
    for path in (root / "ro", root / "small"):
        subprocess.run(["umount", str(path)], check=False)


BAD = {
    "cross_tokenizer_k": (["teacher=tiny_other", "teacher.cache.method=topk", "teacher.cache.k=1536"],
                          "teacher.cache.k=1536 keeps the whole 1536-token vocabulary"),  # the teacher's, not the student's
    "divergence": (["loss.divergence=reverse_kl"],
                   "loss.divergence=reverse_kl cannot be trained from teacher.cache.method=sample"),
    "temperature": (["teacher.cache.method=topk", "teacher.cache.temperature=2.0"],
                    "teacher.cache.temperature=2.0 but loss.temperature=1.0"),
    "not_writable": (["teacher.cache.dir={mounts}/ro/caches"], "teacher.cache.dir={mounts}/ro/caches is not writable"),
    "too_big": (["teacher.cache.method=full", "teacher.cache.dir={mounts}/small"],
                "MiB but {mounts}/small has 4.0 MiB free"),
    "k_too_big": (["teacher.cache.method=topk", "teacher.cache.k=4096"],
                  "teacher.cache.k=4096 keeps the whole 2048-token vocabulary"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_cache_input_is_one_line_and_nothing_is_written(case, mounts, tmp_path):
    args, expected = BAD[case]
    fill = lambda a: a.format(mounts=mounts)
    run_dir = tmp_path / "run"
    sweep = tmp_path / "sweep"
    for mode in (["train=smoke", f"hydra.run.dir={run_dir}"],  # a job, and a sweep: refused before any trial
                 ["-m", "hparams_search=kd_optuna", f"hydra.sweep.dir={sweep}"]):
        proc = kdsweep(*mode, "teacher.logits=cache", *map(fill, args), cwd=tmp_path, check=False)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and fill(expected) in lines[0], proc.stderr
    assert not run_dir.exists() and not any(sweep.glob("*/run.json"))
    assert not any((mounts / "small").iterdir())  # the refused cache wrote nothing


def test_the_hints_of_those_lines_work(tmp_path, zoo_dirs):
    """What the method/divergence and temperature lines suggest, typed as they say, runs."""
    for fix in (["loss.divergence=reverse_kl", "teacher.cache.method=topk"],
                ["teacher.cache.method=topk", "teacher.cache.temperature=null"]):
        run_dir = tmp_path / fix[-1].replace("=", "_")
        kdsweep("train=smoke", "train.max_steps=1", "teacher.logits=cache", f"teacher.cache.dir={tmp_path / 'tc'}",
                *fix, *QUIET, f"hydra.run.dir={run_dir}", cwd=tmp_path)
        assert read_run(run_dir)["status"] == "completed"
