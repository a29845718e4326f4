"""Hydra callbacks: before a grid, every point validated (and, packed, checked to agree) and its SLURM jobs' ranks
ended together when one dies;
after a multirun, one table of every job's objective (read from the jobs' run.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from kdsweep.metrics.records import read_run


def slurm_job_name(slurm: dict[str, str]) -> str | None:
    """``ARRAY_TASK`` for array jobs (what squeue and sacct show), else the job id."""
    if "array_job_id" in slurm and "array_task_id" in slurm:
        return f"{slurm['array_job_id']}_{slurm['array_task_id']}"
    return slurm.get("job_id")


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of a sweep (subdirectories holding a run.json), in job order."""
    rows = []
    for record in sorted(sweep_dir.glob("*/run.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        run = read_run(record.parent)
        slurm = (run.get("environment") or {}).get("slurm") or {}
        rows.append({
            "job": record.parent.name, "status": run.get("status"), "objective": run.get("objective"),
            "overrides": " ".join(run.get("overrides", [])), "slurm_job": slurm_job_name(slurm),
            "world_size": run.get("world_size"),
        })
    return rows


def grid_points(config: DictConfig) -> list[list[str]]:
    """Every job's overrides of a Hydra grid (what BasicSweeper will launch), from the multirun's config."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    return [list(point) for batch in BasicSweeper.split_arguments(overrides, None) for point in batch]


class ValidateGrid(Callback):
    """A grid's bad point is one line before the first job starts, not a failure after others have run
    (or a FAILED SLURM job): every point is composed and validated like a job would be."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")):
            return  # kdsweep's own sweeper validates its space itself
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra._internal.utils import create_config_search_path
        from hydra.types import RunMode

        from kdsweep.app import conf_dir, fail, validate_composed
        from kdsweep.config.schema import ConfigError

        loader = ConfigLoaderImpl(config_search_path=create_config_search_path(conf_dir()))
        hydra_overrides = [str(o) for o in config.hydra.overrides.hydra]
        points = []
        for i, point in enumerate(grid_points(config)):
            try:
                cfg = loader.load_configuration("config", [*hydra_overrides, *point], RunMode.RUN)
                points.append(validate_composed(cfg, str(Path(str(config.hydra.sweep.dir)) / str(i))))
            except ConfigError as e:
                fail(f"grid point {i} ({' '.join(point)}): {e}", None)
        if "PackLauncher" in str((config.hydra.get("launcher") or {}).get("_target_", "")):
            from kdsweep.distributed import detect, device_for
            from kdsweep.pack import check_pack
            from kdsweep.pack.plan import check_fits, plan

            try:  # the grid trains as one pack (hydra/launcher=kdsweep_pack): its points must agree, and fit
                check_pack(points)
            except ValueError as e:
                fail(f"hydra/launcher=kdsweep_pack: {e}", None)
            try:
                check_fits(plan(points, device_for(points[0].train.device, detect())), len(points),
                           "hydra/launcher=kdsweep_pack", "a grid of at most {n} points per command",
                           "use hydra/launcher=basic (a job per point)")
            except ConfigError as e:
                fail(str(e), None)


KILL_BAD_EXIT = "export SLURM_KILL_BAD_EXIT=1"


class KillBadExit(Callback):
    """A grid's SLURM jobs end all their ranks as soon as one dies (else the others wait in a collective until
    ``dist.timeout_s``): the shipped cluster presets' ``setup`` line, kept when a user's ``hydra.launcher.setup``
    replaces the list (as ``hydra.launcher.setup=[module load cuda]`` does). kdsweep's own sweeper passes srun
    ``--kill-on-bad-exit=1`` itself. Runs before Hydra builds the launcher, which copies its settings."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from omegaconf import open_dict, read_write

        launcher = config.hydra.get("launcher") or {}
        if "SlurmLauncher" not in str(launcher.get("_target_", "")):
            return
        setup = list(launcher.get("setup") or [])
        if not any("SLURM_KILL_BAD_EXIT" in str(line) for line in setup):
            with read_write(config.hydra), open_dict(config.hydra):
                config.hydra.launcher.setup = [*setup, KILL_BAD_EXIT]


class SweepSummary(Callback):
    """Print the objectives of a finished multirun, whichever launcher ran the jobs."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if (sweep_dir / "sweep.json").exists():
            return  # kdsweep's own sweeper has printed its table of trials
        rows = summarize(sweep_dir)
        if not rows:
            return
        print(f"sweep {config.hydra.sweep.dir}: {len(rows)} jobs (objective: held-out student CE, lower is better)")
        for r in rows:
            objective = f"{r['objective']:.4f}" if isinstance(r["objective"], float) else "-"
            where = f" slurm {r['slurm_job']}" if r["slurm_job"] else ""
            print(f"  job {r['job']}: objective {objective}  {r['status']}  ranks {r['world_size']}{where}  "
                  f"{r['overrides']}")
