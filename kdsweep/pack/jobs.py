"""Packed jobs from Hydra: a grid's (``hydra/launcher=kdsweep_pack``) and a sweep's (``hydra.sweeper.pack``).

Either way each member is composed, validated and given its directory and ``.hydra`` files exactly as its own job
would be (:func:`pack_member`), then all of them train as one pack, in this process or in the local ranks it
spawns (:func:`pack_jobs`, :func:`pack_rank`). A sweep's
packed job is ``python -m kdsweep --pack DIR`` (:func:`packed_trials`): ``DIR/pack.json`` holds each member's trial
arguments, the ones its own job would have been given; each member reports to its trial in the study.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from kdsweep.config import ConfigError, RunConfig

SPEC = "pack.json"
"""A sweep's packed job's file in its directory: ``{"members": [each member's trial arguments], "numbers": [...]}``."""


def pack_member(cfg: DictConfig) -> tuple[RunConfig, dict[str, Any], list[str]]:
    """A packed job's member, composed and validated as :func:`kdsweep.app.job` would (its one line for bad input),
    not run: :func:`pack_jobs` trains them together."""
    from hydra.core.hydra_config import HydraConfig

    from kdsweep.app import _check_before_training, _job_config, fail, validate

    hc = HydraConfig.get()
    try:
        raw = _job_config(cfg, hc)
        run_cfg = validate(raw)
        _check_before_training(run_cfg)
    except ConfigError as e:
        fail(str(e), hc.runtime.output_dir)
    return run_cfg, raw, list(hc.overrides.task)


def pack_jobs(members: list[tuple[RunConfig, dict[str, Any], list[str]]]) -> list[Any]:
    """Train jobs (:func:`pack_member`'s) as one pack (:func:`kdsweep.pack.run_pack`), in this process or in the
    ``dist.nproc_per_node`` local ranks it spawns: each job's objective, or the error it failed with. What cannot be
    packed, or does not fit the device as the memory plan has it, is one line before anything trains; a sweep's
    member reports its evaluations to its trial (and is pruned on its own)."""
    from kdsweep import app
    from kdsweep.distributed import detect, device_for
    from kdsweep.distributed.launch import check_local_launch, spawn
    from kdsweep.metrics.records import JOB_STARTED, process_started
    from kdsweep.pack import check_pack
    from kdsweep.pack.plan import check_fits, plan
    from kdsweep.train import prepare_data

    cfgs = [cfg for cfg, _, _ in members]
    env = detect()
    spawn_local = env.world_size == 1 and cfgs[0].dist.nproc_per_node > 1
    try:
        check_pack(cfgs)
        device = device_for(cfgs[0].train.device, env)
        check_fits(plan(cfgs, device), len(cfgs), "a packed job", "pack at most {n} trials together",
                   "train them unpacked")
        if spawn_local:
            check_local_launch(cfgs[0].dist, device)
        cfgs[0].check_world_size(cfgs[0].dist.nproc_per_node if spawn_local else env.world_size)
    except (ValueError, ConfigError) as e:
        app.fail(str(e), None)
    os.environ.setdefault(JOB_STARTED, str(process_started()))  # a warm worker's task set it: from its pick-up
    if spawn_local:
        prepare_data(cfgs[0])  # tokenized once, before the ranks start
        results = spawn(pack_rank, (members,), cfgs[0].dist, Path(cfgs[0].output_dir))
    else:
        results = pack_rank(members)
    for cfg, result in zip(cfgs, results):
        said = (f"{type(result).__name__}: {result}" if isinstance(result, BaseException) else
                f"held-out CE {result.eval_before.student_ce:.4f} -> {result.objective:.4f}, {result.status}")
        print(f"pack member {cfg.output_dir}: {said}", flush=True)
    return [r if isinstance(r, BaseException) else r.objective for r in results]


def pack_rank(members: list[tuple[RunConfig, dict[str, Any], list[str]]]) -> list[Any]:
    """One rank of a packed job (all of it, for one rank): join the process group, train the pack; each member's
    result or error."""
    from kdsweep import app
    from kdsweep.distributed.signals import PreemptionWatch
    from kdsweep.pack import run_pack
    from kdsweep.pack.job import member_lines
    from kdsweep.train import NULL_REPORTER

    cfgs = [cfg for cfg, _, _ in members]
    watch = PreemptionWatch()
    with app.SESSION.joined(cfgs[0]) as env:
        handlers = [app._setup_rank_logging(cfg.output_dir, env.rank) for cfg in cfgs]
        for i, handler in enumerate(handlers):  # each member's log: its own lines and the pack's
            handler.addFilter(member_lines(i))
        try:
            reporters = [_reporter(cfg) if env.is_main else NULL_REPORTER for cfg in cfgs]
            results = run_pack(cfgs, reporters=reporters, dist=env, preemption=watch, kept=app.SESSION.kept(),
                               resolved_configs=[raw for _, raw, _ in members], overrides=[o for _, _, o in members])
        finally:
            for handler in handlers:
                logging.getLogger().removeHandler(handler)
                handler.close()
    if any(getattr(r, "status", None) == "preempted" for r in results):
        watch.handover(env.rank)  # under submitit, the job requeues and exits here (each member resumes)
    else:
        watch.restore()
    return results


def _reporter(cfg: RunConfig) -> Any:
    """A member's reporter: its sweep trial's handle (it reports to the study, which may prune it), else none."""
    from kdsweep.train import NULL_REPORTER

    if not cfg.trial.sweep_dir:
        return NULL_REPORTER
    from kdsweep.sweep.handle import TrialHandle

    return TrialHandle(cfg.trial.sweep_dir, cfg.trial.number)


_COMPOSED: list[tuple[RunConfig, dict[str, Any], list[str]]] = []


def _compose(cfg: DictConfig) -> None:
    _COMPOSED.append(pack_member(cfg))


def packed_trials(pack_dir: str) -> None:
    """``python -m kdsweep --pack DIR``: a sweep's packed job. Each member is composed from its trial's arguments
    (``DIR/pack.json``) as ``python -m kdsweep ARGS`` would compose it, then all train as one pack; the job exits 1
    when a member failed (each member's run.json says how it ended; the controller judges each from it)."""
    from hydra.core.global_hydra import GlobalHydra

    from kdsweep.app import _check_command_line, conf_dir

    spec = json.loads((Path(pack_dir) / SPEC).read_text())
    compose = hydra.main(version_base=None, config_path=conf_dir(), config_name="config")(_compose)
    _COMPOSED.clear()
    for args in spec["members"]:
        GlobalHydra.instance().clear()
        sys.argv = ["kdsweep", *args]
        _check_command_line(args)
        compose()
    members = list(_COMPOSED)
    _COMPOSED.clear()
    results = pack_jobs(members)
    if any(isinstance(r, BaseException) for r in results):
        raise SystemExit(1)


def member_dirs(pack_dir: Path) -> list[Path]:
    """The run directories of a sweep's packed job's members (its trials' ``hydra.run.dir``)."""
    spec = json.loads((pack_dir / SPEC).read_text())
    return [Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir="))) for args in spec["members"]]


__all__ = ["SPEC", "member_dirs", "pack_jobs", "pack_member", "pack_rank", "packed_trials"]
