"""The prepared GPU check: everything kdsweep needs measured on a GPU, in one command, within 8 minutes.

    python benchmarks/gpu/check.py [--out benchmarks/results/gpu.json]   # on the GPU machine (benchmarks/gpu/run.sh)
    python benchmarks/gpu/check.py --dry-run [--out F]                 # the same checks on the CPU, tiny shapes (CI)

Each check has its own time budget (and the whole run one of 8 minutes); a check that cannot run records
``skipped: <why>``, one that breaks records ``failed: <error>``, and the others go on. The JSON is rewritten after
every check, so whatever ran is kept if the machine is taken back. The checks:

1. ``peak_matmul``: the dense bf16 peak of this device, measured (the MFU's denominator).
2. ``embedded``: the embedded default as whole ``python -m kdsweep`` processes: on the CPU (the reference, run
   alongside), on the GPU in fp32 (objective within 1e-3 relative of the CPU's), with bf16 weights
   (``train.dtype=bf16``: bf16 compute, fp32 master weights; within 2%), with activation checkpointing, with ``dist.compile=true`` (the first
   step's extra time is the compile) and with the ``dist=fsdp2_gpu_bf16`` preset as a one-GPU job takes it.
3. ``fsdp``: a one-rank NCCL process group and FSDP2 on the GPU (kdsweep's own sharding), in fp32 and with
   ``train.dtype=bf16`` (fp32 master shards, bf16 compute by FSDP2's mixed precision), against the unsharded model.
4. ``placement``: what ``dist.teacher_placement=auto`` decides on this device for the 8B teacher beside the 1B
   student (8 GPUs a node), and the 8B-shaped teacher's forward replicated against sharded by FSDP2 on one rank,
   with its collectives counted (``kdsweep.distributed.comm``).
5. ``precision``: a full fine-tune of the 1B-shaped student in ``train.dtype=bf16`` (fp32 master weights and AdamW
   state, autocast) and ``bf16_pure``: step time, peak memory, dtypes, and how many weights updates of 1e-5 moved.
6. ``real_shapes``: a Llama-3.1-8B-shaped teacher and a Llama-3.2-1B-shaped student (random weights, bf16,
   sequence 2048, vocabulary 128,256), LoRA rank 64 and full fine-tune, ``loss.impl`` chunked and fused: tokens/s,
   step time, peak memory and MFU of ``train_step``; and the loss alone (the output layer and the KD loss, forward
   and backward) of chunked vs fused: its peak memory and time. Each arm's peak beside what
   ``benchmarks/gpu/memory.py`` (the README's memory table) predicts for it.
7. ``packed``: packed trials (``benchmarks/gpu/packed.py``): K = 1, 2, 4, 8 LoRA students over one frozen
   1B-shaped base with the 8B-shaped teacher, one teacher forward per micro-batch for all of them: the step time
   per member against K=1's beside the sharing bound, peak memory per K beside the memory plan, and the largest K the
   plan fits on this device.
8. ``max_micro_batch``: the largest micro-batch that fits, chunked vs fused (LoRA).
9. ``teacher_cache``: the cache's build throughput (teacher tokens/s) with the 8B teacher, and a cached LoRA
   trial's step time on the same shapes.

FLOPs (stated in the JSON): a linear layer costs 2 FLOPs per weight per token forward; attention 4 × layers × seq
× hidden per token forward (scores and values over the full row: the PaLM/Megatron convention; a causal kernel does
about half, so ``mfu_causal`` is given too). Teacher: forward only. Student: forward + backward, where backward is 2×
forward for a full fine-tune and, with LoRA, 1× forward for the frozen weights (input gradients only) plus 2× for the
adapters and attention. Embedding lookups cost nothing. Activation checkpointing's recomputation is not counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from budget import Budget, Skip  # noqa: E402
import fsdp_check  # noqa: E402  (benchmarks/gpu/fsdp_check.py: one rank, sharded)
import packed  # noqa: E402  (benchmarks/gpu/packed.py: K students over one base and one teacher pass)
import processes  # noqa: E402  (benchmarks/gpu/processes.py: the whole-process checks)
import shapes  # noqa: E402  (benchmarks/gpu/shapes.py: the in-process model checks)

TOTAL_S = 480.0
BUDGETS = {"peak_matmul": 20, "embedded": 200, "fsdp": 40, "placement": 30, "precision": 30, "real_shapes": 110,
           "packed": 60, "max_micro_batch": 45, "teacher_cache": 40}
DRY_SLACK = 3.0
"""The dry run's budgets are the GPU run's times this: it checks code paths on two shared CPU cores (all embedded
arms at once, beside other tests), where a budget sized for the GPU measures only how busy the machine is."""


class Report:
    """The results, rewritten to every ``paths`` after each check."""

    def __init__(self, paths: list[Path], meta: dict[str, Any], slack: float = 1.0) -> None:
        self.paths, self.data, self.slack = paths, {"meta": meta, "checks": {}}, slack
        self.started = time.monotonic()
        self.deadline = self.started + TOTAL_S * slack

    def run(self, name: str, check: Callable[[Budget], dict[str, Any]]) -> None:
        t0 = time.monotonic()
        budget = BUDGETS[name] * self.slack
        print(f"== {name} (budget {budget:.0f} s, {self.deadline - t0:.0f} s left in all)", flush=True)
        try:
            if self.deadline - t0 < 5:
                raise Skip(f"the run's {TOTAL_S * self.slack / 60:.0f} minutes are spent")
            result = {"status": "ok", **check(Budget(budget, self.deadline))}
        except Skip as e:
            result = {"status": f"skipped: {e}"}
        except Exception as e:  # one broken check must not cost the others
            traceback.print_exc()
            result = {"status": f"failed: {type(e).__name__}: {str(e)[:500]}"}
        result["seconds"] = round(time.monotonic() - t0, 1)
        self.data["checks"][name] = result
        self.data["meta"]["total_s"] = round(time.monotonic() - self.started, 1)
        self.save()
        print(f"   {name}: {result['status']} in {result['seconds']} s", flush=True)

    def save(self) -> None:
        text = json.dumps(self.data, indent=1, default=str)
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)


def table(data: dict[str, Any]) -> str:
    """The figures a reader looks for, one line each."""
    lines = [f"{'check':<16} {'status':<10} {'figures'}"]
    for name, r in data["checks"].items():
        status = r["status"] if r["status"] == "ok" else r["status"][:60]
        lines.append(f"{name:<16} {status:<10} {r.get('summary', '')}")
        for row in r.get("rows", []):
            lines.append(f"{'':<16} {'':<10} {row}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the same checks on the CPU with tiny shapes")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu.json")
    ap.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = ap.parse_args()

    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --dry-run")
    device = torch.device("cpu" if dry else "cuda")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "dry_run": dry,
            "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "flops_convention": __doc__.split("FLOPs (stated in the JSON): ")[1].strip()}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    paths = [args.out] + ([Path(os.environ["OUT"]) / "gpu.json"] if os.environ.get("OUT") else [])
    report = Report(paths, meta, DRY_SLACK if dry else 1.0)
    work = Path(os.environ.get("GPU_CHECK_WORK") or (REPO / "artifacts" / "gpu_check"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = shapes.TINY if dry else shapes.REAL
    peak: dict[str, float] = {}

    def peak_matmul(budget: Budget) -> dict[str, Any]:
        r = shapes.peak_matmul(device, budget)
        peak["flops"] = r["flops_per_s"]
        return r

    checks: dict[str, Callable[[Budget], dict[str, Any]]] = {
        "peak_matmul": peak_matmul,
        "embedded": lambda b: processes.embedded(work, dry, b),
        "fsdp": lambda b: fsdp_check.fsdp(device, b),
        "placement": lambda b: fsdp_check.placement(sizes, device, b),
        "precision": lambda b: shapes.precision(sizes, device, b),
        "real_shapes": lambda b: shapes.real_shapes(sizes, device, peak.get("flops"), b),
        "packed": lambda b: packed.packed(sizes, device, b),
        "max_micro_batch": lambda b: shapes.max_micro_batch(sizes, device, b),
        "teacher_cache": lambda b: shapes.teacher_cache(sizes, device, work, b),
    }
    for name, check in checks.items():
        if args.only is None or name in args.only:
            report.run(name, check)
    print(table(report.data), flush=True)
    print(f"results: {', '.join(map(str, paths))}", flush=True)
    failed = [n for n, r in report.data["checks"].items() if r["status"].startswith("failed")]
    if dry and failed:
        raise SystemExit(f"dry run: {', '.join(failed)} failed")


if __name__ == "__main__":
    main()
