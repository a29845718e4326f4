"""Sweeps, Optuna studies and W&B runs as pandas DataFrames that join on the trial number; plots for notebooks.

Needs the ``analysis`` extra (pandas, matplotlib). Nothing here imports torch; wandb is imported only to read
runs from W&B's server.
"""

from kdsweep.analysis.sweep import Sweep, load_sweep
from kdsweep.analysis.wandb_runs import WandbRuns, load_wandb_runs

__all__ = ["Sweep", "WandbRuns", "load_sweep", "load_wandb_runs"]
