"""The ``kdsweep`` console script: ``kdsweep [overrides]`` is ``python -m kdsweep``; plus the sweep subcommands.

    kdsweep status <sweep dir>     the trials of a sweep: state, objective, params, best marked; what it cost
    kdsweep resume <sweep dir>     continue a sweep after its controller died (same command, same directory)
    kdsweep logs <sweep dir> <trial> [--rank N]   a trial's log (its job's output, or rank N's own log)
    kdsweep dashboard <sweep dir> [--host H] [--port P]   the study in optuna-dashboard (a database password:
                                   set KDSWEEP_STORAGE_URL to the full URL)
    kdsweep export <sweep or run dir> [--best | --trial N | --confirmed] [--out DIR]   the trained student as one
                                   ships it: merged model and tokenizer, adapter, model card
    kdsweep prepare [--dry-run] <the sweep's overrides>   tokenize the data and build every teacher cache the sweep's
                                   trials will read (sizes first), before the sweep
    kdsweep eval <model, run or sweep dir> ... [--tasks T,...]   downstream tasks through lm-evaluation-harness: the
                                   students beside CE-only and the undistilled base, one table
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SUBCOMMANDS = ("status", "resume", "logs", "dashboard", "export", "eval", "prepare")


def _sweep_dir(args: list[str], command: str) -> Path:
    if len(args) != 1:
        raise SystemExit(f"usage: kdsweep {command} <sweep dir>")
    return Path(args[0]).resolve()


def status(args: list[str]) -> None:
    from kdsweep.sweep.budget import budget_lines
    from kdsweep.sweep.controller import summary_lines
    from kdsweep.sweep.cost import cache_lines, cost_lines, sweep_cost
    from kdsweep.sweep.manifest import Manifest
    from kdsweep.sweep.workers import worker_lines

    manifest = Manifest.load(_sweep_dir(args, "status"))
    settings = manifest.settings
    limit = f" of {settings.trial_limit:g}" if settings.trial_limit != float("inf") else ""
    search = sum(not e.get("confirm") for e in manifest.trials.values())
    confirming = len(manifest.trials) - search
    plan = manifest.data.get("confirmation")
    confirmed = f", {confirming} of {len(plan['items'])} confirmation trials" if plan else ""
    print(f"sweep {manifest.path.parent} (study {manifest.data['study_name']}, {search}{limit} search trials"
          f"{confirmed}, storage {settings.storage or (manifest.data.get('storage') or {}).get('why', 'SQLite')})")
    print("\n".join([*summary_lines(manifest), *worker_lines(manifest.path.parent), *cost_lines(sweep_cost(manifest)),
                     *budget_lines(manifest), *cache_lines(manifest)]))


def resume(args: list[str]) -> None:
    """Re-run the sweep's own command on its directory: the controller picks up where the last one stopped."""
    from kdsweep.sweep.manifest import Manifest

    sweep_dir = _sweep_dir(args, "resume")
    command = [a for a in Manifest.load(sweep_dir).data.get("command", []) if not a.startswith("hydra.sweep.dir=")]
    argv = [sys.executable, "-m", "kdsweep", *command, f"hydra.sweep.dir={sweep_dir}"]
    print("resuming:", " ".join(argv[1:]), flush=True)
    os.execv(sys.executable, argv)


def logs(args: list[str]) -> None:
    import argparse

    from kdsweep.config.schema import ConfigError
    from kdsweep.sweep.manifest import Manifest

    parser = argparse.ArgumentParser(prog="kdsweep logs")
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("trial", type=int)
    parser.add_argument("--rank", type=int, default=None, help="a rank's own log (rank 0: kdsweep.log)")
    ns = parser.parse_args(args)
    trials = Manifest.load(ns.sweep_dir.resolve()).trials
    if str(ns.trial) not in trials:
        raise ConfigError(f"trial {ns.trial} is not in {ns.sweep_dir} "
                          f"(trials: {', '.join(sorted(trials, key=int)) or 'none'})")
    entry = trials[str(ns.trial)]
    run_dir = Path(entry["run_dir"])
    if ns.rank is None:  # the job's own output: job.log of a local process, submitit's stdout and stderr on SLURM
        paths = [Path(p) for p in (entry.get("job") or {}).get("logs", [run_dir / "job.log"])]
    else:
        paths = [run_dir / "kdsweep.log" if ns.rank == 0 else run_dir / "logs" / f"rank{ns.rank}.log"]
    missing = [p for p in paths if not p.exists()]
    if missing:
        raise ConfigError(f"{missing[0]} does not exist (has trial {ns.trial} started; did it have rank {ns.rank}?)")
    for path in paths:
        if len(paths) > 1:
            sys.stdout.write(f"==> {path} <==\n")
        sys.stdout.write(path.read_text(errors="replace"))


def dashboard(args: list[str]) -> None:
    import argparse

    from kdsweep.sweep.dashboard import serve

    parser = argparse.ArgumentParser(prog="kdsweep dashboard",
                                     description="Serve the sweep's study in optuna-dashboard.")
    parser.add_argument("sweep_dir", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    ns = parser.parse_args(args)
    serve(ns.sweep_dir.resolve(), ns.host, ns.port)


def export(args: list[str]) -> None:
    import argparse

    from kdsweep.checkpoint.package import export_runs

    parser = argparse.ArgumentParser(prog="kdsweep export", description="Export a finished run's student: the merged "
                                     "model with its tokenizer, the adapter, and a model card.")
    parser.add_argument("path", type=Path, help="a sweep directory (sweep.json) or a run directory (run.json)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true", help="the sweep's best (the point its verdict reports; default)")
    which.add_argument("--trial", type=int, default=None, help="the sweep's trial N")
    which.add_argument("--confirmed", action="store_true", help="every seed of the sweep's confirmed point")
    parser.add_argument("--out", type=Path, default=None, help="where (default: <path>/export/<name>)")
    ns = parser.parse_args(args)
    for target in export_runs(ns.path.resolve(), ns.out, ns.trial, ns.confirmed):
        print(f"{target}: merged/ (AutoModelForCausalLM, AutoTokenizer), README.md", flush=True)


def prepare(args: list[str]) -> None:
    from kdsweep.prepare import main as build

    build(args)


def evaluate(args: list[str]) -> None:
    from kdsweep.evaluation.report import main as report

    report(args)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] in SUBCOMMANDS:
        from kdsweep.config.schema import ConfigError

        try:
            {"status": status, "resume": resume, "logs": logs, "dashboard": dashboard, "export": export,
             "eval": evaluate, "prepare": prepare}[args[0]](args[1:])
        except ConfigError as e:
            print(f"kdsweep: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    from kdsweep.app import main as app_main

    app_main()


__all__ = ["main"]
