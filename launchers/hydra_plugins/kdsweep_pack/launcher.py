"""The Hydra side of a packed grid: ``python -m kdsweep -m kd_ratio=0.3,0.5,0.7 optim.lr=1e-3,3e-3
hydra/launcher=kdsweep_pack`` composes every job as Hydra's basic launcher would (its directory, its ``.hydra``
files, its validation), then trains them all as one pack (:func:`kdsweep.pack.jobs.pack_jobs`): one read of the
student's base, one teacher pass per micro-batch, each job's run.json, metrics and exports its own. Which knobs a grid
may vary in a pack: :data:`kdsweep.pack.job.KNOBS`; anything else is one line before any job starts."""


import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class PackLauncherConf:
    _target_: str = "hydra_plugins.kdsweep_pack.launcher.PackLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="kdsweep_pack", node=PackLauncherConf, provider="kdsweep")


class PackLauncher(Launcher):
    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from kdsweep.pack.jobs import pack_jobs, pack_member

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info("Packing %d jobs into one", len(job_overrides))
        returns: List[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            # the job's directory, .hydra files and validated config, as a job would have them; nothing trains yet
            returns.append(run_job(hydra_context=self.hydra_context, task_function=pack_member, config=sweep_config,
                                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir"))
        members = [r.return_value for r in returns]  # a member that could not be composed raises here
        results = pack_jobs(members)
        for ret, result in zip(returns, results):
            ret.status, ret.return_value = JobStatus.COMPLETED, result
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        if any(isinstance(r, BaseException) for r in results):
            raise SystemExit(1)  # as a failed job of a grid leaves (its line is printed, its run.json says why)
        return returns
