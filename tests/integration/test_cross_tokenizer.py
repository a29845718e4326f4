"""A teacher with another tokenizer (kdsweep.teacher.cross), as whole jobs on the embedded zoo: the second teacher
(teacher=tiny_other, its own SentencePiece-style BPE) distils into the tiny student with gold and uld, run.json
says what the numbers are and counts what did not align; the tiny teacher forced through the cross-tokenizer path
(a test-only switch) gives the same-tokenizer run's numbers; a sweep over the teacher builds one teacher-logit
cache per teacher, and the second teacher's cache trains as the live teacher."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import QUIET, kdsweep, read_metrics, read_run

pytestmark = pytest.mark.slow

SHORT = ["train.max_steps=6", "train.eval_every=3", "data.batch_size=8", "data.micro_batch_size=4", "train.threads=1",
         "checkpoint.save_every=0", "checkpoint.export_adapter=false", "checkpoint.export_merged=false", *QUIET]
SPLIT = ["loss.chunk_mb=0.9"]
"""The fused jobs' loss budget: each micro-batch (4 rows of 128 tokens, the student's 2,048-token vocabulary: 4 MiB) in
5 chunks, whose even cuts fall inside rows, where the spans are; the chunked jobs they are compared with run the
plain graph (one chunk)."""


def test_the_second_teacher_has_its_own_tokenizer_and_matches_it(other_teacher, zoo_dirs):
    from transformers import AutoConfig, AutoTokenizer

    from kdsweep.teacher.reader import is_byte_level

    mine, tiny = AutoTokenizer.from_pretrained(other_teacher), AutoTokenizer.from_pretrained(zoo_dirs["teacher"])
    assert is_byte_level(mine) is False and is_byte_level(tiny) is True  # ▁ pieces with byte fallback, against Ġ
    assert len(mine) == AutoConfig.from_pretrained(other_teacher).vocab_size == 1536 != len(tiny)
    assert mine.convert_ids_to_tokens(mine("the earth", add_special_tokens=False)["input_ids"])[0].startswith("\u2581")
    assert json.loads((other_teacher / "kdsweep_zoo.json").read_text())["recipe"] == json.loads(
        (zoo_dirs["teacher"] / "kdsweep_zoo.json").read_text())["recipe"]  # pre-trained as the tiny teacher is


PROFILED = ["profiler.enabled=true", "profiler.with_stack=true", "profiler.wait=1", "profiler.warmup=1",
            "profiler.active=2"]
"""Steps 2 and 3 traced with every Python function they call."""


@pytest.fixture(scope="module")
def cross_grid(tmp_path_factory, other_teacher):
    """gold across tokenizers (chunked) and what its numbers are compared with, one multirun: the same job on 2
    ranks, and with the fused loss on 1 and 2 ranks; beside it, uld (profiled) in a process of its own."""
    from test_multirank import multirun

    root = tmp_path_factory.mktemp("cross")
    with ThreadPoolExecutor(2) as pool:  # one thread each: side by side
        grid = pool.submit(multirun, root / "grid", {
            "gold": ["loss.impl=chunked"],  # first: in a process as fresh as a job of its own
            "two": ["loss.impl=chunked", "dist.nproc_per_node=2"],
            "fused_one": ["loss.impl=fused", *SPLIT],
            "fused_two": ["loss.impl=fused", *SPLIT, "dist=fsdp2_local"],
        }, "teacher=tiny_other", "loss.cross_tokenizer=gold", *SHORT)
        uld = pool.submit(kdsweep, "teacher=tiny_other", "loss.cross_tokenizer=uld", "loss.impl=chunked", *SHORT,
                          *PROFILED, f"hydra.run.dir={root / 'uld'}", cwd=root)
        proc, dirs = grid.result()
        uld.result()
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {**dirs, "uld": root / "uld"}


@pytest.fixture(scope="module")
def cross_runs(cross_grid):
    return {loss: cross_grid[loss] for loss in ("gold", "uld")}


def test_the_second_teacher_distils_across_tokenizers_and_says_what_its_numbers_are(cross_runs):
    for loss, run_dir in cross_runs.items():
        record = read_run(run_dir)
        cross = record["teacher_targets"]["cross_tokenizer"]
        assert record["status"] == "completed" and cross["loss"] == loss
        assert cross["student_vocab"] == 2048 and cross["teacher_vocab"] == 1536 and 0 < cross["shared_tokens"] < 1536
        assert "per student token" in record["teacher_targets"]["teacher_ce"]
        assert ("gold" if loss == "gold" else "ULD") in record["teacher_targets"]["kl"]
        counts = record["alignment"]
        assert counts["kd_spans"] > 0 and counts["kd_spans_dropped"] >= 0 and counts["tokens_unaligned"] >= 0
        rows = read_metrics(run_dir)
        assert all(math.isfinite(r["kd"]) and r["kd"] > 0 for r in rows if r["kind"] == "train")
        evals = [r for r in rows if r["kind"] == "eval"]
        assert evals and all(math.isfinite(r["teacher_ce"]) and r["teacher_ce"] > 0 for r in evals)
        assert record["cost"]["teacher_tokens_computed"] > 0


def test_a_cross_tokenizer_step_reads_its_alignment_and_aligns_nothing(cross_runs):
    """The traced steps (every Python function they call) make their targets from the spans kept with the rows, and
    neither read a row in the teacher's tokens nor align one: that was done once, when the rows were made."""
    trace = json.loads((cross_runs["uld"] / "profile" / "trace_rank0.json").read_text())
    called = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "python_function"}
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any(n.endswith(": aligned_targets") for n in called) and any("aligned_rows.py(" in n for n in called)
    for module in ("teacher/reader.py(", "teacher/align.py(", "teacher/views.py("):
        assert not [n for n in called if module in n], module
    assert not [n for n in called if n.endswith((": row_plan", ": span_plan", ": build"))]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Sentences of the shipped corpus, one document each: packed rows hold whole documents (none is cut)."""
    from kdsweep.data.text import EMBEDDED_CORPUS

    sentences = [s.strip() + "." for s in Path(EMBEDDED_CORPUS).read_text().split(". ")]
    lines = [s for s in sentences if 40 < len(s) < 160]
    path = tmp_path_factory.mktemp("verses") / "verses.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:400]))
    return path


def test_one_tokenizer_forced_through_the_cross_tokenizer_path_gives_the_same_numbers(short_docs, tmp_path, zoo_dirs,
                                                                                      monkeypatch):
    data = ["data=text", f"data.datasets.0.path={short_docs}", "data.sequences=pack", "data.seq_len=128",
            "data.eval_fraction=0.1"]
    plain, forced = tmp_path / "plain", tmp_path / "forced"
    kdsweep(*data, *SHORT, f"hydra.run.dir={plain}", cwd=tmp_path)  # it tokenizes the documents for both
    monkeypatch.setenv("KDSWEEP_TEST_FORCE_CROSS_TOKENIZER", "1")  # the job's processes read it
    kdsweep(*data, *SHORT, f"hydra.run.dir={forced}", cwd=tmp_path)
    a, b = read_run(plain), read_run(forced)
    assert "cross_tokenizer" in b["teacher_targets"] and "cross_tokenizer" not in a["teacher_targets"]
    assert b["alignment"]["kd_spans_dropped"] == 0 and b["alignment"]["tokens_unaligned"] == 0
    assert b["objective"] == pytest.approx(a["objective"], abs=1e-6)
    rows_a, rows_b = read_metrics(plain), read_metrics(forced)
    assert [(r["kind"], r["step"]) for r in rows_a] == [(r["kind"], r["step"]) for r in rows_b]
    for x, y in zip(rows_a, rows_b):
        for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-6, rel=1e-6), (x["kind"], x["step"], key)


def test_two_ranks_equal_one_rank_across_tokenizers(cross_grid):
    two = cross_grid["two"]
    one = cross_grid["gold"]
    assert read_run(two)["world_size"] == 2
    assert read_run(two)["objective"] == pytest.approx(read_run(one)["objective"], abs=1e-5)
    assert read_run(two)["alignment"] == read_run(one)["alignment"]  # every span once, whichever rank reads it
    for x, y in zip(read_metrics(one), read_metrics(two), strict=True):
        assert (x["kind"], x["step"]) == (y["kind"], y["step"])
        for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-5, rel=1e-5), (x["kind"], x["step"], key)


def assert_same_rows(a, b, tol):
    """Two runs' metrics rows: the same steps, every loss and eval value within ``tol``."""
    for x, y in zip(read_metrics(a), read_metrics(b), strict=True):
        assert (x["kind"], x["step"]) == (y["kind"], y["step"])
        for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=tol, rel=tol), (x["kind"], x["step"], key)


