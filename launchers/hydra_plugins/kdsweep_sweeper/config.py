"""The sweeper's config node, registered as ``hydra/sweeper=kdsweep_optuna`` (fields: kdsweep.sweep.study.SweepSettings)."""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ConfirmConf:
    """``hydra.sweeper.confirm`` (kdsweep.sweep.confirm): top 0 is no confirmation."""

    top: int = 0
    seeds: int = 3
    objective: Optional[str] = None
    baseline_trials: int = 4  # CE-only trials over the searched lr range, for the baseline's own lr (0: the best's)
    more_seeds: int = 3  # what a budget that ended the search leaves after them: this many more top1/CE-only seeds
    also: List[str] = field(default_factory=list)  # second measures of the seeds, e.g. [lm_eval/kdsweep_next_word]


@dataclass
class KdsweepOptunaConf:
    _target_: str = "hydra_plugins.kdsweep_sweeper.sweeper.KdsweepOptunaSweeper"
    study_name: str = "kdsweep"
    storage: Optional[str] = None
    n_trials: Optional[int] = None
    budget: Optional[float] = None
    wall_hours: Optional[float] = None
    trial_hours: Optional[float] = None
    confirm: ConfirmConf = field(default_factory=lambda: ConfirmConf())
    max_concurrent: int = 2
    pack: Any = None  # K trials per packed job (kdsweep.pack), auto: as many as fit, or null: one job per trial
    sampler: str = "tpe"
    seed: Optional[int] = 0
    pruner: str = "halving"
    pruner_startup_trials: int = 2
    pruner_warmup_steps: Optional[int] = None  # None: pruner_grace of train.max_steps
    pruner_grace: float = 0.5
    pruner_percentile: float = 75.0
    objectives: List[str] = field(default_factory=lambda: ["student_ce"])
    directions: List[str] = field(default_factory=lambda: ["minimize"])
    retries: int = 1
    storage_grace_s: float = 300.0
    poll_s: float = 0.5
    enqueue: List[Any] = field(default_factory=list)
    params: Dict[str, str] = field(default_factory=dict)
    workers: Optional[int] = None
    worker_idle_s: float = 600.0


ConfigStore.instance().store(group="hydra/sweeper", name="kdsweep_optuna", node=KdsweepOptunaConf, provider="kdsweep")
