"""Packed trials against the same trials unpacked on a warm worker: device-seconds per trial, peak memory, the answer.

The same 16 trials (``kd_ratio`` 0.25/0.5/0.75/1 × ``lr`` 1e-4/3e-4/1e-3/3e-3, LoRA r8, ``--steps`` steps, one
evaluation midway and one after, on at most 16 held-out rows) run in one process per arm, as a warm worker runs
them (one :class:`~kdsweep.train.kept.Kept`: the rows and the teacher's weights read once):

- ``unpacked``: trial after trial (:func:`kdsweep.train.run`);
- ``pack2``, ``pack4``, ``pack8``: in packs of K (:func:`kdsweep.pack.run_pack`), pack after pack.

With the live teacher and with the ``sample`` teacher cache (k=12, built by an unmeasured first run), on the embedded
default and on ``step_time.py``'s 512-vocabulary pair. The trials are a sweep's (``trial.sweep_dir``: the arm's
directory), so the untrained student is evaluated once per arm, as once per sweep. An arm's device-seconds per trial
is the wall time of its 16 trials (imports excluded: a warm worker pays them once) over 16; its peak is the process's
resident peak. Each trial's objective is kept: a pack's members are the trials alone, so every arm must reach the
same answer.

The sharing bound: in the unpacked live arm, T is the median time of the teacher's forward on a training
micro-batch and S the rest of a median step; sharing the teacher alone over K members makes a step (T/K + S)/(T + S)
of an unpacked one. Reported per K: the packed arm's device-seconds per trial over the unpacked arm's, beside that
bound, and over the unpacked ``sample``-cached arm's (exact targets at the cache's price).

    python benchmarks/pack.py [--pairs embedded vocab512] [--teachers live sample] [--ks 2 4 8] [--steps 20]
                              [--repeats 1] [--work DIR] [--out benchmarks/results/pack.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import pair_overrides  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
POINTS = [(r, lr) for r in (0.25, 0.5, 0.75, 1.0) for lr in (1e-4, 3e-4, 1e-3, 3e-3)]
TEACHERS = {"live": [], "sample": ["teacher.logits=cache", "teacher.cache.method=sample"]}


def trial_overrides(steps: int) -> list[str]:
    return [f"train.max_steps={steps}", f"train.eval_every={steps // 2}", "train.log_every=1", "lora_rank=8",
            "data.max_eval_sequences=16", "checkpoint.save_every=0", "checkpoint.export_adapter=false",
            "checkpoint.export_merged=false", "logger.progress_bar=false"]


def configs(overrides: list[list[str]], out: Path) -> list:
    """Each trial's RunConfig, composed and validated as ``python -m kdsweep`` would."""
    from hydra import compose, initialize_config_dir

    from kdsweep.app import conf_dir, resolve, validate

    made = []
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        for i, o in enumerate(overrides):
            raw = resolve(compose(config_name="config", overrides=o))
            raw["output_dir"] = str(out / f"trial{i:02d}")
            raw["trial"] = {"sweep_dir": str(out), "number": i, "study": "bench"}  # a sweep's: one baseline
            made.append(validate(raw))
    return made


def peak_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))) / 1024