def test_the_fused_loss_across_tokenizers_trains_as_the_chunked_one(cross_grid):
    """loss.impl=fused with a teacher of another tokenizer (its hidden states projected one chunk's spans at a time,
    the student's chunk by chunk): the chunked job's numbers on 1 rank, and on 2 FSDP ranks."""
    chunked = cross_grid["gold"]
    for name, tol in (("fused_one", 1e-6), ("fused_two", 1e-5)):  # 2 ranks: summation order (as 2 chunked ranks)
        fused = read_run(cross_grid[name])
        assert fused["config"]["loss"]["impl"] == "fused" and fused["alignment"] == read_run(chunked)["alignment"]
        assert fused["objective"] == pytest.approx(read_run(chunked)["objective"], abs=tol), name
        assert_same_rows(chunked, cross_grid[name], tol)
    assert read_run(cross_grid["fused_two"])["world_size"] == 2


@pytest.fixture(scope="module")
def teacher_sweep(tmp_path_factory, other_teacher):
    """4 trials over teacher=choice(tiny,tiny_other) (two of each, enqueued), reading teacher-logit caches."""
    root = tmp_path_factory.mktemp("pick")
    body = {"defaults": [{"override /hydra/sweeper": "kdsweep_optuna"}],
            "hydra": {"sweeper": {"study_name": "pick", "poll_s": 0.2, "n_trials": 4, "max_concurrent": 2,
                                  "sampler": "random", "pruner": "none",
                                  "params": {"teacher": "choice(tiny,tiny_other)"},
                                  "enqueue": [{"teacher": t} for t in ("tiny_other", "tiny", "tiny_other", "tiny")]}}}
    (root / "conf" / "hparams_search").mkdir(parents=True)
    (root / "conf" / "hparams_search" / "pick.yaml").write_text("# @package _global_\n" + yaml.safe_dump(body))
    sweep_dir = root / "sweep"
    kdsweep("-m", "hparams_search=pick", f"hydra.searchpath=[file://{root / 'conf'}]", f"hydra.sweep.dir={sweep_dir}",
            "teacher.logits=cache", "teacher.cache.method=full", f"teacher.cache.dir={root / 'tc'}",
            "loss.cross_tokenizer=gold", *SHORT, cwd=root)
    return sweep_dir, root / "tc"


