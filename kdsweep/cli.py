"""The ``kdsweep`` console script: the same Hydra app as ``python -m kdsweep``."""

from kdsweep.app import main

__all__ = ["main"]
