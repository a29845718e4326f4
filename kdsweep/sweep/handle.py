"""The in-job end of a trial: report evals to the study and ask whether to stop (rank 0 only).

The job writes intermediate values only; the controller alone tells the trial's final state.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from kdsweep.sweep.manifest import Manifest, connect_url
from kdsweep.sweep.study import make_pruner, make_storage

log = logging.getLogger(__name__)


class TrialHandle:
    """``report(step, evals) -> should_stop`` against trial ``number`` of the sweep in ``sweep_dir``: the study's
    (first) objective, e.g. ``student_ce`` or ``kl``, is what the pruner sees."""

    def __init__(self, sweep_dir: str, number: int) -> None:
        import optuna

        manifest = Manifest.load(Path(sweep_dir))
        settings = manifest.settings
        storage = make_storage(connect_url(settings, Path(sweep_dir)), settings.storage_grace_s)
        # Optuna does not store the pruner: build the very one the controller uses, from the same settings.
        study = optuna.load_study(study_name=settings.study_name, storage=storage, pruner=make_pruner(settings))
        trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
        self.trial = optuna.trial.Trial(study, trial_id)
        self.number = number
        # Optuna cannot prune multi-objective trials, nor on what has no value before the end (an lm-eval task);
        # a confirmation trial runs to its end
        self.can_prune = settings.prunes and not manifest.trials.get(str(number), {}).get("confirm")
        self.objective = settings.objectives[0]

    def report(self, step: int, evals: dict[str, float]) -> bool:
        if not self.can_prune:
            return False
        value = float(evals[self.objective])
        if not math.isfinite(value):
            return False
        self.trial.report(value, step)
        prune = bool(self.trial.should_prune())  # optuna may answer with a numpy bool
        if prune:
            log.info("trial %d: the pruner stops it at step %d (eval %.4f)", self.number, step, value)
        return prune
