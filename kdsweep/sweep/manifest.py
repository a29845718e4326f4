"""The sweep directory's ``sweep.json``: settings, search space and every trial's job, rewritten atomically.

It is what makes a sweep resumable: a controller started on a directory that has one continues it (same
study, same numbering, same budget) and re-attaches to the jobs still running; a changed search space is
refused. It never holds a password: the storage URL is saved redacted and reaches jobs through the environment.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.sweep.study import SweepSettings, redact, storage_url

STORAGE_ENV = "KDSWEEP_STORAGE_URL"
FINAL = ("COMPLETE", "PRUNED", "FAIL")
FIXED_ON_RESUME = ("storage", "sampler", "seed", "pruner", "pruner_startup_trials", "pruner_warmup_steps",
                   "pruner_percentile", "objectives", "directions")


class Manifest:
    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    @classmethod
    def open(cls, sweep_dir: Path, settings: SweepSettings, space: list[dict[str, Any]],
             base_overrides: list[str]) -> "Manifest":
        """Load the sweep's manifest (refusing a different search space) or start a new one."""
        path = sweep_dir / "sweep.json"
        fresh = {
            "study_name": settings.study_name,
            "settings": {**asdict(settings), "storage": redact(settings.storage)},
            "space": space,
            "base_overrides": base_overrides,
            "trials": {},
        }
        fresh = json.loads(json.dumps(fresh))  # as it reads back from disk (tuples become lists), to compare
        if not path.exists():
            m = cls(path, fresh)
            m.save()
            return m
        data = json.loads(path.read_text())
        for key, what in (("space", "search space"), ("base_overrides", "fixed overrides"),
                          ("study_name", "study name")):
            if data[key] != fresh[key]:
                raise ConfigError(
                    f"{sweep_dir} holds a sweep with a different {what} ({data[key]} vs now {fresh[key]}); "
                    "resume it unchanged, or start the new search in another hydra.sweep.dir"
                )
        # Every process builds the sampler and pruner from these, and the study keeps its objectives: they stay.
        changed = [f"{k}: {data['settings'].get(k, v)!r} -> {v!r}" for k, v in fresh["settings"].items()
                   if k in FIXED_ON_RESUME and data["settings"].get(k, v) != v]
        if changed:
            raise ConfigError(
                f"{sweep_dir} holds a sweep with other settings ({'; '.join(changed)}); resume it with its own, "
                "or start the new search in another hydra.sweep.dir (n_trials, budget, wall_hours, max_concurrent "
                "and retries may change)"
            )
        data["settings"] = fresh["settings"]  # budget and concurrency may change on resume
        return cls(path, data)

    @classmethod
    def load(cls, sweep_dir: Path) -> "Manifest":
        path = Path(sweep_dir) / "sweep.json"
        if not path.exists():
            raise ConfigError(f"{sweep_dir} is not a kdsweep sweep directory (no sweep.json)")
        return cls(path, json.loads(path.read_text()))

    @property
    def settings(self) -> SweepSettings:
        """The settings as saved: a database URL without its password (see ``connect_url``)."""
        return SweepSettings.from_plain(self.data["settings"])

    @property
    def trials(self) -> dict[str, dict[str, Any]]:
        return self.data["trials"]

    def trial(self, number: int) -> dict[str, Any]:
        return self.trials[str(number)]

    def put(self, number: int, **fields: Any) -> dict[str, Any]:
        entry = self.trials.setdefault(str(number), {"number": number})
        entry.update(fields)
        self.save()
        return entry

    def save(self) -> None:
        tmp = self.path.with_name(".sweep.json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        os.replace(tmp, self.path)


def connect_url(settings: SweepSettings, sweep_dir: Path) -> str:
    """The URL to open a sweep's storage with. Saved URLs and commands hold ``user:***@``: the password comes
    from KDSWEEP_STORAGE_URL (the full URL), which the controller sets for its jobs and a user sets to resume."""
    url = storage_url(settings, sweep_dir)
    env = os.environ.get(STORAGE_ENV)
    if env and redact(env) == redact(url):  # the same storage, with its password
        return env
    if ":***@" in url:
        raise ConfigError(f"the sweep's storage {url} needs its password: set {STORAGE_ENV} to the full URL")
    return url
