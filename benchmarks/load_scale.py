"""Each rank's host memory and time while a job's ranks load a teacher of more than 1 GB.

Two layouts, as a job's ranks load a sharded teacher (``load_teacher``, gloo ranks on this machine):

- ``node``: 4 ranks on 2 simulated nodes (ranks 0-1 and 2-3), the teacher sharded within each node: a rank's share is
  half the teacher;
- ``world``: 2 ranks, the teacher sharded over both: half the teacher.

Each rank samples its own ``RssAnon`` and ``RssFile`` every 5 ms from just before the load to just after it. It
reports its anonymous peak above what it held before the load (the process's own: interpreter, torch, the
process group), and that over its share (the bytes of the tensors it keeps), and the same for its whole resident
peak (anonymous and the file pages it has mapped: a memory-mapped file's pages are the page cache's, dropped under
pressure, but they count in a job's RSS).

The teacher: a Llama of ``--hidden``/``--layers``/``--vocab`` (default 2048/10/32000: 581M parameters, 1.16 GB in
bf16 files of at most 400 MB, as a hub checkpoint comes in several), built and saved once under ``--work``, held in
fp32 (``train.dtype=fp32``'s frozen dtype): 2.3 GB whole, 1.16 GB a rank's share.

    python benchmarks/load_scale.py [--layouts node world] [--out benchmarks/results/load_scale.json]

Run it at another commit (a worktree) with ``--repo <worktree>`` to compare.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"node": (4, 2), "world": (2, 2)}
"""layout -> (ranks, ranks per simulated node)."""


def build_teacher(work: Path, hidden: int, layers: int, vocab: int) -> Path:
    out = work / f"llama_{hidden}x{layers}_{vocab}"
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=2048, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="400MB")
    return out


def _status() -> dict[str, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


class Sampler:
    """This process's anonymous and file-backed resident peaks, sampled every 5 ms while it runs."""

    def __init__(self) -> None:
        self.peak, self.stop = _status(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            now = _status()
            self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def done(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join()
        return self.peak


def rank_main() -> None:
    """One rank (started by :func:`layout`): load the teacher, print its numbers as one JSON line."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=600))
    from kdsweep.config import DistConfig
    from kdsweep.distributed import detect
    from kdsweep.models.load import load_teacher

    env, placement = detect(), os.environ["BENCH_PLACEMENT"]
    dist.barrier()
    before = _status()
    sampler, t0 = Sampler(), time.perf_counter()
    model = load_teacher(Path(os.environ["BENCH_TEACHER"]), "fp32", torch.device("cpu"), env,
                         DistConfig(teacher_placement=placement))
    seconds, peak = time.perf_counter() - t0, sampler.done()
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    share = sum(t.numel() * t.element_size() for t in local)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    anon = peak["RssAnon"] - before["RssAnon"]
    rss = peak["RssAnon"] + peak["RssFile"] - before["RssAnon"] - before["RssFile"]
    print("RESULT " + json.dumps({
        "rank": env.rank, "node": env.node, "load_s": round(seconds, 2), "share_mb": round(share / 1e6, 1),
        "whole_mb": round(whole / 1e6, 1), "own_anon_mb": round(before["RssAnon"] / 1e6, 1),
        "anon_above_own_mb": round(anon / 1e6, 1), "anon_over_share": round(anon / share, 3),
        "rss_above_own_mb": round(rss / 1e6, 1), "rss_over_share": round(rss / share, 3),
    }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def layout(name: str, teacher: Path, repo: Path) -> list[dict]:
    """The ranks of one layout, each a process of its own (as torchrun starts them), and their JSON lines."""
    ranks, per_node = LAYOUTS[name]
    port = str(29600 + os.getpid() % 300)
    env = {**os.environ, "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "KDSWEEP_LOCAL_RANKS": "1", "KDSWEEP_TEST_RANKS_PER_NODE": str(per_node),
           "BENCH_TEACHER": str(teacher), "BENCH_PLACEMENT": name, "PYTHONPATH": str(repo),
           "KDSWEEP_CACHE": tempfile.mkdtemp(prefix="load-scale-")}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank"], cwd=repo, stdout=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r % per_node)}) for r in range(ranks)]
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"a rank of {name} failed (exit {p.returncode})")
        rows += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    if "--rank" in sys.argv:
        return rank_main()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kdsweep-load-scale")
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose kdsweep loads (default: this one)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/load_scale.json")
    args = ap.parse_args()
    teacher = build_teacher(args.work, args.hidden, args.layers, args.vocab)
    files = sorted(teacher.glob("*.safetensors"))
    commit = subprocess.run(["git", "-C", str(args.repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"commit": commit, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {os.cpu_count()} CPUs", "teacher": str(teacher.name),
              "teacher_file_mb": round(sum(f.stat().st_size for f in files) / 1e6, 1), "files": len(files),
              "layouts": {}}
    for name in args.layouts:
        rows = layout(name, teacher, args.repo)
        result["layouts"][name] = rows
        for r in rows:
            print(f"{commit} {name:>5} rank {r['rank']} (node {r['node']}): share {r['share_mb']:7.1f} MB  "
                  f"anonymous +{r['anon_above_own_mb']:7.1f} MB = {r['anon_over_share']:.2f}x share  "
                  f"resident +{r['rss_above_own_mb']:7.1f} MB = {r['rss_over_share']:.2f}x  load {r['load_s']:.1f} s",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
