"""KD training throughput with packed rows against padded rows, on instruction data with skewed sample lengths.

The data: a seeded alpaca-style JSONL (``instruction``, ``input``, ``output``) written to a temp dir, its texts
runs of words of the embedded corpus. Response lengths in tokens are skewed: log-normal (median
``--median-tokens``, sigma ``--sigma``) for most rows, so most samples are ~30-80 tokens with the prompt, and
uniform in [seq_len-152, seq_len-72] for a ``--long-fraction`` of them (~400-500 tokens with the prompt at
seq_len 512). It is read through the real data path (``kdsweep.data.dataset.load_data``, format
``instruction``, prompt masked) into two caches, built once by this process before anything is timed:

- pad:  ``data.sequences=pad``, one sample per row, each micro-batch right-padded to its longest row
        (``attention_mask``);
- pack: ``data.sequences=pack`` (``pack_strategy``, best_fit by default), whole samples packed into rows of
        ``seq_len`` tokens (``position_ids`` restart per sample, no attention mask: block-diagonal attention).

Both arms use the same models (the embedded tiny-teacher and tiny-student, LoRA as the default run), the same
``batch_size`` and ``micro_batch_size`` counted in ROWS (a packed row holds several samples, so a pack step
trains on many more samples than a pad step), AdamW and the run's schedule, and the real optimizer step
(``kdsweep.train.step.train_step``; rows batched by ``Rows.batch`` in the order of ``StepSampler``, as the
training loop does). Each measurement is a fresh process with ``torch.set_num_threads(--threads)``: it loads
the models, runs ``--warmup`` steps, then times ``--steps`` optimizer steps (pack arm; the pad arm runs as many
steps as it takes to see about the same number of non-padding tokens), including the batching of the rows.
Arms alternate (pad, pack, pack, pad, ...) for ``--repeats`` repeats; each value is the median over repeats.

Per arm: non-padding input tokens/s (sum of ``Rows.tokens`` over the rows of every timed micro-batch, divided by
the wall time of the timed steps), target (label) tokens/s, samples/s, the padding fraction of the micro-batches
actually run (``Rows.padding_fraction``), and the data stats (rows, truncated, dropped). The headline is the
ratio pack / pad of non-padding tokens/s.

    KDSWEEP_CACHE=... python benchmarks/packing.py [--samples 4000] [--long-fraction 0.03] [--seq-len 512]
        [--batch-size 16] [--micro-batch-size 8] [--steps 12] [--warmup 2] [--repeats 3] [--threads 1] [--seed 0]
        [--out benchmarks/results/packing.json] [--quick]

The full run takes a few minutes on 2 CPUs. ``--quick`` is a smoke run (400 samples, 2 timed steps, 1 repeat;
well under a minute) and writes ``packing_quick.json`` unless ``--out`` is given. Set ``KDSWEEP_CACHE`` to where
the embedded models are (they are built there on first use).

Threads: one by default. On a small shared machine (2 CPUs with other work on them) two intra-op threads made
these tiny models' steps 10-100x slower and erratic (OpenMP threads waiting on each other at every op when one
is descheduled; small padded micro-batches suffered most), which measures the machine, not the data path.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ARMS = ("pad", "pack")
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------------- the data
def word_tokens(tokenizer: Any, words: list[str]) -> dict[str, int]:
    """Tokens of each distinct word as it appears inside a text (after a space)."""
    distinct = sorted(set(words))
    ids = tokenizer([" " + w for w in distinct], add_special_tokens=False)["input_ids"]
    return {w: len(i) for w, i in zip(distinct, ids)}


def response_length(rng: random.Random, median: float, sigma: float, long_fraction: float,
                     long_range: tuple[int, int]) -> int:
    """Tokens of one response: log-normal (short), or with probability ``long_fraction`` uniform in ``long_range``."""
    if rng.random() < long_fraction:
        return rng.randint(*long_range)
    return min(long_range[1], max(4, round(rng.lognormvariate(math.log(median), sigma))))


def write_dataset(path: Path, n: int, seed: int, median_tokens: float, sigma: float, long_fraction: float,
                  long_range: tuple[int, int], tokenizer: Any) -> None:
    """``n`` alpaca-style rows; each response is a run of corpus words of about a drawn number of tokens."""
    from kdsweep.data.text import EMBEDDED_CORPUS

    chapters = [line.split() for line in EMBEDDED_CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
    words = [w for ch in chapters for w in ch]
    cost = word_tokens(tokenizer, words)
    rng = random.Random(seed)

    def run_of(tokens: int) -> str:
        """Consecutive words from a random place of the corpus, about ``tokens`` tokens long."""
        start, out, used = rng.randrange(len(words)), [], 0
        while used < tokens:
            w = words[(start + len(out)) % len(words)]
            out.append(w)
            used += cost[w]
        return " ".join(out)

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            response = response_length(rng, median_tokens, sigma, long_fraction, long_range)
            row = {"instruction": run_of(rng.randint(4, 12)),
                   "input": run_of(rng.randint(3, 15)) if rng.random() < 0.3 else "",
                   "output": run_of(response)}
            f.write(json.dumps(row) + "\n")


def long_range(seq_len: int) -> tuple[int, int]:
    """Response tokens of a long sample: with the longest prompt (~57 tokens) it still fits ``seq_len``."""
    return max(4, seq_len - 152), max(4, seq_len - 72)


def data_config(arm: str, spec: dict[str, Any]):
    from kdsweep.config.schema import DataConfig, DatasetConfig

    return DataConfig(datasets=(DatasetConfig(path=spec["jsonl"], format="instruction"),), sequences=arm,
                      seq_len=spec["seq_len"], truncation="truncate", pack_strategy=spec["pack_strategy"],
                      cache_dir=spec["cache_dir"], batch_size=spec["batch_size"],
                      micro_batch_size=spec["micro_batch_size"])


def samples_per_row(rows: Any) -> "Any":
    """Samples in each row: 1 for padded rows; for packed rows the documents (position 0) in the used tokens."""
    import torch

    if rows.position_ids is None:
        return torch.ones(len(rows), dtype=torch.long)
    starts = (rows.position_ids == 0).long()
    out = torch.empty(len(rows), dtype=torch.long)
    for i in range(len(rows)):
        a = int(rows.offsets[i])
        out[i] = starts[a: a + int(rows.tokens[i])].sum()
    return out


# ------------------------------------------------------------------------------------- one arm, in its process
def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load data and models as the training loop does, warm up, time ``steps`` optimizer steps."""
    import torch

    torch.set_num_threads(spec["threads"])
    from kdsweep.config.schema import LossConfig, OptimConfig, StudentConfig, TeacherConfig
    from kdsweep.data.dataset import load_data
    from kdsweep.teacher.live import LiveTeacher
    from kdsweep.data.sampling import StepSampler
    from kdsweep.distributed import single_process
    from kdsweep.models.load import load_student, load_teacher, load_tokenizer, resolve_dir
    from kdsweep.train import schedule
    from kdsweep.train.step import Learner, train_step

    arm, seed = spec["arm"], spec["seed"]
    t_start = time.perf_counter()
    student_cfg, loss_cfg, optim_cfg = StudentConfig(zoo="tiny-student"), LossConfig(impl="chunked"), OptimConfig()
    student_dir, teacher_dir = resolve_dir(student_cfg), resolve_dir(TeacherConfig(zoo="tiny-teacher"))
    tokenizer = load_tokenizer(student_dir)
    data = load_data(data_config(arm, spec), tokenizer, student_dir, loss_cfg.ignore_index)
    rows = data.train
    device = torch.device("cpu")
    torch.manual_seed(seed)
    teacher = load_teacher(teacher_dir, "fp32", device)
    student = load_student(student_dir, student_cfg, "fp32", device, seed)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=optim_cfg.lr,
                                  betas=optim_cfg.betas, eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay)
    warmup, steps = spec["warmup"], spec["steps"]
    scheduler = schedule.build(optimizer, optim_cfg, warmup + steps)
    sampler = StepSampler(len(rows), spec["batch_size"], seed)
    per_row_samples = samples_per_row(rows)
    dist = single_process()
    setup_s = time.perf_counter() - t_start

    timed: list[Any] = []
    step_s: list[float] = []
    cpu_s: list[float] = []
    counts = {"tokens": 0, "targets": 0, "samples": 0, "rows": 0, "padded_tokens": 0, "micro_batches": 0}
    checks = {"mask_sums_equal_rows_tokens": True, "pad_batches_with_mask": 0, "batches_with_position_ids": 0}
    losses = []
    for step in range(warmup + steps):
        shares = sampler.rank_micro_batches(step, 0, 1, spec["micro_batch_size"])
        t0, c0 = time.perf_counter(), time.process_time()
        micro = [rows.batch(idx) for idx in shares]
        learner = Learner(student, LiveTeacher(teacher), optimizer, scheduler, loss_cfg, optim_cfg.max_grad_norm)
        stats, = train_step([learner], micro, dist=dist)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        losses.append(stats.loss)
        if step < warmup:
            continue
        step_s.append(dt)
        cpu_s.append(dc)
        timed.extend(shares)
        counts["targets"] += stats.tokens
        for idx, b in zip(shares, micro):
            used = rows.tokens[idx]
            counts["tokens"] += int(used.sum())
            counts["samples"] += int(per_row_samples[idx].sum())
            counts["rows"] += len(idx)
            counts["padded_tokens"] += b.input_ids.numel()
            counts["micro_batches"] += 1
            if b.attention_mask is not None:
                checks["pad_batches_with_mask"] += 1
                checks["mask_sums_equal_rows_tokens"] &= bool((b.attention_mask.sum(1) == used).all())
            if b.position_ids is not None:
                checks["batches_with_position_ids"] += 1
    wall = sum(step_s)
    return {
        "arm": arm, "repeat": spec["repeat"], "setup_s": round(setup_s, 3), "warmup_steps": warmup, "steps": steps,
        "wall_s": wall, "step_s": step_s, "cpu_s": sum(cpu_s),
        "tokens_per_cpu_s": counts["tokens"] / sum(cpu_s),
        "tokens_per_s": counts["tokens"] / wall, "targets_per_s": counts["targets"] / wall,
        "samples_per_s": counts["samples"] / wall, "rows_per_s": counts["rows"] / wall,
        "padded_tokens_per_s": counts["padded_tokens"] / wall,
        "padding_fraction": rows.padding_fraction(timed),
        "samples_per_row": counts["samples"] / counts["rows"], **counts, "checks": checks,
        "loss_first": losses[0], "loss_last": losses[-1],
        "threads": torch.get_num_threads(), "cache_reused": data.reused,
    }


