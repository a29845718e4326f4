"""The Hydra side of kdsweep's sweeper: read the command line and the launcher, then hand over to the controller."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, List

from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class KdsweepOptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        self.raw_settings = settings

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def sweep(self, arguments: List[str]) -> Any:
        from kdsweep.app import fail
        from kdsweep.config.schema import ConfigError

        try:
            return self._sweep(arguments)
        except ConfigError as e:
            fail(str(e), None)
        except Exception as e:  # the storage away longer than the grace (kdsweep.sweep.patient): one line
            import optuna  # imported by the controller already: optuna is not paid for by every job's start

            from kdsweep.sweep.patient import cause_line
            from kdsweep.sweep.study import redact

            if not isinstance(e, optuna.exceptions.StorageInternalError):
                raise
            cause = cause_line(e)
            sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
            fail(f"the study's storage was away longer than hydra.sweeper.storage_grace_s ({redact(cause)}); every "
                 f"trial's record is kept: once it is back, `kdsweep resume {sweep_dir}` goes on", None)

    def _sweep(self, arguments: List[str]) -> Any:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from kdsweep.sweep.controller import Controller, summary_lines
        from kdsweep.sweep.space import parse_space
        from kdsweep.sweep.study import SweepSettings, cache_bias_line, redact

        settings_raw = OmegaConf.to_container(OmegaConf.create(self.raw_settings), resolve=True)
        params = dict(settings_raw.pop("params") or {})
        base = []
        for override in OverridesParser.create().parse_overrides(arguments):
            if override.is_sweep_override():  # a sweep given on the command line joins the search space
                params[override.key_or_group] = _value_text(override)
            else:
                base.append(override.input_line)
        # Hydra settings given on the command line that shape each job's config (search path, job name, ...)
        # travel with it; the sweep's own (sweeper, launcher, directories) stay here.
        own = ("hydra.sweep", "hydra.sweeper", "hydra/sweeper", "hydra.launcher", "hydra/launcher", "hydra.run", "hydra.mode")
        base += [o for o in self.config.hydra.overrides.hydra if not str(o).lstrip("+~").startswith(own)]
        settings = SweepSettings.from_plain({**settings_raw, "params": params})
        for line in settings.idle_knobs():
            log.warning(line)
        space = parse_space(params)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        configs = self._validate_points(base, space, settings, sweep_dir)
        first = configs[0]
        settings = self._packs(settings, configs).with_grace(first.train.max_steps)  # the grace: of train.max_steps
        _check_downstream(settings, first)
        backend = self._backend(settings, first, sweep_dir)
        bias = cache_bias_line(first.teacher.cache.method if first.teacher.logits == "cache" else None, params)
        if bias:
            log.warning(bias)
        controller = Controller(settings, space, base, sweep_dir, backend,
                                teacher_cache=first.teacher.logits == "cache")
        controller.manifest.data["command"] = [redact(a) for a in sys.argv[1:]]  # never a password on disk
        controller.manifest.save()
        log.info("sweep %s: study %s on %s, %s, %d at a time (%s), sampler %s, pruner %s", sweep_dir,
                 settings.study_name, redact(settings.storage) or "sqlite (sweep dir)", trials_text(settings),
                 settings.max_concurrent,
                 (f"{settings.pool_size} warm workers" if settings.pool_size else "one job per trial")
                 + (f", {settings.pack} trials per packed job" if settings.pack_size > 1 else ""),
                 settings.sampler, settings.pruner)
        manifest = controller.run()
        print("\n".join([f"sweep {sweep_dir} (study {settings.study_name}):", *summary_lines(manifest)]), flush=True)
        return manifest

    def _backend(self, settings: Any, first: Any, sweep_dir: Path) -> Any:
        """Where trials run: local processes or warm local workers (basic launcher), or SLURM jobs driven from the
        launcher's settings. ``first``: the base point's RunConfig (a worker's ranks and device)."""
        from kdsweep.config.schema import ConfigError
        from kdsweep.sweep.local import LocalProcesses
        from kdsweep.sweep.slurm import SlurmJobs
        from kdsweep.sweep.workers import LocalStarter, WorkerPool

        launcher = str(OmegaConf.select(self.config, "hydra.launcher._target_", default=""))
        size = settings.pool_size
        if settings.workers is not None and settings.workers > settings.jobs_at_once:
            log.warning("hydra.sweeper.workers=%d but max_concurrent=%d%s: %d workers run the trials",
                        settings.workers, settings.max_concurrent,
                        f" in packs of {settings.pack}" if settings.pack_size > 1 else "", size)
        if settings.workers is None and not size:
            log.info("one job per trial: the search changes %s, which a warm worker cannot (hydra.sweeper.workers)",
                     ", ".join(settings.reshaping_keys()))
        spec = {"nproc": first.dist.nproc_per_node, "device": first.train.device, "timeout_s": first.dist.timeout_s,
                "master_addr": first.dist.master_addr, "idle_s": settings.worker_idle_s}
        if launcher.endswith(".BasicLauncher"):
            if size:
                return WorkerPool(size, sweep_dir, spec, LocalStarter(size))
            return LocalProcesses(settings.jobs_at_once)
        if launcher.endswith(".SlurmLauncher"):
            params = OmegaConf.to_container(self.config.hydra.launcher, resolve=True)
            ranks = int(params.get("tasks_per_node") or 1) * int(params.get("nodes") or 1)
            if settings.pack_size > 1 and ranks > 1:
                raise ConfigError(f"hydra.sweeper.pack={settings.pack} trains a pack on one rank, but the launcher "
                                  f"gives each job {ranks} tasks: pass hydra.launcher.tasks_per_node=1 "
                                  "hydra.launcher.nodes=1, or hydra.sweeper.pack=null")
            jobs = SlurmJobs(params, settings.study_name)
            jobs.preflight()
            return WorkerPool(size, sweep_dir, spec, jobs.worker_starter()) if size else jobs
        raise ConfigError(
            f"hydra.launcher={launcher.rsplit('.', 1)[-1]} cannot run kdsweep's trials: use hydra/launcher=basic "
            "(local processes; dist.nproc_per_node=N for ranks) or hydra/launcher=submitit_slurm"
        )

    def _validate_points(self, base: list, space: list, settings: Any, sweep_dir: Path) -> Any:
        """Every corner of the space (both ends of each range, every choice) and every enqueued point must make a
        valid job, and so must a confirmation trial (the live teacher, the test split). Returns their RunConfigs,
        the base point's first."""
        from kdsweep.app import validate_composed
        from kdsweep.config.schema import ConfigError
        from kdsweep.sweep.confirm import UNBIASED

        points = [[]] + [[f"{p.key}={v}"] for p in space for v in p.corners()]
        points += [[f"{k}={v}" for k, v in point.items()] for point in settings.enqueue]
        load = self.hydra_context.config_loader.load_sweep_config
        compose = lambda extra: validate_composed(load(self.config, [*base, *extra]), str(sweep_dir / "validation"))
        configs = [compose(extra) for extra in points]
        if settings.confirmation is not None:
            try:
                compose(list(UNBIASED))
            except ConfigError as e:
                raise ConfigError(f"hydra.sweeper.confirm scores its verdict with the live teacher on the test split "
                                  f"({' '.join(UNBIASED)}), and that job is refused: {e}; or pass "
                                  "hydra.sweeper.confirm.top=0 for no confirmation") from None
        return configs

    def _packs(self, settings: Any, configs: list) -> Any:
        """``hydra.sweeper.pack``: the trials ``configs`` stand for must train together, and a pack of them fit the
        device its jobs run on, as the memory plan has it (``auto``: as many as fit, at most ``max_concurrent``).
        The settings, ``auto`` replaced by its number."""
        if settings.pack in (None, 1):
            return settings
        import dataclasses

        from kdsweep.config.schema import ConfigError
        from kdsweep.distributed import device_for, single_process  # torch: only a packed sweep's controller
        from kdsweep.pack.plan import check_fits, plan

        _check_packable(configs, settings.pack)
        first = configs[0]
        device_gb = first.dist.device_memory_gb or None
        if str(OmegaConf.select(self.config, "hydra.launcher._target_", default="")).endswith(".SlurmLauncher"):
            if device_gb is None and settings.pack == "auto":
                raise ConfigError("hydra.sweeper.pack=auto sizes a pack by the memory of the GPU its job runs on, "
                                  "which this controller cannot see: pass dist.device_memory_gb=<its GB, e.g. 80>, or "
                                  "hydra.sweeper.pack=<trials per job>")
            if device_gb is None:
                log.info("hydra.sweeper.pack=%d: the memory plan is not checked (the jobs' GPU is not this "
                         "machine's; dist.device_memory_gb=<its GB> checks it)", settings.pack)
                return settings
            device = None  # the plan reads device_gb
        else:
            device = device_for(first.train.device, single_process())
        memory = plan(configs, device, device_gb)
        if settings.pack != "auto":
            check_fits(memory, settings.pack, f"hydra.sweeper.pack={settings.pack}", "pass hydra.sweeper.pack={n}",
                       "pass hydra.sweeper.pack=null (a job per trial)")
            return settings
        k = min(settings.max_concurrent, memory.largest())
        check_fits(memory, 1, "hydra.sweeper.pack=auto", "", "")  # not one trial fits: its line
        log.info("hydra.sweeper.pack=auto: %d trials per packed job (%s)", k, memory.text(k))
        return dataclasses.replace(settings, pack=k)


def _check_packable(configs: list, pack: int) -> None:
    """``hydra.sweeper.pack``: the trials the space and the enqueued points make must train in one pack (they
    differ only in what each member sets its own, on one rank): one line naming what breaks it, before any job."""
    import dataclasses

    from kdsweep.config.schema import ConfigError
    from kdsweep.pack import check_pack
    from kdsweep.pack.job import KNOBS

    if configs[0].dist.nproc_per_node > 1:
        raise ConfigError(f"hydra.sweeper.pack={pack}: a sweep's packs train on one rank for now, not "
                          f"dist.nproc_per_node={configs[0].dist.nproc_per_node}: pass dist.nproc_per_node=1, or "
                          "hydra.sweeper.pack=null")
    try:
        check_pack([dataclasses.replace(c, output_dir=str(i)) for i, c in enumerate(configs)])
    except ValueError as e:
        why = str(e).replace("pack member", "point").replace("member 0", "point 0")  # the space's corners, in order
        shared = ": a pack's members share it"
        why = why.split(shared)[0] + shared if shared in why else why  # (the knobs a member may set: below)
        raise ConfigError(f"hydra.sweeper.pack={pack} trains the trials in packs, which this search cannot: {why}; "
                          f"search only {', '.join(KNOBS)} (lora_rank > 0), or pass hydra.sweeper.pack=null") from None


def _check_downstream(settings: Any, first: Any) -> None:
    """The lm-eval tasks the sweep's objectives and second measures name: the sweep sets each trial's
    ``downstream.tasks`` to them (a command line's own would be replaced: one line), and lm-eval must know them,
    before any trial starts."""
    import dataclasses

    from kdsweep.config.schema import ConfigError
    from kdsweep.evaluation import downstream

    confirmation = settings.confirmation
    if confirmation is None and (settings.confirm or {}).get("also"):
        log.warning("hydra.sweeper.confirm.also has no effect with confirm.top=0 (no confirmation)")
    tasks = settings.downstream_tasks(confirmation.also if confirmation else ())
    if not tasks:
        return
    if first.downstream.tasks:
        raise ConfigError(f"downstream.tasks={list(first.downstream.tasks)}: the sweep scores its trials on "
                          f"{', '.join(map(downstream.measure, tasks))} (hydra.sweeper.objectives, confirm.also) and "
                          "sets downstream.tasks itself; drop it from the command line, and name a task to measure "
                          "in hydra.sweeper.confirm.also=[lm_eval/<task>]")
    downstream.check(dataclasses.replace(first.downstream, tasks=tasks),
                     where=f"hydra.sweeper's {', '.join(map(downstream.measure, tasks))}")
    if not settings.prunes and settings.pruner != "none" and not settings.multi_objective:
        log.info("the objective %s is scored once a trial has trained: no pruning", settings.objectives[0])


def trials_text(settings: Any) -> str:
    """How many trials the sweep asks for, and what limits it: ``8 trials``, ``trials until 2 device-h``."""
    limits = [f"{settings.budget:g} device-h" if settings.budget is not None else "",
              f"{settings.wall_hours:g} wall-h" if settings.wall_hours is not None else ""]
    limits = " and ".join(filter(None, limits))
    count = f"{settings.trial_limit:g} trials" if settings.trial_limit != float("inf") else "trials"
    return f"{count} until {limits}" if limits else count


def _value_text(override: Any) -> str:
    """The sweep expression as written (``interval(0.0,1.0)``, ``choice(4,8)``, ``0.1,0.2``)."""
    text = override.input_line.split("=", 1)[1]
    return text if "(" in text else f"choice({text})"
