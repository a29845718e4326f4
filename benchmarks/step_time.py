"""The KD step's time against an earlier commit and against a plain CE step of the same student: whole jobs (CPU).

Two teacher → student pairs:

- ``embedded``: the default job (the zoo's tiny teacher and student, vocabulary 2,052, 2 × 8 × 128 tokens a step);
- ``vocab512``: a tiny random-init HF Llama teacher (4 layers, hidden 128) and student (2 layers, hidden 64), both
  4 heads and 2 KV heads, vocabulary 512 (a BPE tokenizer trained here on the embedded corpus), 4 × 256 tokens a
  step in one micro-batch, LoRA r8 on q/k/v/o, alpha 16, dropout 0: the peer frameworks' tiny-Llama KD run.

Arms, each one ``python -m kdsweep`` job of ``--steps`` steps (evaluations, checkpoints and exports off):
``live`` and ``cache`` (``teacher.logits=cache``, ``sample`` k=12) with the default ``loss.impl``, and both with
``loss.impl=chunked``; each runs on this tree and, with ``--base REV``, on that commit (its worktree and venv under
``$AB_ROOT``, default ``/tmp/kdsweep-ab``, shared with ``../shared/tools/ab_step.sh``). Every job's step is paired, in
its own process, with the plain step of a twin of its student (:func:`paired_run`: the same LoRA, ``F.cross_entropy``
on its full logits, one backward per micro-batch, an AdamW of its own, the same micro-batches): the least a step of
this student can cost, the limit a cached step (the same plus reading its targets) is held to; and a yardstick that
runs the same code on both sides (the same torch, transformers and peft), so that the CPU's speed, which differs from
one process to the next by ±10% on this VM, cancels in the step's ratio to it. A first, unmeasured run of every arm
builds what it caches; then ``--repeats`` interleaved rounds (every arm of every side in turn, the sides' order
reversed every other round). Reported per arm and side: the medians over rounds of each job's median step (after
its first 5), of its twin's, and of their step-by-step ratio; head/base of the steps and of the ratios (the
second cancels the process-to-process noise); and, with ``--profile``, ``run_backward`` calls per micro-batch in a
cProfile of ``--profile`` cached steps.

    python benchmarks/step_time.py [--base 039b9d0] [--repeats 5] [--steps 60] [--pairs embedded vocab512]
                                   [--profile 120] [--work DIR] [--out benchmarks/results/step_time.json]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["train.eval_every=100000", "train.log_every=1", "checkpoint.save_every=0", "checkpoint.export_adapter=false",
          "checkpoint.export_merged=false", "logger.progress_bar=false"]
ARMS = {"live": [], "live_chunked": ["loss.impl=chunked"], "cache": ["teacher.logits=cache"],
        "cache_chunked": ["teacher.logits=cache", "loss.impl=chunked"]}
VOCAB512 = {"vocab": 512, "seq": 256, "batch": 4, "micro": 4,
            "teacher": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4),
            "student": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2)}
SKIP = 5  # the first steps of a job (allocator warm-up, the first read of the cache) are not its pace


def build_vocab512(work: Path) -> Path:
    """The 512-vocabulary pair, in HF format with its tokenizer, once."""
    models = work / "vocab512"
    if (models / "done").exists():
        return models
    import torch
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from kdsweep.data.text import embedded_corpus

    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB512["vocab"], special_tokens=list(special.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(embedded_corpus(eval_fraction=0.05, split_seed=1234).train, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, **special)
    for seed, name in enumerate(("teacher", "student")):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer), num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512, tie_word_embeddings=False, use_cache=False,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, **VOCAB512[name])
        LlamaForCausalLM(config).save_pretrained(models / name)
        tokenizer.save_pretrained(models / name)
    (models / "done").write_text("")
    return models


def pair_overrides(pair: str, work: Path) -> list[str]:
    if pair == "embedded":
        return []
    m, v = build_vocab512(work), VOCAB512
    return [f"model.path={m / 'student'}", f"teacher.path={m / 'teacher'}", "lora_rank=8", "model.lora_alpha=16",
            "model.lora_dropout=0", "model.target_modules=[q_proj,k_proj,v_proj,o_proj]", f"data.seq_len={v['seq']}",
            f"data.batch_size={v['batch']}", f"data.micro_batch_size={v['micro']}",
            f"data.eval_batch_size={v['batch']}"]


def base_python(rev: str) -> tuple[Path, Path]:
    """The python of a worktree of ``rev`` with its own venv (made once, as ab_step.sh makes it), and its cache."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(os.environ.get("AB_ROOT", Path(tempfile.gettempdir()) / "kdsweep-ab")) / f"tree-{sha}"
    if not (tree / ".ab-ok").exists():
        subprocess.run(["rm", "-rf", str(tree)], check=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
        subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
        pip = str(tree / ".venv" / "bin" / "pip")
        subprocess.run([pip, "install", "-q", "torch==2.13.0"], check=True)
        subprocess.run([pip, "install", "-q", "-e", str(tree)], check=True)
        (tree / ".ab-ok").write_text("")
    return tree / ".venv" / "bin" / "python", tree / ".ab-cache"


def median_step_s(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median([r["step_s"] for r in rows if r.get("kind") == "train"][SKIP:])


def kdsweep_job(python: Path, cache: Path, overrides: list[str], run_dir: Path, profile: Path | None = None) -> float:
    env = {**os.environ, "KDSWEEP_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{run_dir}.log", "w") as log:
        done = subprocess.run([str(python), *prof, "-m", "kdsweep", *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir.parent)
    if done.returncode:
        raise SystemExit(f"{run_dir.name} failed: {Path(f'{run_dir}.log').read_text().strip().splitlines()[-1]}")
    return median_step_s(run_dir)


def paired_run(argv: list[str], out: Path) -> None:
    """The ``limit`` arm's job (run in its own process by :func:`paired_job`): ``python -m kdsweep`` with ``argv``,
    whose every step is paired with a plain step of a twin of its student, in the same process and on the same
    micro-batches. The twin is a copy of the student as the job built it (the same LoRA, the same frozen base) with
    an AdamW of its own; its step is ``F.cross_entropy`` on the full logits of each micro-batch, one backward each,
    the optimizer's step: the least a step of this student can cost. The job's ``train_step`` and the twin's step
    alternate which runs first; both are timed from the micro-batches to the optimizer's step, and each step's pair
    of seconds is written to ``out``. In one process both see the same machine: the CPU's speed that differs from
    one process to the next (±10% on this VM, the same code) cancels in their ratio."""
    import copy

    import torch
    import torch.nn.functional as F

    import kdsweep.train.loop as loop
    from kdsweep.cli import main as kdsweep_main

    real, pairs, twin = loop.train_step, [], {}

    def plain(micro) -> None:
        model, opt = twin["model"], twin["opt"]
        for batch in micro:
            logits = model(**batch.inputs()).logits
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def paired(*args, **kw):  # train_step([learner], micro, ...) here; (student, teacher, micro, optimizer, ...)
        learner = args[0][0] if isinstance(args[0], list) else None  # before 5ab52e8 (a base commit's)
        micro = args[1] if learner else args[2]
        if not twin:
            student, optimizer = (learner.student, learner.optimizer) if learner else (args[0], args[3])
            twin["model"] = copy.deepcopy(student)
            twin["opt"] = torch.optim.AdamW([p for p in twin["model"].parameters() if p.requires_grad],
                                            lr=optimizer.param_groups[0]["lr"])
        t0 = time.perf_counter()
        if len(pairs) % 2:
            plain(micro)
        t1 = time.perf_counter()
        stats = real(*args, **kw)
        t2 = time.perf_counter()
        if not len(pairs) % 2:
            plain(micro)
        t3 = time.perf_counter()
        pairs.append({"step_s": t2 - t1, "limit_s": (t1 - t0) + (t3 - t2)})
        return stats

    loop.train_step = paired
    sys.argv = ["kdsweep", *argv]
    try:
        kdsweep_main()
    except SystemExit as e:
        if e.code:
            raise
    out.write_text(json.dumps(pairs))


def paired_job(python: Path, cache: Path, overrides: list[str], run_dir: Path) -> dict[str, float]:
    """:func:`paired_run` of a job in a fresh process: the medians (after the first :data:`SKIP` steps) of its own
    step, of the twin's plain step, and of their ratio step by step."""
    out = Path(f"{run_dir}.pairs.json")
    env = {**os.environ, "KDSWEEP_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [*COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    with open(f"{run_dir}.log", "w") as log:
        done = subprocess.run([str(python), __file__, "--paired-run", json.dumps({"argv": argv, "out": str(out)})],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=run_dir.parent)
    if done.returncode:
        raise SystemExit(f"{run_dir.name} failed: {Path(f'{run_dir}.log').read_text().strip().splitlines()[-1]}")
    rows = json.loads(out.read_text())[SKIP:]
    return {"step_s": statistics.median(r["step_s"] for r in rows),
            "limit_s": statistics.median(r["limit_s"] for r in rows),
            "ratio": statistics.median(r["step_s"] / r["limit_s"] for r in rows)}


def backward_calls(profile: Path, steps: int, micro: int) -> dict[str, float]:
    stats = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    backward = "<method 'run_backward' of 'torch._C._EngineBase' objects>"
    calls = sum(v[1] for (_, _, name), v in stats.items() if name == backward)
    return {"run_backward_calls": calls, "steps": steps, "micro_batches": steps * micro,
            "per_micro_batch": calls / (steps * micro)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="an earlier commit to compare with (its own worktree and venv)")
    ap.add_argument("--pairs", nargs="+", default=["embedded", "vocab512"], choices=["embedded", "vocab512"])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--profile", type=int, default=120, help="cached steps profiled with cProfile (0: none)")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kdsweep-step-time")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_time.json")
    ap.add_argument("--paired-run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.paired_run:
        spec = json.loads(args.paired_run)
        return paired_run(spec["argv"], Path(spec["out"]))
    head = (Path(os.environ.get("AB_PY", REPO / ".venv" / "bin" / "python")), args.work / "cache-head")
    sides = {"head": head, **({"base": base_python(args.base)} if args.base else {})}
    steps = [f"train.max_steps={args.steps}"]
    jobs = [(pair, arm, side) for pair in args.pairs for arm in args.arms for side in sides]
    runs = args.work / "runs" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for pair, arm, side in jobs:  # builds the zoo, the tokenization and the teacher caches: not measured
        python, cache = sides[side]
        kdsweep_job(python, cache, [*steps, *pair_overrides(pair, args.work), *ARMS[arm]],
                    runs / f"warm-{pair}-{arm}-{side}")
    runs_of: dict[str, dict[str, dict[str, list[dict[str, float]]]]] = {p: {} for p in args.pairs}
    for r in range(args.repeats):
        for pair in args.pairs:
            for arm in args.arms:
                for side in list(sides) if r % 2 == 0 else list(reversed(sides)):  # ABBA: no side always first
                    run = runs / f"{pair}-{arm}-{side}-{r}"
                    got = paired_job(*sides[side], [*steps, *pair_overrides(pair, args.work), *ARMS[arm]], run)
                    runs_of[pair].setdefault(arm, {}).setdefault(side, []).append(got)
                    print(f"round {r}  {pair:<9} {arm:<14} {side:<5} {got['step_s'] * 1e3:8.1f} ms  "
                          f"twin {got['limit_s'] * 1e3:6.1f} ms  ratio {got['ratio']:.3f}", flush=True)
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "repeats": args.repeats, "steps": args.steps,
              "skip": SKIP, "base": args.base, "git_sha": sha.stdout.strip(),
              "command": "python benchmarks/step_time.py " + " ".join(sys.argv[1:]), "pairs": {}}
    for pair, arms in runs_of.items():
        med = {arm: {side: {k: statistics.median(j[k] for j in jobs) for k in ("step_s", "limit_s", "ratio")}
                     for side, jobs in by_side.items()} for arm, by_side in arms.items()}
        out: dict = {"median": med, "runs": arms,
                     "over_limit": {arm: m["head"]["ratio"] for arm, m in med.items()}}
        if args.base:
            out["head_over_base"] = {arm: m["head"]["step_s"] / m["base"]["step_s"] for arm, m in med.items()}
            out["head_over_base_paired"] = {arm: m["head"]["ratio"] / m["base"]["ratio"] for arm, m in med.items()}
        result["pairs"][pair] = out
    if args.profile:
        micro = {"embedded": 2, "vocab512": 1}
        for pair in args.pairs:
            prof = runs / f"profile-{pair}.prof"
            kdsweep_job(head[0], head[1], [f"train.max_steps={args.profile}", *pair_overrides(pair, args.work),
                                           *ARMS["cache"]], runs / f"profile-{pair}", profile=prof)
            result["pairs"][pair]["profile_cache"] = backward_calls(prof, args.profile, micro[pair])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for pair, out in result["pairs"].items():
        print(f"\n{pair}: medians over {args.repeats} interleaved rounds of each job's median step (ms), of its "
              f"twin's plain CE step, and of their ratio step by step")
        for arm, m in out["median"].items():
            cols = "  ".join(f"{side} {v['step_s'] * 1e3:6.1f} (twin {v['limit_s'] * 1e3:5.1f}, x{v['ratio']:.3f})"
                             for side, v in m.items())
            ratio = (f"  head/base {out['head_over_base'][arm]:.2f}, over the twins "
                     f"{out['head_over_base_paired'][arm]:.2f}") if "head_over_base" in out else ""
            print(f"  {arm:<14} {cols}{ratio}")
        if "profile_cache" in out:
            p = out["profile_cache"]
            print(f"  cProfile of {p['steps']} cached steps: {p['per_micro_batch']:.2f} run_backward per micro-batch")
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()
