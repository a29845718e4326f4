"""The Hydra application: DictConfig → typed RunConfig (once) → ``train.run`` → the float objective.

Nothing below this module sees Hydra or OmegaConf. torch is imported only once a job really runs, so
``python -m kdsweep --help`` and config validation stay fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from kdsweep.config import ConfigError, RunConfig, to_run_config
from kdsweep.config.convert import check_key
from kdsweep.config.schema import JobError, RanksFailed
from kdsweep.startup import import_frozen

log = logging.getLogger("kdsweep")


def conf_dir() -> str:
    """The config tree: inside the package when installed from a wheel, beside it in a checkout."""
    here = Path(__file__).resolve().parent
    packaged = here / "conf"
    return str(packaged if packaged.is_dir() else here.parent / "conf")


def fail(message: str, output_dir: str | None) -> None:
    """One line on stderr, exit code 2; remove the run directory if Hydra created it empty just now."""
    print(f"kdsweep: error: {message}", file=sys.stderr)
    _remove_if_empty(output_dir)
    raise SystemExit(2)


def resolve(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = e.full_key
        override = re.sub(r"\[(\d+)\]", r".\1", key)  # data.datasets[0].path is set as data.datasets.0.path=
        raise ConfigError(f"{key} is required but not set; pass {override}=<value> on the command line") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '') or 'config'}: {e.msg if hasattr(e, 'msg') else e}") from None


def validate(raw: dict[str, Any]) -> RunConfig:
    """Typed config + every check that needs no weights (paths, tokenizers, context length, data files)."""
    from kdsweep.data.check import preflight_data
    from kdsweep.models.check import choose_impl, preflight_models, preflight_targets

    cfg = to_run_config(raw)
    if cfg.loss.impl == "auto":  # chosen once, from the models' configs; run.json records the choice
        raw["loss"]["impl"] = choose_impl(cfg)
        cfg = to_run_config(raw)
    for _, view in cfg.teacher_views():  # each teacher with the student
        preflight_models(view, several=bool(cfg.teachers))
    preflight_targets(cfg)
    preflight_data(cfg)
    return cfg


def validate_composed(cfg: DictConfig, output_dir: str) -> RunConfig:
    """Validate a config composed for a job that has not started (a grid point, a corner of a search space)."""
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.pop("hydra", None)
    raw = resolve(cfg)
    raw["output_dir"] = output_dir
    return validate(raw)


def _setup_rank_logging(output_dir: str, rank: int) -> logging.Handler:
    """Rank 0 logs to the console and ``kdsweep.log``; other ranks only to ``logs/rank<r>.log``.

    Spawned ranks start with a bare logging module (Hydra configured only the launching process), so the
    level and rank 0's console handler are set here too.
    """
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    consoles = [h for h in root.handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    if rank == 0:
        path = Path(output_dir) / "kdsweep.log"
        if not consoles:
            console = logging.StreamHandler(sys.stderr)
            console.setFormatter(fmt)
            root.addHandler(console)
    else:
        path = Path(output_dir) / "logs" / f"rank{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        for h in consoles:
            h.setLevel(logging.ERROR)  # one console voice per job
    handler = logging.FileHandler(path)
    handler.setFormatter(fmt)
    root.addHandler(handler)
    return handler


class JobSession:
    """The process side of a job that runs one trial: it joins the job's process group for the job and leaves it
    after, and keeps nothing (a warm worker's session, ``kdsweep.worker.WorkerSession``, keeps both)."""

    @contextlib.contextmanager
    def joined(self, run_cfg: RunConfig) -> Iterator[Any]:
        from kdsweep.data.cache import kdsweep_cache
        from kdsweep.distributed import detect, device_for, process_group
        from kdsweep.distributed.rendezvous import agree_port, release_port

        env = agree_port(detect(), kdsweep_cache(), run_cfg.dist.timeout_s)
        with process_group(env, device_for(run_cfg.train.device, env), timeout_s=run_cfg.dist.timeout_s):
            release_port(env, kdsweep_cache())
            yield env

    def kept(self) -> Any:
        from kdsweep.train.kept import Kept

        return Kept.one_run()


SESSION: Any = JobSession()
"""This process's session: a job's, or the warm worker's once ``kdsweep.worker`` has set its own."""


def run_rank(run_cfg: RunConfig, raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """One rank of a job (all of it, for one rank): join the process group, train, return rank 0's summary."""
    import dataclasses

    import_frozen()  # a rank forked from its forkserver: what the server imported, frozen here

    from kdsweep.distributed import failure
    from kdsweep.distributed.rendezvous import check_shared
    from kdsweep.distributed.signals import PreemptionWatch
    from kdsweep.train import NULL_REPORTER, run

    watch = PreemptionWatch()
    with SESSION.joined(run_cfg) as env:
        reporter = NULL_REPORTER
        if run_cfg.trial.sweep_dir and env.is_main:  # rank 0 talks to the study; the loop shares its decision
            from kdsweep.sweep.handle import TrialHandle

            reporter = TrialHandle(run_cfg.trial.sweep_dir, run_cfg.trial.number)
        # Ranks started apart (torchrun) may have resolved ${now:...} to different directories: rank 0's wins.
        output_dir = env.broadcast_object(run_cfg.output_dir)
        if output_dir != run_cfg.output_dir:
            _remove_if_empty(run_cfg.output_dir)
            run_cfg = dataclasses.replace(run_cfg, output_dir=output_dir)
            raw = {**raw, "output_dir": output_dir}
        handler = _setup_rank_logging(output_dir, env.rank)
        failure.clear(Path(output_dir), env.rank)
        try:
            check_shared(env, shared_dirs(run_cfg))
            result = run(run_cfg, dist=env, reporter=reporter, preemption=watch, resolved_config=raw,
                         overrides=overrides, kept=SESSION.kept())
        except BaseException as e:
            if env.world_size > 1:  # peers may wait in a collective: no agreeing with them, the launcher ends them
                failure.end_rank(Path(output_dir), env.rank, e, run_cfg.dist.timeout_s, speak=env.source != "local")
            raise
        finally:  # a worker's next trial logs to its own files
            logging.getLogger().removeHandler(handler)
            handler.close()
    if result.status == "preempted":
        watch.handover(env.rank)  # under submitit, rank 0 requeues the job and exits here
    else:
        watch.restore()
    return {
        "objective": result.objective, "status": result.status, "steps": result.steps,
        "before": result.eval_before.student_ce, "output_dir": result.output_dir, "exports": result.exports,
        "after": result.eval_after.student_ce if result.eval_after else float("nan"),
        "teacher": result.eval_after.teacher_ce if result.eval_after else float("nan"),
        "rank": env.rank, "world_size": env.world_size,
    }


def shared_dirs(cfg: RunConfig) -> dict[str, Path]:
    """What every rank of a job must see alike: its run directory, the caches it reads, and where its ranks wait for
    rank 0's word (``distributed.waits``)."""
    from kdsweep.data.key import cache_root as data_root
    from kdsweep.distributed.waits import rendezvous_root
    from kdsweep.teacher.cache import cache_root

    dirs = {"the run directory": Path(cfg.output_dir), "the tokenization cache": data_root(cfg.data),
            "the ranks' rendezvous directory ($KDSWEEP_CACHE/rendezvous)": rendezvous_root()}
    if cfg.teacher.logits == "cache":
        dirs["the teacher cache"] = cache_root(cfg)
    return dirs


def _remove_if_empty(path: str | None) -> None:
    if path:
        try:
            os.rmdir(path)  # only succeeds when empty: never removes anything a run wrote
        except OSError:
            pass


def _launch(run_cfg: RunConfig, raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Run the job here (one rank, or this process's rank under torchrun/SLURM) or spawn its local ranks."""
    import_frozen()  # what a job imports, before anything imports it with the garbage collector running
    from kdsweep.distributed import detect, device_for
    from kdsweep.distributed.launch import check_local_launch, check_master_resolves, spawn

    from kdsweep.train import prepare_data

    env = detect()
    spawn_local = env.world_size == 1 and run_cfg.dist.nproc_per_node > 1
    _check_before_training(run_cfg)
    if spawn_local:
        check_local_launch(run_cfg.dist, device_for(run_cfg.train.device, env))
    elif env.world_size > 1:
        check_master_resolves(env.master_addr)
    run_cfg.check_world_size(run_cfg.dist.nproc_per_node if spawn_local else env.world_size)
    if spawn_local:
        prepare_data(run_cfg)
        return spawn(run_rank, (run_cfg, raw, overrides), run_cfg.dist, Path(run_cfg.output_dir))
    return run_rank(run_cfg, raw, overrides)


def _check_before_training(run_cfg: RunConfig) -> None:
    """What a job checks before any of its ranks (or a pack's members) starts."""
    from kdsweep.evaluation import downstream
    from kdsweep.models.check import preflight_targets
    from kdsweep.train import check_resumable

    check_resumable(run_cfg)  # here too, so that spawned ranks never start on someone else's checkpoints
    preflight_targets(run_cfg, zoo_too=True)  # a LoRA target that selects nothing: one line, not a rank's traceback
    downstream.check(run_cfg.downstream)  # lm-eval and its tasks, before training rather than after it


def _job_config(cfg: DictConfig, hc: Any) -> dict[str, Any]:
    """The job's resolved config, its ``output_dir`` Hydra's; the jobs of a Hydra grid (``-m a=1,2``, not a kdsweep
    sweep) share a W&B group: their sweep directory."""
    from hydra.types import RunMode

    raw = resolve(cfg)
    raw["output_dir"] = hc.runtime.output_dir
    wandb = raw.get("logger", {}).get("wandb", {})
    if hc.mode == RunMode.MULTIRUN and wandb.get("group") is None and not raw.get("trial", {}).get("sweep_dir"):
        wandb["group"] = str(hc.sweep.dir)
    return raw


def task(cfg: DictConfig) -> float:
    """One KD job; returns the held-out student CE (the objective), the same on every rank."""
    from kdsweep.metrics.records import JOB_STARTED, process_started

    # when this job started (its ranks, spawned later, count from here): the process's start for its first job,
    # now for the next ones of a multirun in this process
    os.environ[JOB_STARTED] = str(process_started() if JOB_STARTED not in os.environ else time.time())
    return job(cfg)


def job(cfg: DictConfig) -> float:
    """``task`` once the job's clock is set (a warm worker sets it for each trial it runs)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    output_dir = hc.runtime.output_dir
    overrides = list(hc.overrides.task)
    try:
        raw = _job_config(cfg, hc)
        summary = _launch(validate(raw), raw, overrides)
    except ConfigError as e:
        fail(str(e), output_dir)
    except RanksFailed as e:  # the ranks' records say it, and their tracebacks are in their logs
        print(f"kdsweep: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2 if e.config_error else 1) from None
    except JobError as e:  # its run.json says failed, with the same line
        print(f"kdsweep: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except Exception:
        # Hydra's multirun would record the failure and return normally, so SLURM would show the job as
        # COMPLETED: leave with a non-zero status instead (the traceback goes to the log first).
        log.exception("the job failed")
        raise SystemExit(1) from None
    if summary["rank"] == 0:
        print(
            f"held-out CE: before {summary['before']:.4f} -> after {summary['after']:.4f} "
            f"(teacher {summary['teacher']:.4f}, {summary['steps']} steps, {summary['status']}, "
            f"{summary['world_size']} rank{'s' if summary['world_size'] > 1 else ''})\n"
            f"outputs: {summary['output_dir']} (run.json, metrics.jsonl, kdsweep.log"
            + "".join(f", {name}: {path}" for name, path in summary["exports"].items())
            + ")",
            flush=True,
        )
    return summary["objective"]


_hydra_main = hydra.main(version_base=None, config_path=conf_dir(), config_name="config")(task)
_trial_main = hydra.main(version_base=None, config_path=conf_dir(), config_name="config")(job)


def trial_in_process(args: list[str]) -> None:
    """What ``python -m kdsweep ARGS`` does, in this process, on the job clock its caller set: a warm worker's
    trial (composed, validated and recorded exactly as a job's; SystemExit as a job would exit)."""
    from hydra.core.global_hydra import GlobalHydra

    if args[:1] == ["--pack"]:  # a sweep's packed job (hydra.sweeper.pack)
        from kdsweep.pack.jobs import packed_trials

        return packed_trials(args[1])
    GlobalHydra.instance().clear()  # the last trial's Hydra; each trial composes its own config
    sys.argv = ["kdsweep", *args]
    _check_command_line(args)
    _trial_main()


def _check_command_line(args: list[str]) -> None:
    """Unknown keys get kdsweep's one line (with the valid keys) before Hydra composes anything."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from hydra_plugins.kdsweep_site import CONFIG_DIR_ENV

    site = os.environ.get(CONFIG_DIR_ENV)
    if site and not Path(site).expanduser().is_dir():
        fail(f"{CONFIG_DIR_ENV}={site} is not a directory: set it to the directory of your own presets (e.g. one "
             "holding cluster/mysite.yaml), or unset it", None)
    try:
        overrides = OverridesParser.create().parse_overrides(get_args_parser().parse_known_args(args)[0].overrides)
    except (HydraException, SystemExit):
        return  # malformed syntax: Hydra's own message says where
    roots = [Path(conf_dir()), *([Path(site).expanduser()] if site else [])]
    groups = tuple(sorted({p.name for root in roots for p in root.iterdir() if p.is_dir() and p.name != "hydra"}))
    chosen = {o.key_or_group: o.value() for o in overrides}
    preset = None if "experiment" in chosen else chosen.get("data", "embedded")  # an experiment picks its own
    for o in overrides:
        key = o.key_or_group
        if o.is_add() or o.is_delete() or o.is_force_add() or key.startswith("hydra") or o.package:
            continue
        try:
            check_key(key, groups)
            if isinstance(preset, str):
                _check_source_override(key, preset)
        except ConfigError as e:
            fail(str(e), None)


def _check_source_override(key: str, preset: str) -> None:
    """``data.datasets.1.split=...`` changes a source the data preset lists, and only a field that source has:
    Hydra would refuse anything else with a multi-line error."""
    import yaml

    match = re.fullmatch(r"data\.(datasets|eval_datasets)\.(\d+)\.(\w+)", key)
    path = Path(conf_dir()) / "data" / f"{preset}.yaml"
    if match is None or not path.is_file():
        return
    section, index, field = match[1], int(match[2]), match[3]
    sources = (yaml.safe_load(path.read_text()) or {}).get(section) or []
    example = (f"data.{section}=[{{path:/data/train.jsonl,format:instruction"
               f"{'' if field == 'path' else f',{field}:...'}}}]")
    if index >= len(sources):
        raise ConfigError(f"{key}: data={preset} has {len(sources)} source(s) in data.{section}, so no source "
                          f"{index} to change; pass the whole list, e.g. {example}")
    if field not in sources[index]:
        raise ConfigError(f"{key}: source {index} of data={preset} has no {field} to change; pass the whole list, "
                          f"e.g. {example}")


def main() -> None:
    """Entry point of ``python -m kdsweep`` and the ``kdsweep`` script (``--pack DIR``: a sweep's packed job)."""
    if sys.argv[1:2] == ["--pack"]:
        from kdsweep.pack.jobs import packed_trials

        return packed_trials(sys.argv[2])
    _check_command_line(sys.argv[1:])
    _hydra_main()