def test_a_sweep_over_the_teacher_builds_one_cache_per_teacher(teacher_sweep):
    sweep_dir, caches = teacher_sweep
    records = [read_run(sweep_dir / str(n)) for n in range(4)]
    by_teacher = {}
    for r in records:
        assert r["status"] == "completed" and r["teacher_targets"]["source"] == "cache"
        by_teacher.setdefault(r["config"]["teacher"]["zoo"], []).append(r)
    assert sorted(by_teacher) == ["tiny-teacher", "tiny-teacher-other"]
    assert len([d for d in caches.iterdir() if (d / "meta.json").is_file()]) == 2
    for zoo, runs in by_teacher.items():
        assert [r["teacher_targets"]["built"] for r in runs].count(True) == 1, zoo  # one teacher pass each
        assert len({r["teacher_targets"]["dir"] for r in runs}) == 1
        assert runs[0]["objective"] == runs[1]["objective"]  # the same trial, one building and one reading
        reader = next(r for r in runs if not r["teacher_targets"]["built"])
        assert reader["cost"]["teacher_tokens_computed"] == 0 and reader["cost"]["teacher_tokens_read"] > 0
        assert ("cross_tokenizer" in reader["teacher_targets"]) == (zoo == "tiny-teacher-other")
    sweep = json.loads((sweep_dir / "sweep.json").read_text())
    assert sweep["cost"]["cache_builds"] == 2
    status = kdsweep("status", str(sweep_dir), cwd=sweep_dir.parent).stdout
    for zoo, runs in by_teacher.items():  # what each cache weighs, as its meta.json and its spec say
        t = runs[0]["teacher_targets"]
        meta = json.loads((Path(t["dir"]) / "meta.json").read_text())
        positions = sum(s["positions"] for s in meta["splits"].values())
        kind = "cross-tokenizer full" if zoo == "tiny-teacher-other" else "full"
        assert t["bytes_per_position"] == 4 * (1536 if zoo == "tiny-teacher-other" else 2048) + (
            24 if zoo == "tiny-teacher-other" else 0)  # fp32 logits (+ span, continuation at 2 T, NLL, row counts)
        assert f"teacher cache {Path(t['dir']).name}: {kind}, {t['bytes_per_position']:,} B per position × " \
            f"{positions:,} positions" in status, status


