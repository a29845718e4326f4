"""The Optuna side of a sweep: settings, storages, samplers, pruners. Optuna is imported lazily.

Every process that asks ``should_prune`` must build the same pruner (Optuna does not store it), so samplers and
pruners are built from the plain settings saved in the sweep's manifest, never passed around as objects.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError
from kdsweep.evaluation.downstream import task_of

SAMPLERS = ("tpe", "gp", "random", "grid")
PRUNERS = ("percentile", "median", "halving", "hyperband", "none")
PRUNER_READS = {"percentile": ("pruner_startup_trials", "pruner_warmup_steps", "pruner_grace", "pruner_percentile"),
                "median": ("pruner_startup_trials", "pruner_warmup_steps", "pruner_grace"),
                "halving": ("pruner_warmup_steps", "pruner_grace"),
                "hyperband": ("pruner_warmup_steps", "pruner_grace"), "none": ()}
"""The pruner settings each pruner reads (another one set is a knob that does nothing: SweepSettings.idle_knobs)."""
OBJECTIVES = ("student_ce", "kl", "teacher_ce")
DIRECTIONS = ("minimize", "maximize")
WORKER_SHAPE = ("dist.nproc_per_node", "train.device")
"""What a warm worker is made of: a trial cannot change it (kdsweep.worker.WorkerSession.joined)."""
NFS_TYPES = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph", "glusterfs",
             "fuse.glusterfs", "panfs", "wekafs", "afs")
"""Shared (network or cluster) filesystems: SQLite's locks are unsafe there (a sweep's jobs on other nodes write the
study), so a sweep directory on one gets a journal file by default (:func:`default_storage`)."""
MOUNTS_ENV = "KDSWEEP_MOUNTS"
"""The mounts table a filesystem's type is read from (default ``/proc/mounts``): for a test, or a node whose table
does not show the type its jobs see."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class SweepSettings:
    """What ``hydra.sweeper`` says, validated. Stored in the manifest; the trial handle rebuilds from it."""

    study_name: str = "kdsweep"
    storage: str | None = None
    """None: in the sweep directory, SQLite, or a journal file on a shared filesystem (:func:`default_storage`).
    ``journal:///abs/path.log``: a journal file. Else an SQLAlchemy URL (``postgresql+psycopg2://user@host/db``; put
    passwords in PGPASSWORD, not the URL)."""
    n_trials: int | None = None
    """The most trials the sweep asks for; None: 8, or as many as ``budget`` / ``wall_hours`` pay for when set."""
    budget: float | None = None
    """Device-hours the sweep may spend (trials' wall × ranks and warm workers' idle time, as ``cost`` counts them):
    no trial starts once what is spent and what the running trials will spend reach it (kdsweep.sweep.budget)."""
    wall_hours: float | None = None
    """Wall-clock hours of the search (every controller's run, a resume included): no trial starts that would end
    after it."""
    trial_hours: float | None = None
    """What one trial is expected to cost in device-hours (its ranks × its wall time), for the checks made before any
    trial starts: ``budget`` must pay for one (and for ``confirm.top`` search trials and the confirmation's). The
    budget's estimate until trials have finished; null: no check before, the estimate comes from the first ones."""
    confirm: dict[str, Any] | None = None
    """``{top: k, seeds: s, baseline_trials: b}`` (and ``objective`` for a study of several; top 0 or None: none):
    after the search, its k best points and the CE-only baseline (at a learning rate of its own, from b CE-only
    trials when the space searches one) are trained again with s >= 3 fresh seeds, and the sweep reports a verdict on
    the search's best with 95% intervals and Holm's correction (kdsweep.sweep.confirm). A budget reserves their
    share."""
    max_concurrent: int = 2
    pack: int | str | None = None
    """K (>= 2): the sweep asks K trials at a time and trains them as one packed job (:mod:`kdsweep.pack`: one
    student base, one teacher pass per micro-batch, each member its own trial, pruned on its own); ``max_concurrent``
    counts trials, so ``max_concurrent // K`` packs run at once. The search may change only what a pack's members set
    each their own (:data:`kdsweep.pack.job.KNOBS`), on one rank; a K the memory plan (:mod:`kdsweep.pack.plan`)
    says will not fit the device is refused. ``auto``: as many as it fits, at most ``max_concurrent`` (the sweeper
    replaces it with that number before any trial). None or 1: one job per trial."""
    sampler: str = "tpe"
    seed: int | None = 0
    pruner: str = "halving"
    """Successive halving by default: the rule ``benchmarks/sweep_async.py`` chose (with a grace period of half the
    steps it never cut the eventual best; the median and percentile rules without one did)."""
    pruner_startup_trials: int = 2
    """Trials that must finish before the median or percentile pruner prunes anything."""
    pruner_warmup_steps: int | None = None
    """The grace period: no trial is pruned before this step (median, percentile: their warm-up; halving and
    hyperband: their smallest resource, the first rung; 0: Optuna's own, from the first eval). None:
    ``pruner_grace`` of the trials' ``train.max_steps`` (:meth:`with_grace`), so it follows an override of it."""
    pruner_grace: float = 0.5
    """The grace period as a share of ``train.max_steps`` when ``pruner_warmup_steps`` is null (0: Optuna's own)."""
    pruner_percentile: float = 75.0
    """percentile pruner: stop a trial whose eval is worse than this percentile of the others' at that step
    (50 is the median pruner; 75 stops only the worst quarter, for noisy early evals)."""
    objectives: tuple[str, ...] = ("student_ce",)
    """Eval metrics to optimise, from OBJECTIVES, or an lm-eval task's headline metric, ``lm_eval/<task>`` (every
    trial scores it once it has trained: ``downstream.tasks``; no pruning when it is the first, as it has no value
    before the end); two or more make a Pareto study (no pruning then)."""
    directions: tuple[str, ...] = ("minimize",)
    retries: int = 1
    """How often a trial whose process was killed (not one that failed on its own) is restarted."""
    storage_grace_s: float = 300.0
    """How long the study's database may be away (a PostgreSQL restart, a failover) before the controller or a trial
    gives up: every storage call is retried with backoff on fresh connections until then (kdsweep.sweep.patient)."""
    poll_s: float = 0.5
    enqueue: tuple[dict[str, Any], ...] = ()
    """Points to try first, in order (known-good settings, a baseline), before the sampler proposes any."""
    params: dict[str, str] = field(default_factory=dict)
    workers: int | None = None
    """None (the default): one warm worker per slot (``max_concurrent``), unless the search changes what a worker
    is (its ranks or device: WORKER_SHAPE), then one job per trial. 0: one job per trial. N: trials run on N
    long-lived workers (at most ``max_concurrent``), each a job with the resources a trial has; a worker keeps its
    imports, process group, tokenized data and a live teacher from one trial to the next (``kdsweep.worker``)."""
    worker_idle_s: float = 600.0
    """A worker with no task for this long leaves (a controller that died and was not resumed)."""

    def __post_init__(self) -> None:
        _check(bool(re.fullmatch(r"[\w.-]+", self.study_name)),
               f"hydra.sweeper.study_name={self.study_name!r}: use letters, digits, . _ -")
        _check(self.n_trials is None or self.n_trials >= 1,
               f"hydra.sweeper.n_trials={self.n_trials} must be >= 1 (or null: as many as the budget pays for)")
        for name in ("budget", "wall_hours"):
            value = getattr(self, name)
            _check(value is None or value > 0,
                   f"hydra.sweeper.{name}={value} must be > 0 hours (or null: no limit)")
        _check(self.max_concurrent >= 1, f"hydra.sweeper.max_concurrent={self.max_concurrent} must be >= 1")
        _check(self.sampler in SAMPLERS,
               f"hydra.sweeper.sampler={self.sampler!r} is unknown; use one of {', '.join(SAMPLERS)}")
        _check(self.pruner in PRUNERS,
               f"hydra.sweeper.pruner={self.pruner!r} is unknown; use one of {', '.join(PRUNERS)}")
        _check(
            len(self.objectives) >= 1 and all(o in OBJECTIVES or task_of(o) for o in self.objectives),
            f"hydra.sweeper.objectives={list(self.objectives)}: each must be one of {', '.join(OBJECTIVES)} or "
            "lm_eval/<task> (an lm-eval task's headline metric, e.g. lm_eval/kdsweep_next_word)",
        )
        _check(
            len(self.directions) == len(self.objectives) and all(d in DIRECTIONS for d in self.directions),
            f"hydra.sweeper.directions={list(self.directions)} must give minimize or maximize for each of the "
            f"{len(self.objectives)} objectives",
        )
        wrong = [o for o, d in zip(self.objectives, self.directions) if task_of(o) and d != "maximize"]
        _check(not wrong, f"hydra.sweeper.directions={list(self.directions)}: {', '.join(wrong)} is an lm-eval task's "
               "accuracy, where higher is better; pass hydra.sweeper.directions="
               f"[{','.join('maximize' if task_of(o) else d for o, d in zip(self.objectives, self.directions))}]")
        _check(self.retries >= 0, f"hydra.sweeper.retries={self.retries} must be >= 0")
        _check(self.storage_grace_s >= 0, f"hydra.sweeper.storage_grace_s={self.storage_grace_s} must be >= 0 seconds")
        _check(self.workers is None or self.workers >= 0,
               f"hydra.sweeper.workers={self.workers} must be >= 0 (0: one job per trial; null: one worker per slot)")
        _check(self.pack in (None, "auto") or (isinstance(self.pack, int) and 1 <= self.pack <= self.max_concurrent),
               f"hydra.sweeper.pack={self.pack!r}: give the trials per packed job, from 2 to max_concurrent "
               f"({self.max_concurrent}: a pack's members are trials running at once), auto (as many as fit), or "
               "null (one job per trial)")
        _check(self.worker_idle_s > 0, f"hydra.sweeper.worker_idle_s={self.worker_idle_s} must be > 0")
        confirm = self.confirmation  # validates hydra.sweeper.confirm
        _check(self.trial_hours is None or self.trial_hours > 0,
               f"hydra.sweeper.trial_hours={self.trial_hours} must be > 0 (or null: learnt from the first trials)")
        self._check_budget(confirm)
        _check(0 < self.pruner_percentile < 100,
               f"hydra.sweeper.pruner_percentile={self.pruner_percentile} must be in (0, 100)")
        _check(0 <= self.pruner_grace < 1, f"hydra.sweeper.pruner_grace={self.pruner_grace} must be in [0, 1) "
               "(a share of train.max_steps; 0: Optuna's own grace)")
        _check(self.pruner_warmup_steps is None or self.pruner_warmup_steps >= 0,
               f"hydra.sweeper.pruner_warmup_steps={self.pruner_warmup_steps} must be >= 0 (null: pruner_grace of "
               "train.max_steps)")

    def with_grace(self, max_steps: int) -> "SweepSettings":
        """These settings with the grace period in steps: ``pruner_warmup_steps``, or ``pruner_grace`` of the trials'
        ``train.max_steps`` (at least one step; 0 stays 0: Optuna's own)."""
        if self.pruner_warmup_steps is not None:
            return self
        steps = max(1, round(self.pruner_grace * max_steps)) if self.pruner_grace > 0 else 0
        return replace(self, pruner_warmup_steps=steps)

    def _check_budget(self, confirm: Any) -> None:
        """With ``trial_hours``, before any trial: the budget pays for one trial, or for ``confirm.top`` search
        trials and the confirmation's."""
        if self.budget is None or self.trial_hours is None:
            return
        if confirm is None:
            _check(self.budget >= self.trial_hours,
                   f"hydra.sweeper.budget={self.budget:g} device-h cannot pay for one trial of "
                   f"hydra.sweeper.trial_hours={self.trial_hours:g}: raise it to "
                   f"hydra.sweeper.budget={self.trial_hours:g} or more")
            return
        need = confirm.top + confirm.trials
        _check(self.budget >= need * self.trial_hours,
               f"hydra.sweeper.confirm.top={confirm.top} is more than the trials the budget allows: {self.budget:g} "
               f"device-h pays for {int(self.budget // self.trial_hours)} trials of {self.trial_hours:g} device-h, and "
               f"{confirm.top} search trials and the confirmation's {confirm.trials} need {need}: raise it to "
               f"hydra.sweeper.budget={need * self.trial_hours:.4g} or lower hydra.sweeper.confirm.top")

    def idle_knobs(self) -> list[str]:
        """A line for each pruner setting given that this sweep's pruner does not read (the sweeper warns of it)."""
        pruner = self.pruner if self.prunes else "none"
        why = (f"hydra.sweeper.pruner={pruner}" if self.prunes else "a study of several objectives (no pruning)"
               if self.multi_objective else f"the objective {self.objectives[0]} (no pruning: no value before the end)")
        defaults = {f.name: f.default for f in fields(self)}
        return [f"hydra.sweeper.{name}={getattr(self, name)} does nothing with {why}"
                for name in PRUNER_READS["percentile"]
                if getattr(self, name) != defaults[name] and name not in PRUNER_READS[pruner]]

    @classmethod
    def from_plain(cls, values: dict[str, Any]) -> "SweepSettings":
        """From plain data (Hydra's container, the manifest's JSON), where tuples arrive as lists."""
        tuples = {k: tuple(values.get(k) or ()) for k in ("objectives", "directions", "enqueue") if k in values}
        return cls(**{**values, **tuples})

    def reshaping_keys(self) -> list[str]:
        """The searched or enqueued keys that change what a warm worker is (its ranks, its device)."""
        keys = set(self.params) | {k for point in self.enqueue for k in point}
        return sorted(k for k in keys if k in WORKER_SHAPE)

    @property
    def pool_size(self) -> int:
        """How many warm workers run the trials (each one job at a time: a trial, or a pack); 0: a job per trial."""
        if self.workers is None:
            return 0 if self.reshaping_keys() else self.jobs_at_once
        return min(self.workers, self.jobs_at_once)

    @property
    def jobs_at_once(self) -> int:
        """How many jobs run at once: ``max_concurrent`` trials, ``pack`` of them to a job."""
        return max(1, self.max_concurrent // self.pack_size)

    @property
    def pack_size(self) -> int:
        """Trials per job: ``pack`` (once ``auto`` is resolved), 1 without packing."""
        return self.pack if isinstance(self.pack, int) else 1

    @property
    def trial_limit(self) -> float:
        """The most trials to ask for: ``n_trials``; when it is null, 8 without a budget, else no count."""
        if self.n_trials is not None:
            return self.n_trials
        return float("inf") if self.budget is not None or self.wall_hours is not None else 8

    @property
    def confirmation(self) -> Any:
        """``confirm`` validated (a :class:`~kdsweep.sweep.confirm.ConfirmSettings`), or None."""
        from kdsweep.sweep.confirm import ConfirmSettings

        return ConfirmSettings.of(self.confirm, self.objectives, self.trial_limit, tuple(self.params))

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def prunes(self) -> bool:
        """Whether trials report their evaluations to the study and may be pruned: one objective, which a trial's
        evaluations measure as it trains (Optuna prunes no study of several; an lm-eval task is scored once, at a
        trial's end)."""
        return not self.multi_objective and task_of(self.objectives[0]) is None

    def downstream_tasks(self, also: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The lm-eval tasks a trial scores for the sweep: those its objectives name, and those of the second
        measures ``also`` (a confirmation seed's: ``confirm.also``, as its plan keeps them)."""
        tasks = [t for t in map(task_of, (*self.objectives, *also)) if t]
        return tuple(dict.fromkeys(tasks))


def redact(url: str | None) -> str | None:
    """The URL with any password replaced by ***, for logs and saved configs."""
    return None if url is None else re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", url)


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (longest mount point that contains it; ``path`` or the nearest
    of its parents that exists)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    best, kind = "", ""
    for line in Path(os.environ.get(MOUNTS_ENV) or "/proc/mounts").read_text().splitlines():
        parts = line.split()
        inside = str(path) == parts[1] or str(path).startswith(parts[1].rstrip("/") + "/") if len(parts) >= 3 else False
        if inside and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


def default_storage(sweep_dir: Path) -> tuple[str, str]:
    """The storage of a sweep that names none, and why: the one its directory already holds (a resumed sweep, the
    dashboard), else on a shared filesystem (:data:`NFS_TYPES`) a journal file, whose lock (a hard link, Optuna's
    default) is atomic on NFS where SQLite's are not, else SQLite."""
    sweep_dir = sweep_dir.resolve()
    db, journal = sweep_dir / "optuna.db", sweep_dir / "optuna.journal"
    if journal.exists() or db.exists():
        return (f"journal://{journal}", "a journal file (the sweep's own)") if journal.exists() else (
            f"sqlite:///{db}", "SQLite (the sweep's own)")
    fs = _filesystem_type(sweep_dir)
    if fs in NFS_TYPES:
        why = f"a journal file: the sweep directory is on {fs}, where SQLite's locks are unsafe"
        return f"journal://{journal}", why
    return f"sqlite:///{db}", f"SQLite: the sweep directory is on {fs or 'a local disk'}"


def storage_url(settings: SweepSettings, sweep_dir: Path) -> str:
    """The storage a sweep uses, as a string that the jobs can rebuild it from."""
    return settings.storage or default_storage(sweep_dir)[0]


def make_storage(url: str, grace_s: float = 300.0) -> Any:
    """An Optuna storage for ``url``; one clear line when it is on NFS (SQLite) or cannot be reached. A database
    storage's calls outlive an outage of up to ``grace_s`` seconds (:mod:`kdsweep.sweep.patient`)."""
    import optuna

    if url.startswith("journal://"):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal://"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        path = Path(url[len("sqlite:///"):])
        fs = _filesystem_type(path.parent)
        if fs in NFS_TYPES:
            raise ConfigError(
                f"hydra.sweeper.storage={url} is a SQLite file on {fs}, which corrupts under parallel writers; "
                "use a journal file (journal:///path/study.log) or PostgreSQL (postgresql+psycopg2://user@host/db)"
            )
    try:
        from kdsweep.sweep.patient import PatientRDBStorage

        return PatientRDBStorage(url, grace_s)
    except Exception as e:  # SQLAlchemy's errors vary by driver: say what failed, without the password
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"hydra.sweeper.storage={redact(url)} cannot be reached ({first[:200]}); check the URL and that the "
            "database server is up"
        ) from None


def make_sampler(settings: SweepSettings, space: list[Any], resumed_trials: int = 0) -> Any:
    """The sweep's sampler. A resumed sweep seeds it past the trials it already has: the same seed again would
    propose the same points again."""
    import optuna

    seed = None if settings.seed is None else settings.seed + resumed_trials

    if settings.sampler == "tpe":
        # constant_liar: trials still running count as bad guesses, so concurrent asks do not all land together
        return optuna.samplers.TPESampler(seed=seed, constant_liar=settings.max_concurrent > 1)
    if settings.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed)  # needs scipy once past its random start-up trials
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.GridSampler({p.key: p.values() for p in space}, seed=seed)


def cache_bias_line(cache_method: str | None, params: dict[str, Any]) -> str | None:
    """A warning for a search over ``kd_ratio`` whose trials train from a ``sample`` or ``topk`` teacher cache: the
    higher ``kd_ratio``, the further such a trial lands from the live teacher's (benchmarks/cache_kd_ratio.py: sample
    +0.006 / +0.017 / +0.029 held-out CE at kd_ratio 0.5 / 0.8 / 1.0, topk +0.065 / +0.13 / +0.70; full: equal), so
    the search ranks high ``kd_ratio`` too low. None: no such bias (a live teacher, ``full``, or no kd_ratio)."""
    if cache_method not in ("sample", "topk") or "kd_ratio" not in params:
        return None
    return (f"the search over kd_ratio trains from teacher.cache.method={cache_method}, which trains high kd_ratio "
            "worse than the live teacher does (benchmarks/cache_kd_ratio.py) and ranks it too low: use "
            "teacher.cache.method=full where it fits on disk, or train the winner again with the live teacher")


def make_pruner(settings: SweepSettings) -> Any:
    import optuna

    if settings.pruner == "none" or not settings.prunes:
        return optuna.pruners.NopPruner()
    if settings.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=settings.pruner_startup_trials, n_warmup_steps=settings.pruner_warmup_steps or 0
        )
    if settings.pruner == "percentile":
        return optuna.pruners.PercentilePruner(
            settings.pruner_percentile, n_startup_trials=settings.pruner_startup_trials,
            n_warmup_steps=settings.pruner_warmup_steps or 0,
        )
    grace = settings.pruner_warmup_steps or "auto"  # auto: Optuna's, from the first trial's steps
    if settings.pruner == "halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=grace, reduction_factor=3)
    return optuna.pruners.HyperbandPruner(min_resource=settings.pruner_warmup_steps or 1, reduction_factor=3)
