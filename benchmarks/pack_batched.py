"""Would a pack gain by running its members' student passes as one batch? Measured before building it.

A pack's members step one after another: each runs the shared frozen base and its own LoRA adapter over the same
micro-batch (:mod:`kdsweep.pack.members`). The alternative is one forward over the K members' copies of the
micro-batch stacked (K·B rows): each LoRA layer runs its frozen base once over all rows and each member's low-rank
term over its own rows, and one backward. Its gradients are every member's alone (checked here, to the bit); what
could change is the time, and the memory (K members' activations at once instead of one's).

This prototypes the batched pass in the benchmark (peft LoRA layers' forwards swapped for the duration, as the
fused loss swaps the output layer's) and times, for K = 2, 4, 8 members built by
:func:`kdsweep.pack.students_over_one_base`, a member-by-member forward and backward against the batched one, with a
log-softmax loss over the logits standing in for the KD loss (the loss is per member either way): medians of
``--repeats`` interleaved rounds of ``--iters`` passes, per pair (the embedded default, ``step_time.py``'s
512-vocabulary pair). Saved to ``benchmarks/results/pack_batched.json``.

    python benchmarks/pack_batched.py [--pairs embedded vocab512] [--ks 2 4 8] [--repeats 5] [--iters 10]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import pair_overrides  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def pair(name: str, work: Path):
    """The student's config as the pack benchmark trains it (LoRA r8, no dropout): its model, micro-batch and length."""
    from pack import configs

    return configs([[*pair_overrides(name, work), "lora_rank=8", "model.lora_dropout=0"]], work / "batched")[0]


def members(cfg, k: int) -> list[torch.nn.Module]:
    from kdsweep.models.load import resolve_dir
    from kdsweep.pack import students_over_one_base

    students = students_over_one_base(resolve_dir(cfg.model), [cfg.model] * k, "fp32", torch.device("cpu"), seed=0)
    for i, s in enumerate(students):  # members with different adapters, as a pack's after a few steps
        torch.manual_seed(i)
        for p in s.parameters():
            if p.requires_grad:
                p.data.normal_(0, 0.02)
        s.train()
    return students


def loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1).mean()


def one_by_one(students, x) -> None:
    for s in students:
        loss(s(input_ids=x, use_cache=False).logits).backward()


@contextlib.contextmanager
def stacked(students):
    """The first member's model runs all members' rows: each of its LoRA layers computes the shared base over every
    row and each member's low-rank term over that member's rows (peft's own arithmetic for a plain adapter)."""
    from peft.tuners.lora import Linear as LoraLinear

    names = [n for n, m in students[0].named_modules() if isinstance(m, LoraLinear)]
    with contextlib.ExitStack() as swaps:
        for name in names:
            layers = [s.get_submodule(name) for s in students]

            def forward(h, *args, layers=layers, **kwargs):
                out = layers[0].base_layer(h, *args, **kwargs)
                low = [m.lora_B["default"](m.lora_A["default"](part)) * m.scaling["default"]
                       for part, m in zip(h.chunk(len(layers)), layers)]
                return (out + torch.cat(low)).to(out.dtype)

            layers[0].forward = forward
            swaps.callback(delattr, layers[0], "forward")
        yield students[0]


def batched(students, x) -> None:
    with stacked(students) as model:
        logits = model(input_ids=x.repeat(len(students), 1), use_cache=False).logits
        sum(loss(part) for part in logits.chunk(len(students))).backward()


def grads(students) -> list[torch.Tensor]:
    out = [p.grad.clone() for s in students for p in s.parameters() if p.requires_grad]
    for s in students:
        s.zero_grad(set_to_none=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", nargs="+", default=["embedded", "vocab512"], choices=["embedded", "vocab512"])
    ap.add_argument("--ks", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--work", type=Path, default=Path("/tmp/kdsweep-pack-bench"))
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "pack_batched.json")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KDSWEEP_BENCH_THREADS", "2")))
    table: dict[str, dict] = {}
    for name in args.pairs:
        cfg = pair(name, args.work)
        rows, seq = cfg.data.micro_batch_size, cfg.data.seq_len
        for k in args.ks:
            students = members(cfg, k)
            x = torch.randint(0, students[0].config.vocab_size, (rows, seq))
            one_by_one(students, x)
            alone = grads(students)
            batched(students, x)
            diff = max((a - b).abs().max().item() for a, b in zip(alone, grads(students)))
            times: dict[str, list[float]] = {"one_by_one": [], "batched": []}
            for r in range(args.repeats):
                for arm in (("one_by_one", "batched") if r % 2 == 0 else ("batched", "one_by_one")):
                    run = one_by_one if arm == "one_by_one" else batched
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        run(students, x)
                    times[arm].append((time.perf_counter() - t0) / args.iters)
                    grads(students)
            med = {arm: statistics.median(v) for arm, v in times.items()}
            table[f"{name}/K{k}"] = {"rows": rows, "seq": seq, "one_by_one_ms": med["one_by_one"] * 1e3,
                                     "batched_ms": med["batched"] * 1e3,
                                     "batched_over_one_by_one": med["batched"] / med["one_by_one"],
                                     "max_grad_diff": diff, "runs_ms": {a: [t * 1e3 for t in v] for a, v in times.items()}}
            print(f"{name:9s} K={k}: one by one {med['one_by_one'] * 1e3:7.1f} ms, batched {med['batched'] * 1e3:7.1f}"
                  f" ms ({med['batched'] / med['one_by_one']:.2f}x), grads differ by {diff:.1e}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
        "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "command": " ".join(sys.argv), "table": table},
        indent=1))


if __name__ == "__main__":
    main()