def test_the_cache_of_a_teacher_with_another_tokenizer_trains_as_the_live_teacher(teacher_sweep, cross_runs):
    """The second teacher's cached trials against the same job with the live teacher (cross_runs: gold)."""
    sweep_dir, _ = teacher_sweep
    live = cross_runs["gold"]
    for n in (0, 2):  # the trial that built the cache, and one that only read it
        cached = sweep_dir / str(n)
        a, b = read_run(live), read_run(cached)
        assert b["config"]["teacher"]["zoo"] == "tiny-teacher-other"
        assert b["objective"] == pytest.approx(a["objective"], abs=1e-5)
        assert b["alignment"] == a["alignment"]  # the cache counts what did not align as the live teacher does
        assert b["teacher_targets"]["cross_tokenizer"] == a["teacher_targets"]["cross_tokenizer"]
        for x, y in zip(read_metrics(live), read_metrics(cached), strict=True):
            assert (x["kind"], x["step"]) == (y["kind"], y["step"])
            for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
                if key in x:
                    assert y[key] == pytest.approx(x[key], abs=1e-5, rel=1e-5), (n, x["kind"], x["step"], key)


@pytest.fixture(scope="module")
def sparse_caches(tmp_path_factory, other_teacher):
    """The second teacher cached sparsely: topk with every token but one (the whole distribution), and sample."""
    root = tmp_path_factory.mktemp("sparse")
    kinds = {"topk": ["teacher.cache.method=topk", "teacher.cache.k=1535"], "sample": ["teacher.cache.method=sample"]}
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(kdsweep, "teacher=tiny_other", "loss.cross_tokenizer=gold", "teacher.logits=cache",
                                  *extra, f"teacher.cache.dir={root / 'tc'}", *SHORT, f"hydra.run.dir={root / name}",
                                  cwd=root) for name, extra in kinds.items()}
        logs = {name: job.result() for name, job in done.items()}
    return root, logs


def test_a_sparse_cache_of_a_teacher_with_another_tokenizer_weighs_a_few_fields_and_topk_is_exact(sparse_caches,
                                                                                                cross_runs):
    """Only each span head's sparse distribution and the span fields are kept; topk with k = V − 1 keeps the whole
    distribution, so it trains as the live teacher; sample says it is a plug-in estimate."""
    root, logs = sparse_caches
    live = cross_runs["gold"]
    ids = 2  # a 1,536-token teacher's ids fit in uint16
    for name, per_position in (("topk", 1535 * (ids + 4) + 4 + 24), ("sample", 12 * ids + 24)):
        record = read_run(root / name)
        t = record["teacher_targets"]
        assert record["status"] == "completed" and t["source"] == "cache" and t["method"] == name
        assert t["bytes_per_position"] == per_position and "cross_tokenizer" in t
        meta = json.loads((Path(t["dir"]) / "meta.json").read_text())
        files = sum(f.stat().st_size for f in Path(t["dir"]).glob("*.*.0"))
        assert files == per_position * sum(s["positions"] for s in meta["splits"].values())
        assert record["alignment"] == read_run(live)["alignment"]
    assert "biased plug-in estimate" in logs["sample"].stderr and "plug-in" not in logs["topk"].stderr
    assert read_run(root / "topk")["objective"] == pytest.approx(read_run(live)["objective"], abs=1e-5)
    for x, y in zip(read_metrics(live), read_metrics(root / "topk"), strict=True):
        for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-5, rel=1e-5), (x["kind"], x["step"], key)
    assert read_run(root / "sample")["objective"] != read_run(live)["objective"]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory, teacher_sweep):
    """Both teachers at once (weights 1 and 3), from the teacher sweep's caches: each teacher's targets cached on
    their own, found built."""
    _, caches = teacher_sweep
    root = tmp_path_factory.mktemp("mixture")
    with ThreadPoolExecutor(2) as pool:  # and with the fused loss
        done = [pool.submit(kdsweep, "teachers=[{zoo:tiny-teacher,weight:1},{zoo:tiny-teacher-other,weight:3}]",
                            "teacher.logits=cache", "teacher.cache.method=full", f"teacher.cache.dir={caches}", *SHORT,
                            *extra, f"hydra.run.dir={root / name}", cwd=root)
                for name, extra in (("both", ["loss.impl=chunked"]), ("fused", ["loss.impl=fused", *SPLIT]))]
        for job in done:
            job.result()
    return root / "both"