def arm_run(arm: str, common: list[str], out: Path) -> None:
    """One arm in this process: its 16 trials, timed; writes ``out/result.json``."""
    import torch

    from kdsweep.metrics.records import JOB_STARTED
    from kdsweep.pack import run_pack
    from kdsweep.teacher.live import LiveTeacher
    from kdsweep.train import run
    from kdsweep.train.kept import Kept
    from kdsweep.train.trial import reset_peak_memory

    torch.set_num_threads(int(os.environ.get("KDSWEEP_BENCH_THREADS", "2")))
    teacher_s: dict[int, list[float]] = {}
    timed = LiveTeacher.targets

    @contextmanager
    def timing(self, batch):  # the teacher's forward on a micro-batch, by its rows
        t0 = time.perf_counter()
        with timed(self, batch) as targets:
            teacher_s.setdefault(batch.input_ids.shape[0], []).append(time.perf_counter() - t0)
            yield targets

    LiveTeacher.targets = timing
    cfgs = configs([[*common, f"kd_ratio={r}", f"lr={lr}"] for r, lr in POINTS], out)
    kept, k = Kept(), 1 if arm == "unpacked" else int(arm.removeprefix("pack"))
    reset_peak_memory(torch.device("cpu"))
    results = []
    t0 = time.perf_counter()
    for i in range(0, len(cfgs), k):
        os.environ[JOB_STARTED] = str(time.time())  # each job's clock, as a warm worker sets it per job
        results += [run(cfgs[i], kept=kept)] if arm == "unpacked" else run_pack(cfgs[i:i + k], kept=kept)
    wall = time.perf_counter() - t0
    steps = []
    for cfg in cfgs:
        rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
        steps.append(statistics.median(r["step_s"] for r in rows if r.get("kind") == "train"))
    micro = cfgs[0].data.micro_batch_size
    forward = teacher_s.get(micro, [])
    (out / "result.json").write_text(json.dumps({
        "arm": arm, "wall_s": wall, "device_s_per_trial": wall / len(cfgs), "peak_mb": peak_mb(),
        "objectives": [r.objective for r in results], "step_s_median": statistics.median(steps),
        "teacher_forward_s_median": statistics.median(forward) if forward else None,
        "micro_batches_per_step": cfgs[0].data.batch_size // micro}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=["embedded", "vocab512"], choices=["embedded", "vocab512"])
    ap.add_argument("--teachers", nargs="+", default=list(TEACHERS), choices=list(TEACHERS))
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kdsweep-pack-bench"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pack.json")
    ap.add_argument("--arm-run", nargs=2, metavar=("ARM", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--common", nargs="*", default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm_run:
        arm_run(args.arm_run[0], args.common, Path(args.arm_run[1]))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KDSWEEP_CACHE": str(args.work / "cache"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    arms = ["unpacked", *(f"pack{k}" for k in args.ks)]
    runs: dict[str, list[dict]] = {}

    def one(pair: str, teacher: str, arm: str, tag: str) -> dict:
        out = args.work / "runs" / f"{pair}-{teacher}-{arm}-{tag}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir(parents=True)
        common = [*pair_overrides(pair, args.work), *TEACHERS[teacher], *trial_overrides(args.steps)]
        proc = subprocess.run([sys.executable, __file__, "--arm-run", arm, str(out), "--common", *common], env=env,
                              cwd=args.work, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{pair} {teacher} {arm} failed:\n{proc.stderr[-3000:]}")
        result = json.loads((out / "result.json").read_text())
        print(f"{pair:9s} {teacher:7s} {arm:9s} {result['device_s_per_trial']:7.2f} s/trial  "
              f"peak {result['peak_mb']:6.0f} MB  step {result['step_s_median'] * 1e3:7.1f} ms", flush=True)
        return result

    for pair in args.pairs:
        for teacher in args.teachers:  # builds the zoo, the pair and the cache: not measured
            one(pair, teacher, "pack2", "warm")
    for r in range(args.repeats):
        for pair in args.pairs:
            for teacher in args.teachers:
                for arm in (arms if r % 2 == 0 else arms[::-1]):
                    runs.setdefault(f"{pair}/{teacher}/{arm}", []).append(one(pair, teacher, arm, str(r)))
    med = lambda key, field: statistics.median(x[field] for x in runs[key])
    table: dict[str, dict] = {}
    for pair in args.pairs:
        for teacher in args.teachers:
            base = f"{pair}/{teacher}/unpacked"
            row = {"unpacked_s_per_trial": med(base, "device_s_per_trial"), "unpacked_peak_mb": med(base, "peak_mb"),
                   "answer": min(runs[base][0]["objectives"])}
            forward = runs[base][0]["teacher_forward_s_median"] if teacher == "live" else None
            if forward is not None:  # T and S of the live step, and the bound sharing T gives
                t = forward * runs[base][0]["micro_batches_per_step"]
                s = med(base, "step_s_median") - t
                row["teacher_s_per_step"], row["rest_s_per_step"] = t, s
            for k in args.ks:
                key = f"{pair}/{teacher}/pack{k}"
                ratio = med(key, "device_s_per_trial") / row["unpacked_s_per_trial"]
                row[f"pack{k}"] = {
                    "s_per_trial": med(key, "device_s_per_trial"), "peak_mb": med(key, "peak_mb"),
                    "over_unpacked": ratio,
                    "answer_diff": max(abs(a - b) for a, b in zip(runs[key][0]["objectives"],
                                                                  runs[base][0]["objectives"])),
                    **({"sharing_bound": (row["teacher_s_per_step"] / k + row["rest_s_per_step"])
                        / (row["teacher_s_per_step"] + row["rest_s_per_step"])} if forward is not None else {}),
                }
                sample = f"{pair}/sample/unpacked"
                if sample in runs:
                    row[f"pack{k}"]["over_sample_unpacked"] = med(key, "device_s_per_trial") / med(
                        sample, "device_s_per_trial")
            table[f"{pair}/{teacher}"] = row
    print(json.dumps(table, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "steps": args.steps, "repeats": args.repeats,
        "points": POINTS, "command": " ".join(sys.argv), "table": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
