"""Optuna: search spaces, storages, the async controller, the in-job trial handle."""