def test_the_fused_loss_mixes_a_same_and_an_other_tokenizer_teacher_as_the_chunked_one(mixture):
    """Both teachers' caches (one Logits, one Aligned) under loss.impl=fused: the chunked job's numbers."""
    assert read_run(mixture.parent / "fused")["objective"] == pytest.approx(read_run(mixture)["objective"], abs=1e-6)
    assert_same_rows(mixture, mixture.parent / "fused", 1e-6)


def test_several_teachers_mix_their_divergences_each_from_its_own_cache(mixture, teacher_sweep):
    """(One teacher as a mixture of one is that teacher: tests/unit/losses/test_mixture_targets.py.)"""
    sweep_dir, caches = teacher_sweep
    alone = {read_run(sweep_dir / str(n))["config"]["teacher"]["zoo"]: read_run(sweep_dir / str(n)) for n in (0, 1)}
    both = read_run(mixture)
    targets = both["teacher_targets"]
    assert both["status"] == "completed" and targets["source"] == "mixture"
    assert [m["weight"] for m in targets["teachers"]] == [0.25, 0.75]
    assert [m["source"] for m in targets["teachers"]] == ["cache", "cache"] and not any(m["built"] for m in targets["teachers"])
    assert {m["dir"] for m in targets["teachers"]} == {r["teacher_targets"]["dir"] for r in alone.values()}
    assert "cross_tokenizer" in targets["teachers"][1] and "cross_tokenizer" not in targets["teachers"][0]
    assert both["cost"]["teacher_tokens_computed"] == 0 and len(list(caches.glob("*/meta.json"))) == 2
    assert both["alignment"]["kd_spans"] > 0  # the second teacher's spans
    # before any step the student is every teacher's: the held-out distance and teacher CE are the weighted means
    first, second = alone["tiny-teacher"]["eval_before"], alone["tiny-teacher-other"]["eval_before"]
    for key in ("kl", "teacher_ce"):
        assert both["eval_before"][key] == pytest.approx(0.25 * first[key] + 0.75 * second[key], rel=1e-6), key
    assert both["eval_before"]["student_ce"] == pytest.approx(first["student_ce"], rel=1e-6)
    assert both["objective"] != alone["tiny-teacher"]["objective"] and both["objective"] != alone["tiny-teacher-other"]["objective"]


