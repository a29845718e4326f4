"""kdsweep's Hydra sweeper: ``hydra/sweeper=kdsweep_optuna`` (logic in kdsweep.sweep)."""
