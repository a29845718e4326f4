"""Which checkpoint a run resumes from, and the training settings a checkpoint must share with the run to resume it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kdsweep.checkpoint import steps as checkpoints
from kdsweep.config.schema import ConfigError, RunConfig
from kdsweep.data.dataset import data_key
from kdsweep.models.load import resolve_dir
from kdsweep.teacher.views import chat_view


def training_fingerprint(cfg: RunConfig, data_key: str) -> dict[str, Any]:
    """The settings that determine the trained weights; a checkpoint only resumes a run with the same ones.

    The data counts by ``data_key`` (the tokenization cache's key: the sources' content and every setting that
    shapes the rows) and the batch sizes, not by where the files lie. Left out: where and how the run is observed
    or laid out (output dir, logging, eval cadence, threads, device and its TF32 mode, ranks and sharding,
    checkpoint cadence),
    which by design do not change the result.
    """
    d = asdict(cfg)
    d["data"] = {"content": data_key, "batch_size": cfg.data.batch_size, "micro_batch_size": cfg.data.micro_batch_size}
    d["teacher"]["cache"].pop("dir")  # where a cache lies, like where the data lies, does not change the weights
    for key in ("eval_every", "log_every", "threads", "device", "tf32"):
        d["train"].pop(key)
    return {k: d[k] for k in ("model", "teacher", "data", "loss", "optim", "train")}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_resumable(cfg: RunConfig) -> Path | None:
    """The checkpoint this run will resume from, after checking it belongs to the same training config.

    Runs before anything is written, so a refused resume leaves the directory (and its run.json) as it was.
    """
    root = Path(cfg.output_dir) / "checkpoints"
    latest = checkpoints.latest(root)
    if latest is None:
        return None
    if not cfg.checkpoint.resume:
        raise ConfigError(
            f"checkpoint.resume=false but {root} holds checkpoints of an earlier run; kdsweep never deletes them: "
            "pass a new hydra.run.dir to start over"
        )
    saved = torch.load(latest / "state_rank0.pt", weights_only=False).get("fingerprint")
    student_dir = resolve_dir(cfg.model)
    view = chat_view(cfg)  # the key of the rows the job reads: with the teacher's readings, if any
    now = training_fingerprint(cfg, data_key(cfg.data, student_dir, cfg.loss.ignore_index,
                                             None if view is None else view.identity))
    if saved is not None and saved != now:
        a, b = _flat(saved), _flat(now)
        diff = [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise ConfigError(
            f"{cfg.output_dir} holds checkpoints of a different training config ({'; '.join(diff[:3])}); "
            "resume it unchanged, or pass another hydra.run.dir"
        )
    return latest