def in_subprocess(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                         env=env, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{spec['arm']} repeat {spec['repeat']} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------------- main
def prepare(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Write the JSONL, build both arms' caches (untimed) and describe the data."""
    import torch

    from kdsweep.config.schema import StudentConfig
    from kdsweep.data.dataset import load_data
    from kdsweep.models.load import load_tokenizer, resolve_dir

    student_dir = resolve_dir(StudentConfig(zoo="tiny-student"))
    tokenizer = load_tokenizer(student_dir)
    write_dataset(Path(spec["jsonl"]), args.samples, args.seed, args.median_tokens, args.sigma, args.long_fraction,
                  long_range(args.seq_len), tokenizer)
    info: dict[str, Any] = {}
    for arm in ARMS:
        t0 = time.perf_counter()
        data = load_data(data_config(arm, spec), tokenizer, student_dir, IGNORE_INDEX)
        st = data.stats["train"]
        info[arm] = {k: st[k] for k in ("samples", "rows", "tokens", "targets", "truncated", "dropped",
                                        "padding_fraction")}
        info[arm]["tokens_per_row"] = st["tokens"] / st["rows"]
        info[arm]["samples_per_row"] = st["samples"] / st["rows"]
        info[arm]["eval_rows"] = data.stats["eval"]["rows"]
        info[arm]["build_s"] = round(time.perf_counter() - t0, 2)
        if arm == "pad":  # one sample per row: the sample lengths
            lengths = data.train.tokens.double()
            q = torch.quantile(lengths, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9, 0.99], dtype=torch.float64))
            info["sample_tokens"] = {"mean": round(float(lengths.mean()), 1), "max": int(lengths.max()),
                                     **{f"p{p}": round(float(v), 1) for p, v in zip((10, 25, 50, 75, 90, 99), q)},
                                     "over_256": int((lengths > 256).sum()), "over_400": int((lengths > 400).sum())}
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000, help="instruction rows generated (5%% are held out)")
    ap.add_argument("--median-tokens", type=float, default=25.0, help="median tokens of a short response")
    ap.add_argument("--sigma", type=float, default=0.6, help="log-normal sigma of a short response's length")
    ap.add_argument("--long-fraction", type=float, default=0.03,
                    help="share of long responses (uniform in [seq_len-152, seq_len-72] tokens)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--pack-strategy", default="best_fit", choices=["best_fit", "sequential"])
    ap.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="rows per forward/backward")
    ap.add_argument("--steps", type=int, default=12, help="timed steps of the pack arm (pad: same tokens)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of each measurement (see above)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 400 samples, 2 steps, 1 warm-up, 1 repeat")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/packing.json "
                    "(packing_quick.json with --quick)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the data and caches here (default: a temp dir)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    if args.quick:
        args.samples, args.steps, args.warmup, args.repeats = min(args.samples, 400), 2, 1, 1
    out_path = args.out or REPO / "benchmarks" / "results" / ("packing_quick.json" if args.quick else "packing.json")

    import torch
    import transformers

    work = Path(args.keep or tempfile.mkdtemp(prefix="kd-packing-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_total = time.perf_counter()
    try:
        base = {"jsonl": str(work / "instructions.jsonl"), "cache_dir": str(work / "cache"), "seq_len": args.seq_len,
                "pack_strategy": args.pack_strategy, "batch_size": args.batch_size,
                "micro_batch_size": args.micro_batch_size, "warmup": args.warmup, "threads": args.threads,
                "seed": args.seed}
        data = prepare(base, args)
        # the pad arm runs about as many non-padding tokens as the pack arm (same expected data, shorter steps)
        pad_steps = max(1, round(args.steps * data["pack"]["tokens_per_row"] / data["pad"]["tokens_per_row"]))
        steps = {"pad": pad_steps, "pack": args.steps}
        s = data["sample_tokens"]
        print(f"data: {data['pad']['samples']} training samples, tokens per sample p10 {s['p10']:.0f} p50 {s['p50']:.0f} "
              f"p90 {s['p90']:.0f} p99 {s['p99']:.0f} max {s['max']}; pad {data['pad']['rows']} rows, "
              f"pack {data['pack']['rows']} rows ({data['pack']['samples_per_row']:.1f} samples/row)", flush=True)
        order = [arm for r in range(args.repeats) for arm in (ARMS if r % 2 == 0 else ARMS[::-1])]
        runs: list[dict[str, Any]] = []
        for i, arm in enumerate(order):
            r = in_subprocess({**base, "arm": arm, "steps": steps[arm], "repeat": i // 2})
            runs.append(r)
            print(f"  {arm:<4} repeat {r['repeat']}: {r['tokens_per_s']:8.0f} non-pad tokens/s, "
                  f"{r['samples_per_s']:6.1f} samples/s, padding {r['padding_fraction']:.1%} "
                  f"({r['steps']} steps in {r['wall_s']:.1f} s)", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    keys = ("tokens_per_s", "tokens_per_cpu_s", "targets_per_s", "samples_per_s", "rows_per_s", "padded_tokens_per_s", "padding_fraction",
            "samples_per_row", "wall_s")
    arms = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        med = statistics.median(r["tokens_per_s"] for r in mine)
        rep = min(mine, key=lambda r: abs(r["tokens_per_s"] - med))  # the median repeat (for odd repeats)
        arms[arm] = {**{k: statistics.median(r[k] for r in mine) for k in keys},
                     "tokens_per_s_all": [r["tokens_per_s"] for r in mine],
                     "step_s_median": statistics.median(x for r in mine for x in r["step_s"]),
                     "steps": steps[arm], "micro_batches_per_step": args.batch_size // args.micro_batch_size,
                     "checks": rep["checks"], "data": data[arm]}
    ratio = {k: arms["pack"][k] / arms["pad"][k]
             for k in ("tokens_per_s", "tokens_per_cpu_s", "targets_per_s", "samples_per_s")}
    spread = {arm: (min(arms[arm]["tokens_per_s_all"]), max(arms[arm]["tokens_per_s_all"])) for arm in ARMS}

    print(f"\nKD train step (tiny-teacher -> tiny-student, LoRA, fp32, CPU, {args.threads} threads), seq_len "
          f"{args.seq_len}, batch {args.batch_size} rows = {args.batch_size // args.micro_batch_size} micro-batches "
          f"of {args.micro_batch_size} rows; median of {args.repeats}")
    print(f"{'arm':<5} {'non-pad tok/s':>13} {'min..max':>15} {'targets/s':>10} {'samples/s':>10} {'padding':>8} "
          f"{'samples/row':>11} {'step s':>7} {'steps':>5}")
    for arm in ARMS:
        a = arms[arm]
        lo, hi = spread[arm]
        print(f"{arm:<5} {a['tokens_per_s']:>13.0f} {f'{lo:.0f}..{hi:.0f}':>15} {a['targets_per_s']:>10.0f} "
              f"{a['samples_per_s']:>10.1f} {a['padding_fraction']:>8.1%} {a['samples_per_row']:>11.2f} "
              f"{a['step_s_median']:>7.3f} {a['steps']:>5}")
    print(f"pack / pad: {ratio['tokens_per_s']:.2f}x non-pad tokens/s ({ratio['targets_per_s']:.2f}x targets/s, "
          f"{ratio['samples_per_s']:.2f}x samples/s; {ratio['tokens_per_cpu_s']:.2f}x non-pad tokens per CPU-second)")
    for arm in ARMS:
        d = data[arm]
        print(f"data {arm}: {d['samples']} samples -> {d['rows']} rows, {d['tokens']} tokens, {d['truncated']} "
              f"truncated, {d['dropped']} dropped" + ("" if d["padding_fraction"] is None else
                                                      f", padding over all rows {d['padding_fraction']:.1%}"))

    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    payload = {
        "benchmark": "packing",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": sha or None, "host": platform.node(), "machine": platform.machine(),
        "processor": platform.processor() or None, "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "quick": args.quick, "total_s": round(time.perf_counter() - t_total, 1),
        "settings": {
            "samples_generated": args.samples,
            "response_tokens": {"short": f"lognormal(median {args.median_tokens}, sigma {args.sigma}), clipped to "
                                         f"[4, {long_range(args.seq_len)[1]}]",
                                "long": f"uniform{list(long_range(args.seq_len))}",
                                "long_fraction": args.long_fraction},
            "prompt_tokens": "alpaca template (20 tokens, 30 with an input) + 4-12 instruction tokens + 3-15 input "
                             "tokens in 30% of rows",
            "format": "instruction", "seq_len": args.seq_len, "truncation": "truncate",
            "pack_strategy": args.pack_strategy, "batch_size_rows": args.batch_size,
            "micro_batch_size_rows": args.micro_batch_size, "warmup_steps": args.warmup, "timed_steps": steps,
            "repeats": args.repeats, "order": order, "torch_threads": args.threads, "seed": args.seed,
            "teacher": "zoo tiny-teacher", "student": "zoo tiny-student (LoRA rank 8, default StudentConfig)",
            "loss": "LossConfig() defaults (forward_kl, kd_ratio 0.5, chunked)", "dtype": "fp32", "device": "cpu",
        },
        "notes": [
            "batch sizes count rows: a pad row is one sample, a pack row holds samples_per_row samples in seq_len "
            "tokens, so a pack step trains on many more samples than a pad step",
            "tokens_per_s: non-padding input tokens (Rows.tokens of the rows of every timed micro-batch) per second "
            "of the timed steps (Rows.batch + train_step); targets_per_s: label tokens the loss counts",
            "padding_fraction: of the timed micro-batches as run (Rows.padding_fraction); pad rows are padded to the "
            "longest row of their micro-batch, pack rows are all seq_len long",
            "the pad arm runs about as many steps as give the pack arm's non-padding tokens; each measurement is a "
            "fresh process (model loading and warm-up steps untimed); values are medians over repeats",
            "tokens_per_cpu_s: the same tokens per second of process CPU time (all threads) over the timed steps; "
            "less sensitive than wall time to other work on a shared machine",
        ],
        "data": data,
        "arms": arms,
        "ratio_pack_over_pad": ratio,
        "runs": runs,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"saved {out_path}")


if __name__ == "__main__":
    main()