def test_kill_9_then_rerun_across_tokenizers_gives_the_uninterrupted_run(cross_runs, tmp_path):
    """The gold job of cross_runs, checkpointed every 2 steps, killed with SIGKILL after its first checkpoint and run
    again: it resumes and ends as the uninterrupted job did, every step logged once."""
    import signal
    import time

    from test_resume import _wait_for_step

    args = [a for a in SHORT if not a.startswith("checkpoint.save_every")] + ["checkpoint.save_every=2"]
    args += ["teacher=tiny_other", "loss.cross_tokenizer=gold", "loss.impl=chunked"]
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "kdsweep", *args, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for_step(run_dir, 3, proc, time.time() + 300)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_run(run_dir)["status"] == "running"  # it really died mid-run
    kdsweep(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    record, reference = read_run(run_dir), read_run(cross_runs["gold"])
    assert record["status"] == "completed" and record["attempts"] == 2 and 2 <= record["start_step"] < 6
    assert record["objective"] == pytest.approx(reference["objective"], abs=1e-6)
    got = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    want = [r for r in read_metrics(cross_runs["gold"]) if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [round(r["loss"], 6) for r in got] == [round(r["loss"], 6) for r in want]


TEACHER_TEMPLATE = ("<s>{% for m in messages %}[{{ m['role'] }}]\n{{ m['content'] | trim }}</s>{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]\n{% endif %}")
"""A header template of the second teacher's own, in its tokenizer's BOS and EOS (the zoo ships no template)."""


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory, other_teacher):
    """Chats from the shipped corpus, the student in Qwen3's template as Qwen ships it (reasoning: the last turn's
    empty <think> block), the second teacher in its own; one job with the live teacher, one from its cache, side by
    side."""
    from kdsweep.data.text import EMBEDDED_CORPUS

    root = tmp_path_factory.mktemp("chat")
    sentences = [s.strip() + "." for s in Path(EMBEDDED_CORPUS).read_text().split(". ") if 30 < len(s) < 120]
    chats = [{"messages": [{"role": "user", "content": f"What follows: {sentences[2 * k][:30]}?"},
                           {"role": "assistant", "content": sentences[2 * k]},
                           {"role": "user", "content": "And then?"},
                           {"role": "assistant", "content": sentences[2 * k + 1]}]} for k in range(120)]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (root / "teacher.jinja").write_text(TEACHER_TEMPLATE)
    qwen3 = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen3.jinja"
    args = ["teacher=tiny_other", "data=chat", f"data.datasets.0.path={root / 'chats.jsonl'}", f"data.chat_template={qwen3}",
            f"teacher.chat_template={root / 'teacher.jinja'}", "data.seq_len=256", f"data.cache_dir={root / 'data'}", *SHORT]
    runs = {"live": root / "live", "cache": root / "cache"}
    extra = {"live": ["checkpoint.save_every=3"],
             "cache": ["teacher.logits=cache", "teacher.cache.method=full", f"teacher.cache.dir={root / 'tc'}"]}
    with ThreadPoolExecutor(2) as pool:  # one tokenizes the rows (and the teacher's readings), the other waits for them
        done = [pool.submit(kdsweep, *args, *extra[name], f"hydra.run.dir={run_dir}", cwd=root)
                for name, run_dir in runs.items()]
        for job in done:
            job.result()
    # run again (on a copy), the live job resumes from its last checkpoint: its fingerprint holds the key of the
    # rows it reads, the teacher's readings included
    shutil.copytree(runs["live"], root / "again")
    rerun = kdsweep(*args, *extra["live"], f"hydra.run.dir={root / 'again'}", cwd=root, check=False)
    return runs, root, rerun


def test_chat_rows_are_read_in_the_teachers_own_template_live_and_cached_alike(chat_runs):
    runs, root, rerun = chat_runs
    live, cached = read_run(runs["live"]), read_run(runs["cache"])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    again = read_run(root / "again")
    assert again["attempts"] == 2 and again["start_step"] == 6 and again["resumed_from"].endswith("step_00000006")
    assert live["status"] == cached["status"] == "completed" and cached["teacher_targets"]["built"]
    # the teacher's readings were kept beside the rows (one tokenization for both jobs)
    (rows_dir,) = [d for d in (root / "data").iterdir() if (d / "train.pt").is_file()]
    assert (rows_dir / "train.views.pt").is_file() and (rows_dir / "eval.views.pt").is_file()
    assert sorted([live["data"]["cache_reused"], cached["data"]["cache_reused"]]) == [False, True]
    counts = live["alignment"]
    assert counts["kd_spans"] > 0 and counts["kd_spans_dropped"] == 0 and cached["alignment"] == counts
    assert cached["objective"] == pytest.approx(live["objective"], abs=1e-5)
    for x, y in zip(read_metrics(runs["live"]), read_metrics(runs["cache"]), strict=True):
        for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-5, rel=1e-5), (x["kind"], x["step"], key)
    assert all(math.isfinite(r["kd"]) and r["kd"] > 0 for r in read_metrics(runs["live"]) if r["kind"] == "train")


def test_one_tokenizer_forced_through_the_chat_views_gives_the_same_numbers(chat_runs, tmp_path):
    """Chat rows read through the views (each side's template: here the same one, whose turns end with the EOS),
    with the student's own tokenizer forced through the cross-tokenizer path: the plain run's numbers (1e-6)."""
    _, root, _ = chat_runs
    (tmp_path / "t.jinja").write_text(TEACHER_TEMPLATE)
    args = ["data=chat", f"data.datasets.0.path={root / 'chats.jsonl'}", f"data.chat_template={tmp_path / 't.jinja'}",
            f"teacher.chat_template={tmp_path / 't.jinja'}", "data.seq_len=256", *SHORT]
    plain, forced = tmp_path / "plain", tmp_path / "forced"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KDSWEEP_TEST_FORCE_CROSS_TOKENIZER": "1"}  # the forced job's only
    with ThreadPoolExecutor(1) as pool:  # side by side
        plain_done = pool.submit(kdsweep, *args, f"hydra.run.dir={plain}", cwd=tmp_path)
        proc = subprocess.run([sys.executable, "-m", "kdsweep", *args, f"hydra.run.dir={forced}"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=600)
        plain_done.result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = read_run(plain), read_run(forced)
    assert "cross_tokenizer" in b["teacher_targets"] and "cross_tokenizer" not in a["teacher_targets"]
    assert b["alignment"]["kd_spans"] > 0 and b["alignment"]["kd_spans_dropped"] == 0
    assert b["objective"] == pytest.approx(a["objective"], abs=1e-6)
    for x, y in zip(read_metrics(plain), read_metrics(forced), strict=True):
        for key in ("loss", "ce", "kd", "kl", "student_ce", "teacher_ce", "grad_norm"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-6, rel=1e-6), (x["kind"], x["step"], key)
