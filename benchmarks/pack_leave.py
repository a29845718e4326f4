"""A pack's step after members leave: a pack of 4 on the embedded default (live teacher, 24 steps, evaluations every
4) in which one member is pruned at its first evaluation (step 4) and one turns non-finite (a learning rate of 1e4:
its loss leaves the finite numbers at step 3), beside a pack of the 2 survivors alone. A pack's step is
timed once for all its members (each member's ``step_s`` row is the pack's), so the first member's rows show the
step time with 4, 3 and 2 members; the survivors' rows must equal those of the pack of 2 (the leavers change
nothing for them). Prints the table and saves ``benchmarks/results/pack_leave.json``.

    python benchmarks/pack_leave.py [--repeats 3] [--work DIR] [--out benchmarks/results/pack_leave.json]

Medians over interleaved repeats, one process per arm (imports excluded, as a warm worker pays them once).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pack import configs, trial_overrides  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 24, 4
MEMBERS = [("kept", 0.5, 1e-3), ("pruned", 0.5, 3e-4), ("nan", 0.5, 1e4), ("kept", 1.0, 1e-3)]
"""Each member's role, kd_ratio and learning rate."""


class PruneAt:
    """A reporter that prunes its member at its first evaluation after ``step`` steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def report(self, step: int, evals: dict[str, float]) -> bool:
        return step >= self.step


def arm_run(arm: str, out: Path) -> None:
    import torch

    from kdsweep.pack import run_pack
    from kdsweep.train import NULL_REPORTER
    from kdsweep.train.kept import Kept

    torch.set_num_threads(int(os.environ.get("KDSWEEP_BENCH_THREADS", "2")))
    members = MEMBERS if arm == "four" else [m for m in MEMBERS if m[0] == "kept"]
    common = [*trial_overrides(STEPS), f"train.eval_every={EVERY}"]
    cfgs = configs([[*common, f"kd_ratio={r}", f"lr={lr}"] for _, r, lr in members], out)
    reporters = [PruneAt(EVERY) if role == "pruned" else NULL_REPORTER for role, _, _ in members]
    results = run_pack(cfgs, reporters=reporters, kept=Kept())
    rows = [[json.loads(line) for line in (Path(c.output_dir) / "metrics.jsonl").read_text().splitlines()]
            for c in cfgs]
    (out / "result.json").write_text(json.dumps({
        "arm": arm, "roles": [m[0] for m in members],
        "status": [getattr(r, "status", type(r).__name__) for r in results],
        "steps": [max((x["step"] for x in r if x["kind"] == "train"), default=0) for r in rows],
        "step_s": {x["step"]: x["step_s"] for x in rows[0] if x["kind"] == "train"},
        "objectives": [getattr(r, "objective", None) for r in results]}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kdsweep-pack-leave"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pack_leave.json")
    ap.add_argument("--arm-run", nargs=2, metavar=("ARM", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm_run:
        arm_run(args.arm_run[0], Path(args.arm_run[1]))
        return
    env = {**os.environ, "KDSWEEP_CACHE": str(args.work / "cache"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    runs: dict[str, list[dict]] = {"four": [], "two": []}

    def one(arm: str, tag: str) -> dict:
        out = args.work / "runs" / f"{arm}-{tag}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir(parents=True)
        proc = subprocess.run([sys.executable, __file__, "--arm-run", arm, str(out)], env=env, cwd=args.work,
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{arm} failed:\n{proc.stderr[-3000:]}")
        return json.loads((out / "result.json").read_text())

    one("two", "warm")  # the zoo and the tokenized rows: not measured
    for r in range(args.repeats):
        for arm in (("four", "two") if r % 2 == 0 else ("two", "four")):
            runs[arm].append(one(arm, str(r)))
    four = runs["four"][0]
    # the steps each member computed: its rows', and the step it left at when its loss was not finite
    computed = [n + (1 if status == "FloatingPointError" else 0) for n, status in zip(four["steps"], four["status"])]
    members_at = {k: sum(c >= k for c in computed) for k in range(2, STEPS + 1)}  # step 1 pays the first calls

    def median_ms(arm: str, steps: list[int]) -> float:
        return 1e3 * statistics.median(s for run in runs[arm] for step, s in run["step_s"].items()
                                       if int(step) in steps)

    table = {}
    for n in sorted(set(members_at.values()), reverse=True):
        steps = [k for k, m in members_at.items() if m == n]
        table[f"{n} members"] = {"steps": f"{steps[0]}-{steps[-1]}", "pack_of_4_ms": median_ms("four", steps),
                                 "pack_of_2_ms": median_ms("two", steps)}
    kept = [o for o, role in zip(four["objectives"], four["roles"]) if role == "kept"]
    same = max(abs(a - b) for a, b in zip(kept, runs["two"][0]["objectives"]))
    left = dict(zip(four["roles"], computed))
    print(f"the pruned member computed steps 1-{left['pruned']}, the non-finite one 1-{left['nan']}; the survivors' "
          f"objectives against the pack of 2: max |diff| {same:.2e}")
    for name, row in table.items():
        print(f"{name:10s} steps {row['steps']:>6s}: pack of 4 {row['pack_of_4_ms']:7.1f} ms/step, "
              f"pack of 2 {row['pack_of_2_ms']:7.1f} ms/step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "repeats": args.repeats, "command": " ".join(sys.argv), "members": MEMBERS,
        "computed_steps": left, "survivors_objective_max_diff": same, "table": table, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
