"""How many pieces the plain graph's loss should be cut into on a CPU (``kdsweep.train.chunks.pieces_for``).

The loss of a micro-batch that fits one chunk runs as one graph, but on a CPU its elementwise passes run piece by
piece (:func:`kdsweep.losses.kd_loss_sums` with ``num_chunks`` pieces, ``once=True`` as the step runs it). Too few
pieces and the passes run over tensors larger than the CPU's caches; too many and each piece's Python and autograd
overhead shows. This times the loss's forward and backward (CE + forward KL from a ``sample`` cache's k=12 draws,
the targets a cached trial reads) on ``[--tokens, V]`` fp32 logits, for each piece count, at the vocabularies of
``benchmarks/step_time.py``'s pairs (512 and the embedded 2,052). The piece counts are interleaved inside each
process (what a process's placement costs is the same for all of them: between processes on a shared 2-core machine
it varies by up to 2x), ``--processes`` processes each; reported per vocabulary: the median over processes of each
count's median time, and its ratio to the fastest count's.

    python benchmarks/loss_pieces.py [--vocabs 512 2052] [--tokens 1024] [--pieces 1 2 3 4 5 6 8]
                                     [--processes 3] [--rounds 12] [--out benchmarks/results/loss_pieces.json]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_process(vocab: int, tokens: int, pieces: list[int], rounds: int) -> dict[int, float]:
    """Each piece count's median seconds for one loss forward + backward, interleaved, in this process."""
    import torch

    from kdsweep.losses import kd_loss_sums
    from kdsweep.losses.targets import Samples

    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,))
    targets = Samples(ids=torch.randint(0, vocab, (tokens, 12), dtype=torch.int32), label_logp=-torch.rand(tokens),
                      temperature=1.0, vocab=vocab, entropy=torch.rand(tokens))
    logits = torch.randn(tokens, vocab)

    def step(p: int) -> None:
        x = logits.clone().requires_grad_()
        kd_loss_sums(x, targets, labels, num_chunks=p, once=True).total(0.5).backward()

    times: dict[int, list[float]] = {p: [] for p in pieces}
    for _ in range(rounds):
        for p in pieces:
            for _ in range(5):
                step(p)
            t0 = time.perf_counter()
            for _ in range(40):
                step(p)
            times[p].append((time.perf_counter() - t0) / 40)
    return {p: statistics.median(ts) for p, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", nargs="+", type=int, default=[512, 2052])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--pieces", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "loss_pieces.json")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(one_process(spec["vocab"], spec["tokens"], spec["pieces"], spec["rounds"])))
        return
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "tokens": args.tokens, "rounds": args.rounds,
              "command": "python benchmarks/loss_pieces.py " + " ".join(sys.argv[1:]), "vocabs": {}}
    for vocab in args.vocabs:
        runs = []
        for _ in range(args.processes):
            spec = json.dumps({"vocab": vocab, "tokens": args.tokens, "pieces": args.pieces, "rounds": args.rounds})
            done = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
            runs.append({int(p): t for p, t in json.loads(done.stdout.strip().splitlines()[-1]).items()})
        med = {p: statistics.median(r[p] for r in runs) for p in args.pieces}
        best = min(med.values())
        result["vocabs"][str(vocab)] = {"ms": {p: t * 1e3 for p, t in med.items()},
                                        "over_fastest": {p: t / best for p, t in med.items()},
                                        "per_process_ms": [{p: t * 1e3 for p, t in r.items()} for r in runs]}
        print(f"V={vocab}, {args.tokens} tokens: " + "  ".join(f"{p}: {t * 1e3:.2f} ms ({t / best:.2f})"
                                                               for p, t in med.items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
