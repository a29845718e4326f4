"""``kdsweep prepare <the sweep's overrides>``: build what a sweep's trials read, before the sweep.

It composes the same command a sweep composes (``hparams_search=...``, ``teacher.logits=cache``, the data and the
models) and, in this process, tokenizes the data and builds every teacher cache its trials will read, each over
every training row (``teacher.cache.rows=all``): a cache of all rows does not depend on a trial's seed, steps or
batch size, and a trial that finds one reads it instead of building its own rows' (``teacher.job.cached_teacher``).
One cache per value of a searched knob that is part of a cache's key (``teacher.cache.*``, the loss's temperature
for ``sample`` and ``topk``, the data, the models, ``train.dtype``): a ``choice`` of them builds each; a continuous
interval is refused with the fix. It prints first what it will write, per cache, at the data's token count (bytes
per position × positions: what the files weigh), and refuses what the disk cannot hold (``teacher.build``'s check).
``--dry-run`` prints that and stops (the data is tokenized: its token count needs it).

With ``hydra/launcher=submitit_slurm`` (the sweep's own launcher settings: partition, gres, time, setup) the builds
run as one SLURM job of one task, which ``prepare`` waits for; otherwise in this process. The job's node must see the
cache directory the trials read (``teacher.cache.dir``, default ``$KDSWEEP_CACHE/teacher``).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import tempfile
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError, RunConfig

log = logging.getLogger(__name__)

KEY_KNOBS = ("teacher.", "teachers", "data.", "model.path", "model.zoo", "train.dtype", "loss.temperature",
             "loss.ignore_index")
"""Knobs whose value changes a teacher cache's key or the tokenization's (the rest only change how trials train)."""
NOT_KEY = ("teacher.cache.rows", "data.batch_size", "data.micro_batch_size", "data.eval_batch_size")
"""...except these: a prepared cache holds every row, whatever the steps read and however they are batched."""


def compose(overrides: list[str]) -> Any:
    """The job config and the sweeper's search space that ``python -m kdsweep -m OVERRIDES`` would compose."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from kdsweep.app import conf_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


def _in_key(key: str, cfg: RunConfig) -> bool:
    if not key.startswith(KEY_KNOBS) or key.startswith(NOT_KEY):
        return False
    if key == "loss.temperature":  # sample's draws and topk's log-probabilities are taken at it; full keeps logits
        return cfg.teacher.cache.method != "full" and cfg.teacher.cache.temperature is None
    return True


def points(cfg: Any, base: RunConfig) -> list[list[str]]:
    """One list of overrides per cache the sweep's trials will read: every combination of the searched knobs in a
    cache's key (a choice or an integer range; a continuous interval is refused). ``cfg``: :func:`compose`'s."""
    from kdsweep.sweep.space import parse_space

    params = dict(cfg.hydra.sweeper.get("params") or {}) if "params" in cfg.hydra.sweeper else {}
    axes = []
    for p in parse_space({k: str(v) for k, v in params.items()}):
        if not _in_key(p.key, base):
            continue
        if p.kind == "float":
            raise ConfigError(f"hydra.sweeper.params.{p.key}: a continuous interval over a knob of the teacher cache's "
                              "key needs a cache per value; search a choice(...) of values instead, or use "
                              "teacher.cache.method=full (any temperature) or teacher.logits=live")
        values = p.choices if p.kind == "categorical" else range(int(p.low), int(p.high) + 1, int(p.step or 1))
        axes.append([f"{p.key}={v}" for v in values])
    return [list(combo) for combo in itertools.product(*axes)]


def job_config(overrides: list[str], extra: list[str], where: str) -> RunConfig:
    """The RunConfig of one trial of the sweep at ``extra``, reading every row (validated as a job is)."""
    from kdsweep.app import validate_composed

    return validate_composed(compose([*overrides, *extra, "teacher.cache.rows=all"]), where)


def sizes(cfg: RunConfig) -> list[dict[str, Any]]:
    """What each teacher of ``cfg`` would write (its cache's spec at the data's positions), tokenizing the data."""
    from kdsweep.models.check import cross_tokenizer
    from kdsweep.models.load import resolve_dir
    from kdsweep.teacher.cache import Spec
    from kdsweep.teacher.job import vocab_size
    from kdsweep.train.kept import Kept
    from kdsweep.train.sources import open_data

    student_dir = resolve_dir(cfg.model)
    _, data = open_data(cfg, student_dir, Kept.one_run())
    positions = int(data.train.lengths.sum()) + int(data.eval.lengths.sum())
    out = []
    for _, view in cfg.teacher_views():
        teacher_dir = resolve_dir(view.teacher, "teacher")
        if cross_tokenizer(view):
            from kdsweep.teacher.job import cross_pair
            from kdsweep.distributed.env import device_for, single_process

            pair = cross_pair(view, teacher_dir, student_dir, data, device_for("cpu", single_process()))
            spec = Spec.of(view, pair.teacher_vocab, aligned=True)
        else:
            spec = Spec.of(view, min(vocab_size(teacher_dir), vocab_size(student_dir)))
        out.append({"teacher": str(teacher_dir), "spec": spec.describe(), "positions": positions,
                    "bytes_per_position": spec.bytes_per_position(), "bytes": positions * spec.bytes_per_position()})
    return out


