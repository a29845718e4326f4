"""The W&B sink: one W&B run per job, grouped by study, named by trial, resumed (not restarted) after a requeue.

Online when there is an API key and the server answers; otherwise offline, kept in ``<run dir>/wandb`` for a
later ``wandb sync`` (compute nodes often have no internet). The run id is derived from the sweep and trial
(or from the run directory), so a requeued or resumed job logs into the same run, and its history never holds
a step twice: an attempt that ends cleanly (completed, pruned, preempted at a signal) notes the last step W&B
got; the next attempt sends only later steps, first replaying from metrics.jsonl those that an attempt killed
before it could finish W&B may have lost. (A killed attempt's offline file may hold some of them already:
readers of offline runs keep one row per step, and the server ignores steps it has when they are synced.)
Keys stay in the environment (WANDB_API_KEY, ~/.netrc): nothing here writes or logs them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import netrc
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kdsweep.metrics.records import write_json_atomic
from kdsweep.metrics.sinks import scalars

log = logging.getLogger(__name__)
KIND_ORDER = {"train": 0, "eval": 1}  # within a step the loop logs the train row first


def resolve_mode(requested: str) -> tuple[str, str]:
    """(online | offline | disabled, why) for ``logger.wandb.mode``."""
    if requested != "auto":
        return requested, f"logger.wandb.mode={requested}"
    env = os.environ.get("WANDB_MODE", "").lower()
    if env in ("offline", "dryrun", "disabled"):
        return ("disabled" if env == "disabled" else "offline"), f"WANDB_MODE={env}"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)
    if not os.environ.get("WANDB_API_KEY"):
        try:
            found = netrc.netrc().authenticators(host)
        except (OSError, netrc.NetrcParseError):
            found = None
        if not found:
            return "offline", "no W&B API key (WANDB_API_KEY or ~/.netrc)"
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        return "offline", f"{host} cannot be reached"
    return "online", "an API key and a reachable server"


def run_identity(cfg: Any, out: Path) -> tuple[str, str, str | None]:
    """(id, name, group): a trial's id comes from its sweep and number, a plain run's from its directory."""
    w, trial = cfg.logger.wandb, cfg.trial
    if trial.sweep_dir:
        key, name = f"{Path(trial.sweep_dir).resolve()}#{trial.number}", f"trial-{trial.number}"
    else:
        key, name = str(out.resolve()), out.name
    return "kd-" + hashlib.sha1(key.encode()).hexdigest()[:16], name, w.group or trial.study or None


def _model_name(source: Any) -> str:
    return source.zoo or Path(str(source.path)).name


class WandbSink:
    def __init__(self, cfg: Any, out: Path, config: dict[str, Any], resume_step: int = 0) -> None:
        import wandb

        w = cfg.logger.wandb
        mode, why = resolve_mode(w.mode)
        run_id, name, group = run_identity(cfg, out)
        self._state_path = out / "wandb" / "kdsweep_logged.json"
        resumed = resume_step > 0 and self._state_path.exists()  # a fresh start logs everything again
        self._last = tuple(json.loads(self._state_path.read_text())) if resumed else (-1, -1)
        teachers = [f"teacher:{_model_name(view.teacher)}" for _, view in cfg.teacher_views()]
        tags = [*w.tags, *teachers, f"student:{_model_name(cfg.model)}"]
        init = dict(project=w.project, entity=w.entity, group=group, name=name, id=run_id, resume="allow", tags=tags,
                    config=config, dir=str(out), settings=wandb.Settings(console="off", silent=True),
                    reinit="create_new")  # a pack's members: each its own run in one process, finished on its own
        try:
            self.run = wandb.init(mode=mode, **init)
        except Exception as e:  # noqa: BLE001 - wandb's errors vary (auth, server, network)
            if mode != "online":
                raise
            mode, why = "offline", f"W&B online failed: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
            self.run = wandb.init(mode=mode, **init)
        self.info = {"id": run_id, "mode": mode, "project": w.project, "entity": w.entity, "group": group,
                     "name": name, "dir": str(Path(self.run.dir).parent) if mode != "disabled" else None}
        if mode == "offline":
            log.info("W&B offline (%s): run %s is kept in %s; upload it with `wandb sync %s`", why, run_id,
                     self.info["dir"], self.info["dir"])
        else:
            log.info("W&B %s: run %s (%s)", mode, run_id, why)
        history = out / "metrics.jsonl"  # already cut back to the checkpoint being resumed
        for line in history.read_text().splitlines() if history.exists() else []:
            self.write(json.loads(line))

    def write(self, row: dict[str, Any]) -> None:
        key = (row["step"], KIND_ORDER.get(row["kind"], 2))
        if key <= self._last:  # W&B already has it from the attempt before this resume
            return
        self.run.log(scalars(row), step=row["step"])
        self._last = key

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if summary:
            self.run.summary.update(summary)
        self.run.finish()
        write_json_atomic(self._state_path, list(self._last))  # W&B has everything up to here