def build(cfg: RunConfig) -> list[dict[str, Any]]:
    """Tokenize and build (or find) every teacher cache of ``cfg`` in this process; what each teacher's record says
    (several teachers: each one's)."""
    from kdsweep.distributed.env import device_for, single_process
    from kdsweep.train.kept import Kept
    from kdsweep.train.sources import open_sources

    dist = single_process()
    src = open_sources(cfg, dist, device_for(cfg.train.device, dist), Kept.one_run(), None)
    record = src.teacher.record
    return record["teachers"] if record.get("source") == "mixture" else [record]


class PrepareJob:
    """What the SLURM job of ``kdsweep prepare ... hydra/launcher=submitit_slurm`` runs: the same command, here."""

    def __call__(self, args: list[str]) -> None:
        main(["--here", *args])


def submit(cfg: Any, args: list[str], cache_dir: Path) -> None:
    """Run the builds as one SLURM job with the launcher's settings (one task: the builds run in one process), wait
    for it, and print what it printed."""
    from omegaconf import OmegaConf, open_dict

    from kdsweep.sweep.slurm import SlurmJobs

    with open_dict(cfg):
        cfg.hydra.launcher.update(tasks_per_node=1, nodes=1, submitit_folder=str(cache_dir / "prepare-jobs" / "%j"))
    jobs = SlurmJobs(OmegaConf.to_container(cfg.hydra.launcher, resolve=True), "kdsweep-prepare")
    jobs.preflight()
    job = jobs.submit("kdsweep-prepare", "the prepare job", PrepareJob(), args)
    print(f"prepare: SLURM job {job.job_id} builds them (log: {job.paths.stdout})", flush=True)
    try:
        job.result()
    except Exception as e:  # noqa: BLE001 - submitit raises the job's own error, or its scheduler state
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        raise ConfigError(f"the prepare job {job.job_id} failed ({lines[-1][:300] if lines else type(e).__name__}); "
                          f"see {job.paths.stdout}") from None
    for line in job.paths.stdout.read_text().splitlines():
        if line.startswith("teacher cache "):
            print(line, flush=True)


def main(args: list[str]) -> None:
    from kdsweep.teacher.check import size

    parser = argparse.ArgumentParser(prog="kdsweep prepare", description="Tokenize the data and build every teacher "
                                     "cache a sweep's trials will read, before the sweep.")
    parser.add_argument("--dry-run", action="store_true", help="print what it would write, and stop")
    parser.add_argument("-m", "--multirun", action="store_true", help="ignored: the sweep's command, as typed")
    parser.add_argument("--here", action="store_true", help="build in this process whatever hydra/launcher says")
    parser.add_argument("overrides", nargs="*", help="the sweep's overrides (hparams_search=..., teacher.logits=cache)")
    ns = parser.parse_args(args)
    overrides = list(ns.overrides)
    composed = compose(overrides)
    with tempfile.TemporaryDirectory(prefix="kdsweep-prepare-") as where:
        base = job_config(overrides, [], where)
        if base.teacher.logits != "cache":
            raise ConfigError("kdsweep prepare builds teacher caches, and this command's teacher.logits is "
                              f"{base.teacher.logits}; pass teacher.logits=cache (as the sweep will)")
        configs = [job_config(overrides, extra, where) for extra in points(composed, base)]
        plans = [(cfg, sizes(cfg)) for cfg in configs]
        for cfg, caches in plans:
            for c in caches:
                print(f"teacher cache: {c['spec']} over {c['positions']} positions: {size(c['bytes'])} "
                      f"({c['bytes']} bytes; {c['teacher']})", flush=True)
        if ns.dry_run:
            return
        if not ns.here and str(composed.hydra.launcher.get("_target_", "")).endswith(".SlurmLauncher"):
            from kdsweep.teacher.cache import cache_root

            submit(composed, overrides, cache_root(base))
            return
        for cfg, _ in plans:
            for record in build(cfg):
                state = "built" if record["built"] else "found"
                print(f"teacher cache {state}: {record['dir']}", flush=True)


__all__ = ["KEY_KNOBS", "build", "main", "points", "sizes"]
