"""The async sweep controller: keep ``max_concurrent`` trials running, refill a slot the moment it frees.

The controller is the single writer of trial states (ask/tell); jobs only report intermediate values. A trial
that fails is recorded FAIL with its reason and the sweep goes on; a trial whose process was killed is
restarted in its own directory (it resumes from its checkpoint) up to ``retries`` times. Every change is
written to the manifest first, so a controller killed at any point is resumed by rerunning the same command.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Protocol

from kdsweep.metrics.records import read_run
from kdsweep.sweep import confirm
from kdsweep.sweep.budget import Budget
from kdsweep.sweep.cost import cost_lines, sweep_cost
from kdsweep.sweep.judge import Outcome, judge
from kdsweep.sweep.local import LocalProcesses
from kdsweep.sweep.manifest import FINAL, STORAGE_ENV, Manifest, connect_url
from kdsweep.sweep.space import Param, holds
from kdsweep.sweep.study import SweepSettings, default_storage, make_pruner, make_sampler, make_storage
from kdsweep.sweep.summary import job_name, summary_lines

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Where trial jobs run."""

    def start(self, args: list[str], run_dir: Path, alone: bool = False) -> dict[str, Any]:
        """Start ``python -m kdsweep ARGS``; return what identifies the job (saved in the manifest), with
        ``logs``: the files its output goes to. ``alone``: no other trial runs until this one says its teacher
        cache is ready (it may use what the others would)."""

    def poll(self, job: dict[str, Any]) -> int | None | str:
        """None while running; else the exit code, or a word for a job that ended without one: "gone" (it
        vanished) or the scheduler's state ("CANCELLED", "TIMEOUT", ...)."""

    def find(self, args: list[str], run_dir: Path) -> dict[str, Any] | None:
        """The trial's job, if one was started (running or ended) that the manifest does not know of: what
        ``start`` would have returned for it, else None."""

    def release_idle(self, why: str) -> None:
        """Nothing may start now (``why``: until the budget frees, or the controller stopped with an error): what
        the backend holds idle goes (an idle warm worker leaves; a later start brings up a new one), so that it
        stops costing device time."""

    def close(self) -> None:
        """The sweep is over (no trial runs): release what the backend holds (warm workers leave)."""


class Controller:
    def __init__(self, settings: SweepSettings, space: list[Param], base_overrides: list[str], sweep_dir: Path,
                 backend: Backend, teacher_cache: bool = False) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # the controller logs what happens to each trial
        self.settings, self.space, self.base = settings, space, base_overrides
        self.sweep_dir, self.backend = sweep_dir, backend
        sweep_dir.mkdir(parents=True, exist_ok=True)
        chosen = None if settings.storage else default_storage(sweep_dir)  # SQLite, or a journal on a shared FS
        url = connect_url(settings, sweep_dir)  # a resumed command holds user:***@: the password from the env
        # unreachable: one line, before the sweep directory holds anything
        storage = make_storage(url, settings.storage_grace_s)
        self.manifest = Manifest.open(sweep_dir, settings, [p.describe() for p in space], base_overrides)
        if chosen and "storage" not in self.manifest.data:  # what the default chose for this sweep, and why
            self.manifest.data["storage"] = {"url": chosen[0], "why": chosen[1]}
            self.manifest.save()
            log.info("storage: %s (%s)", chosen[1], chosen[0])
        os.environ[STORAGE_ENV] = url  # jobs get the storage (and any password) from their environment only
        self.study = optuna.create_study(
            study_name=settings.study_name, storage=storage, load_if_exists=True,
            sampler=make_sampler(settings, space, resumed_trials=len(self.manifest.trials)),
            pruner=make_pruner(settings), directions=list(settings.directions),
        )
        self.distributions = {p.key: p.distribution() for p in space}
        # a search on the teacher cache: its confirmation seeds (the live teacher) are priced apart
        self.budget = Budget(self.manifest, settings.budget, settings.wall_hours, settings.trial_hours, teacher_cache,
                             settings.pack_size)
        self._wall_saved = 0.0
        self.confirm = settings.confirmation
        self.pack = settings.pack_size  # trials per job (hydra.sweeper.pack)
        self.start_failures = 0
        # teacher.logits=cache: one trial builds the cache (or finds it) before the others start (see _slots)
        self.cache_ready, self._gate_logged = not teacher_cache, False
        if not self.manifest.trials:  # a new sweep: the given points go first
            for point in settings.enqueue:
                self.study.enqueue_trial(dict(point))
        self._adopt_orphans()

    # -- the search, then its confirmation -----------------------------------------------------------------
    def _search_trials(self) -> list[dict[str, Any]]:
        return [e for e in self.manifest.trials.values() if not e.get("confirm")]

    def _search_may_ask(self) -> bool:
        if "confirmation" in self.manifest.data:
            return False
        reserve, seeds = (self.confirm.trials, self.confirm.seed_trials) if self.confirm else (0, 0)
        return (len(self._search_trials()) < self.settings.trial_limit
                and self.budget.allows(reserve, self.settings.max_concurrent, seeds))

    def _confirmation_item(self) -> dict[str, Any] | None:
        """The next confirmation trial to ask: the plan is made once no search trial runs (and none may start)."""
        if self.confirm is None:
            return None
        if "confirmation" not in self.manifest.data:
            if any(e["state"] not in FINAL for e in self._search_trials()):
                return None
            self.manifest.data["confirmation"] = confirm.plan(
                self._search_trials(), self.confirm, self.settings.objectives, self.settings.directions,
                self.distributions, self.settings.seed)
            counted = len(self._search_trials()) >= self.settings.trial_limit  # else the budget's limits ended it
            self.manifest.data["confirmation"]["search_ended_by"] = (
                "hydra.sweeper.n_trials" if counted else "the budget (its confirmation's reserve included)")
            if self.budget.device_s is not None:  # what the search left, and what each confirmation trial should cost
                self.manifest.data["confirmation"]["search_ended"] = {
                    "device_seconds_spent": self.budget.device_spent(),
                    "trial_device_seconds": self.budget.reserved_trial(),
                    "seed_device_seconds": self.budget.seed_trial(), "priced_apart": self.budget.apart}
            self.manifest.save()
            points = self.manifest.data["confirmation"]["points"]
            log.info("confirmation: %d points (%s) × %d seeds", len(points),
                     ", ".join(p["label"] for p in points), self.confirm.seeds)
        plan, trials = self.manifest.data["confirmation"], list(self.manifest.trials.values())
        if confirm.settle_baseline(plan, trials):  # the CE-only learning-rate trials have ended: its seeds may start
            self.manifest.save()
            log.info("confirmation: %s", confirm.baseline_text(plan))
        item = confirm.next_item(plan, trials)
        if item is None and (pair := self._more_seeds(plan)):
            confirm.add_seeds(plan, pair)
            self.manifest.save()
            log.info("confirmation: the budget leaves room for one more seed of top1 and CE-only")
            item = confirm.next_item(plan, trials)
        return item

    def _more_seeds(self, plan: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The next seed of top1 and CE-only, when what a budget that ended the search leaves, once every planned
        confirmation trial has started, buys it (``confirm.more_seeds`` at most); else None."""
        if (plan.get("search_ended_by", "hydra.sweeper.n_trials") == "hydra.sweeper.n_trials"
                or plan.get("more_seeds", 0) >= self.confirm.more_seeds or confirm.baseline_pending(plan)
                or not plan["points"]):
            return None
        pair = confirm.more_seeds(plan)
        return pair if self.budget.allows_more([i["label"] for i in pair]) else None

    def _waits_on_trials(self) -> bool:
        """Whether a running trial's end brings work other than what the budget may free: the confirmation's plan
        (made once the search's trials have ended) or the CE-only baseline's seeds (once its learning rate is
        settled). Else nothing may start until the budget allows it, and idle workers are only spending it."""
        plan = self.manifest.data.get("confirmation")
        if plan is None:
            return self.confirm is not None and any(e["state"] not in FINAL for e in self._search_trials())
        return confirm.baseline_pending(plan)

    def _note_cut(self) -> None:
        """The sweep ends with confirmation trials never asked: the budget left no room for them (the verdict says)."""
        plan = self.manifest.data.get("confirmation")
        if plan is not None and confirm.next_item(plan, list(self.manifest.trials.values())) is not None:
            plan["cut"] = "the device budget was spent"
            log.warning("confirmation: the device budget was spent before all of its trials could start")

    def _verdict(self) -> None:
        if "confirmation" not in self.manifest.data:
            return
        verdict = confirm.verdict(self.manifest.data["confirmation"], list(self.manifest.trials.values()),
                                  self.settings.objectives)
        self.manifest.data["verdict"] = verdict
        self.study.set_user_attr("verdict", verdict["line"])  # optuna-dashboard shows the study's user attributes
        self.study.set_user_attr("confirmation", json.loads(json.dumps(verdict["points"], default=str)))
        log.info("verdict: %s", verdict["line"])

    def _adopt_orphans(self) -> None:
        """Trials the study has but the manifest does not: a controller died between ask and saving the trial, so
        no job ever ran. Each is saved as asked (its point completed if ask was cut short) and starts now: its
        number and the budget stay as they were."""
        from optuna.trial import Trial, TrialState

        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if str(t.number) not in self.manifest.trials:
                item = t.user_attrs.get("confirm")
                if item is None:
                    trial = Trial(self.study, t._trial_id)
                    params = {name: trial._suggest(name, d) for name, d in self.distributions.items()}  # sampled stay
                else:  # a confirmation trial: its point is the plan's
                    params = self._point(item)
                self._save_asked(t.number, t._trial_id, params, item)
                log.warning("trial %d was asked but never started (the controller died): starting it now", t.number)

    # -- one trial ---------------------------------------------------------------------------------------
    def _args(self, number: int, params: dict[str, Any], item: dict[str, Any] | None = None) -> list[str]:
        run_dir = self.sweep_dir / str(number)
        # a confirmation seed: its own training (order, init, dropout) and rollout draws, the live teacher and the
        # test split (confirm.UNBIASED); the CE-only learning-rate trials (seed None) run as the search's do
        seeded = item and item["seed"] is not None
        seed = [f"train.seed={item['seed']}", f"rollout.seed={item['seed']}", *confirm.UNBIASED] if seeded else []
        tasks = self.settings.downstream_tasks(self._also(item))  # what its objectives and measures need
        scored = [f"downstream.tasks=[{','.join(tasks)}]"] if tasks else []
        return [*self.base, *(f"{k}={v}" for k, v in params.items()), *seed, *scored,
                f"trial.sweep_dir={self.sweep_dir}", f"trial.number={number}",
                f"trial.study={self.settings.study_name}", f"hydra.run.dir={run_dir}"]

    def _start_all(self, numbers: list[int]) -> None:
        """Start asked trials: one job, or (``hydra.sweeper.pack``, more than one) one packed job for all."""
        if len(numbers) == 1:
            self._start(numbers[0])
        elif numbers:
            self._start_pack(numbers)

    def _start_pack(self, numbers: list[int]) -> None:
        """Start trials as one packed job (``python -m kdsweep --pack DIR``, DIR/pack.json: each member's arguments):
        every member's manifest entry says its pack, and the pack's job is each member's job."""
        from kdsweep.config.schema import ConfigError
        from kdsweep.metrics.records import write_json_atomic
        from kdsweep.pack.jobs import SPEC

        pack_dir = self.sweep_dir / "packs" / str(numbers[0])
        pack_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(pack_dir / SPEC, {"numbers": numbers,
                                            "members": [self.manifest.trial(n)["args"] for n in numbers]})
        pack = {"dir": str(pack_dir), "members": numbers}
        for number in numbers:  # the intent first, as for one trial's job
            entry = self.manifest.trial(number)
            self.manifest.put(number, state="STARTING", job=None, attempts=entry.get("attempts", 0) + 1, pack=pack,
                              started=entry.get("started") or time.time())
        crash_point("before_launch", numbers[0], self._confirm_tag(self.manifest.trial(numbers[0])))
        try:
            job = self.backend.start(pack_args(pack_dir), pack_dir, alone=not self.cache_ready)
        except ConfigError as e:  # the scheduler refused the pack's job: every member fails, the sweep goes on
            self.start_failures += 1
            for number in numbers:
                self.manifest.put(number, job=None, attempts=self.manifest.trial(number)["attempts"] - 1)
                self._record(number, Outcome("FAIL", reason=str(e)), exit_code=None)
            if self.start_failures >= 3:
                raise ConfigError(f"{self.start_failures} jobs in a row could not be submitted ({e}); fix it and "
                                  f"run `kdsweep resume {self.sweep_dir}`") from None
            return
        crash_point("after_launch", numbers[0], self._confirm_tag(self.manifest.trial(numbers[0])))
        self.start_failures = 0
        for number in numbers:
            self.manifest.put(number, state="RUNNING", job={**job, "pack": numbers[0]}, last_start=time.time())
        crash_point("after_write", numbers[0], self._confirm_tag(self.manifest.trial(numbers[0])))
        log.info("trials %s started as one pack (%s): %s", ", ".join(map(str, numbers)), job_name(job), "; ".join(
            " ".join(f"{k}={v}" for k, v in self.manifest.trial(n)["params"].items()) for n in numbers))

    def _start(self, number: int) -> None:
        from kdsweep.config.schema import ConfigError

        entry = self.manifest.trial(number)
        entry.pop("pack", None)  # a pack's member started again alone: its own job now
        attempts = entry.get("attempts", 0)
        # the intent first: a controller that dies from here on finds the trial STARTING, and looks for its job
        self.manifest.put(number, state="STARTING", job=None, attempts=attempts + 1,
                          started=entry.get("started") or time.time())
        tag = self._confirm_tag(entry)
        crash_point("before_launch", number, tag)
        try:
            job = self.backend.start(entry["args"], Path(entry["run_dir"]), alone=not self.cache_ready)
        except ConfigError as e:  # the scheduler refused this job: the trial fails, the sweep goes on ...
            self.start_failures += 1
            self.manifest.put(number, job=None, attempts=attempts)
            self._record(number, Outcome("FAIL", reason=str(e)), exit_code=None)
            if self.start_failures >= 3:  # ... unless nothing can start at all
                raise ConfigError(f"{self.start_failures} trials in a row could not be submitted ({e}); fix it and "
                                  f"run `kdsweep resume {self.sweep_dir}`") from None
            return
        crash_point("after_launch", number, tag)
        self.start_failures = 0
        self.manifest.put(number, state="RUNNING", job=job, last_start=time.time())
        crash_point("after_write", number, tag)
        log.info("trial %d started (%s): %s", number, job_name(job),
                 " ".join(f"{k}={v}" for k, v in entry["params"].items()))

    def _confirm_tag(self, entry: dict[str, Any]) -> str | None:
        """``confirm<k>`` for the plan's k-th confirmation trial (0-based; :data:`CRASH_AT` names it), else None."""
        item = entry.get("confirm")
        if not item:
            return None
        items = self.manifest.data["confirmation"]["items"]
        k = next(k for k, i in enumerate(items) if (i["label"], i["seed"]) == (item["label"], item["seed"]))
        return f"confirm{k}"

    def _save_asked(self, number: int, trial_id: int, params: dict[str, Any],
                    item: dict[str, Any] | None = None) -> None:
        run_dir = self.sweep_dir / str(number)
        self.manifest.put(number, params=params, args=self._args(number, params, item), run_dir=str(run_dir),
                          state="ASKED", attempts=0, **({"confirm": item} if item else {}))
        self.study._storage.set_trial_user_attr(trial_id, "run_dir", str(run_dir))

    def _ask(self, item: dict[str, Any] | None = None) -> int:
        """Ask the sampler for a point, or, for a confirmation ``item``, the trial of its point and seed (put in the
        study's queue first, unless a controller that died after queueing it left it there); save it, ASKED, and
        return its number."""
        if item is None:
            trial = self.study.ask(self.distributions)
            self._save_asked(trial.number, trial._trial_id, trial.params)
            return trial.number
        waiting = self._confirmation_queue()
        if waiting:  # queued by a controller that died before asking it
            item = waiting[0].user_attrs["confirm"]
        # the study is told the point's values its space holds (CE-only's kd_ratio=0 may lie outside a searched
        # choice or interval); the trial runs the whole point, as the plan has it
        point = self._point(item)
        held = {k: v for k, v in point.items() if k in self.distributions and holds(self.distributions[k], v)}
        if not waiting:
            self.study.enqueue_trial(held, user_attrs={"confirm": item})
        trial = self.study.ask({k: self.distributions[k] for k in held})
        self._save_asked(trial.number, trial._trial_id, point, item)
        return trial.number

    def _ask_some(self, most: int) -> list[int]:
        """Ask up to ``most`` trials that may start now (the search's, else the confirmation's): one, or a pack's.
        A pack's confirmation trials share their seed (the points and the baseline on the same batches: a paired
        comparison), and a pack holds the search's trials or the confirmation's, never both."""
        asked: list[int] = []
        while len(asked) < most:
            if self._search_may_ask():
                asked.append(self._ask())
                continue
            if asked and not self.manifest.trial(asked[0]).get("confirm"):
                break  # the search's last trials: the confirmation is planned once they have ended
            item = self._confirmation_item()
            if item is None or not self.budget.allows_reserved(seed=item["seed"] is not None):
                break
            if asked and item["seed"] != self.manifest.trial(asked[0])["confirm"]["seed"]:
                break
            asked.append(self._ask(item))
        return asked

    def _confirmation_queue(self) -> list[Any]:
        """The study's WAITING confirmation trials, once the search's unasked points are closed: ``study.ask`` takes
        the oldest WAITING trial, and a confirmation trial must not be given a search point's place."""
        from optuna.trial import TrialState

        self._close_unasked()
        return self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))

    def _close_unasked(self) -> None:
        """The search has ended: a point the user enqueued (``hydra.sweeper.enqueue``) that it never asked is closed
        as FAIL, with its reason (not left WAITING in the study). Confirmation trials are kept."""
        from optuna.trial import TrialState

        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        unasked = [t for t in waiting if "confirm" not in t.user_attrs]
        for t in unasked:
            self.study._storage.set_trial_user_attr(t._trial_id, "reason", "never ran: the search ended first")
            self.study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
        if unasked:
            log.info("search: %d enqueued point(s) never ran (the search ended first): %s", len(unasked),
                     "; ".join(" ".join(f"{k}={v}" for k, v in t.params.items()) for t in unasked))

    def _also(self, item: dict[str, Any] | None) -> tuple[str, ...]:
        """The second measures a confirmation seed's trial is scored on, as the confirmation's plan keeps them (a
        resumed sweep goes on with its plan's); none for any other trial."""
        if not item or item.get("seed") is None:
            return ()
        return tuple((self.manifest.data.get("confirmation") or {}).get("also", ()))

    def _point(self, item: dict[str, Any]) -> dict[str, Any]:
        """The params of a confirmation item's point (the plan's)."""
        return confirm.point_params(self.manifest.data["confirmation"], item["label"])

    def _judge(self, number: int, exit_code: int | str) -> Outcome:
        entry = self.manifest.trial(number)
        outcome = judge(Path(entry["run_dir"]), exit_code, self.settings.objectives, entry["attempts"],
                        self.settings.retries, entry["job"].get("logs", []),
                        also=self._also(entry.get("confirm")))
        if outcome.state == "RETRY":
            log.warning("trial %d: %s", number, outcome.reason)
        else:
            self._record(number, outcome, exit_code)
        return outcome

    def _finish(self, number: int, exit_code: int | str) -> None:
        """A job has ended: its trials are judged (a pack's members each from its own record), and those that
        were interrupted start again, from their checkpoints (a pack's as one pack again)."""
        entry = self.manifest.trial(number)
        if not entry.get("pack"):
            if self._judge(number, exit_code).state == "RETRY":
                self._start(number)
            return
        members = [n for n in entry["pack"]["members"] if self.manifest.trial(n)["state"] == "RUNNING"
                   and self.manifest.trial(n)["job"] == entry["job"]]
        again = [n for n in members if self._judge(n, member_exit(self.manifest.trial(n), exit_code)).state == "RETRY"]
        self._start_all(again)

    def _record(self, number: int, outcome: Outcome, exit_code: int | str | None) -> None:
        from optuna.trial import TrialState

        trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        if outcome.reason:
            self.study._storage.set_trial_user_attr(trial_id, "reason", outcome.reason)
        if outcome.test:  # a confirmation trial's objectives on the test split (the dashboard shows them)
            self.study._storage.set_trial_user_attr(trial_id, "test", outcome.test)
        if outcome.also:  # a confirmation trial's second measures
            self.study._storage.set_trial_user_attr(trial_id, "also", outcome.also)
        state = {"COMPLETE": TrialState.COMPLETE, "PRUNED": TrialState.PRUNED, "FAIL": TrialState.FAIL}[outcome.state]
        self.study.tell(number, values=outcome.values if outcome.state == "COMPLETE" else None, state=state,
                        skip_if_finished=True)
        self.manifest.put(number, state=outcome.state, values=outcome.values, reason=outcome.reason,
                          ended=time.time(), exit_code=exit_code, **({"test": outcome.test} if outcome.test else {}),
                          **({"also": outcome.also} if outcome.also else {}))
        shown = f"{outcome.values}" if outcome.values else outcome.reason
        log.info("trial %d %s %s", number, outcome.state, shown)

    def _jobs(self, running: list[int]) -> int:
        """How many jobs these trials run in: a packed job's members count once."""
        return len({(self.manifest.trial(n).get("pack") or {}).get("dir", n) for n in running})

    def _slots(self, running: list[int]) -> int:
        """How many jobs may run now: ``max_concurrent`` trials (in packs: ``max_concurrent // pack`` jobs), or one
        job until a trial's teacher cache is ready, so that exactly one teacher pass runs however many trials wait
        for it (the trial that builds it, or finds it built, writes ``teacher_targets.ready`` into its run.json once
        the cache is in place). The others may start a little before: when the build should end within the time a
        trial takes to start (the builder's own start-up, measured), they start now and find the cache ready as they
        need it (the build holds its lock till then)."""
        if not self.cache_ready:
            for entry in self.manifest.trials.values():
                targets = read_run(entry["run_dir"]).get("teacher_targets") or {}
                if targets.get("ready"):
                    self.cache_ready = True
                    log.info("teacher cache ready (trial %d): the other trials start and read it", entry["number"])
                    break
                if targets.get("building") and targets.get("eta_s", math.inf) <= targets.get("startup_s", 0.0):
                    self.cache_ready = True
                    log.info("teacher cache: trial %d's build ends in about %.0f s, the time a trial takes to start: "
                             "the other trials start now", entry["number"], targets["eta_s"])
                    break
        if self.cache_ready:
            return self.settings.jobs_at_once
        builder = [e["number"] for e in self.manifest.trials.values() if e["state"] == "RUNNING"]
        if builder and not self._gate_logged:
            self._gate_logged = True
            log.info("teacher cache: trial %d builds it (or finds it built); the other trials wait for it", builder[0])
        return 1  # (a pack's members read the cache its first member builds)

    # -- the loop ------------------------------------------------------------------------------------------
    def _reconcile(self, number: int) -> None:
        """A trial the last controller was starting when it died: adopt its job if it was launched (alive, or
        ended with a record), else start it; either way it runs once. A pack's members are reconciled together."""
        entry = self.manifest.trial(number)
        pack = entry.get("pack")
        numbers = [n for n in pack["members"] if self.manifest.trial(n)["state"] == "STARTING"] if pack else [number]
        run_dir = Path(pack["dir"]) if pack else Path(entry["run_dir"])
        job = self.backend.find(pack_args(run_dir) if pack else entry["args"], run_dir)
        if job is not None:
            for n in numbers:
                self.manifest.put(n, state="RUNNING", job={**job, "pack": numbers[0]} if pack else job,
                                  last_start=time.time())
            log.info("%s (%s), launched before the last controller died", f"trials {', '.join(map(str, numbers))}: "
                     "adopted their pack's job" if pack else f"trial {number}: adopted its job", job_name(job))
            return
        ran = [n for n in numbers if (Path(self.manifest.trial(n)["run_dir"]) / "run.json").exists()]
        if ran:  # it ran, and ended while no controller watched: judge what it left
            for n in numbers:
                self.manifest.put(n, state="RUNNING", job={"unwatched": True, "logs": [str(run_dir / "job.log")],
                                                           **({"pack": numbers[0]} if pack else {})})
            self._finish(numbers[0], "gone")
            return
        for n in numbers:  # it never started
            self.manifest.put(n, attempts=max(0, self.manifest.trial(n).get("attempts", 1) - 1))
        self._start_all(numbers)

    def _keep_wall(self) -> None:
        """Every 10 s, the wall time spent into the manifest (a resume continues the wall-clock limit from it)."""
        if time.time() - self._wall_saved >= 10.0:
            self._wall_saved = time.time()
            self.budget.keep_wall()

    def run(self) -> Manifest:
        try:
            self._run_trials()
        except BaseException:  # a bug, a refusal, Ctrl-C: running trials go on (`kdsweep resume` adopts them) ...
            try:  # ... but idle workers, which hold their devices, leave now rather than after worker_idle_s
                self.backend.release_idle("the controller stopped with an error")
            except Exception as e:  # never in place of the error that stopped the controller
                log.warning("the idle workers were not told to leave: %s", e)
            raise
        self._close_unasked()  # a sweep without confirmation leaves no enqueued point WAITING either
        self.backend.close()
        self._verdict()
        if self.budget.limited:
            self.manifest.data["budget"] = self.budget.record()
            log.info("budget: %.0f device-s spent of %s", self.manifest.data["budget"]["device_seconds_spent"],
                     "no device limit" if self.settings.budget is None else f"{self.settings.budget * 3600:.0f}")
        self.budget.keep_wall()
        self.manifest.data["cost"] = sweep_cost(self.manifest)
        self.manifest.save()
        for line in cost_lines(self.manifest.data["cost"]):
            log.info(line)
        return self.manifest

    def _run_trials(self) -> None:
        """Start, watch and end trials (the search's, then its confirmation's) until none runs and none may start."""
        entries = sorted(self.manifest.trials.values(), key=lambda e: e["number"])
        asked = [e["number"] for e in entries if e["state"] == "ASKED"]  # the controller died between ask and start
        for i in range(0, len(asked), self.pack):
            self._start_all(asked[i:i + self.pack])
        for entry in entries:
            if entry["state"] == "STARTING":  # (a pack's members: the first reconciles them all)
                self._reconcile(entry["number"])
        while True:
            for number in [int(n) for n, e in self.manifest.trials.items() if e["state"] == "RUNNING"]:
                entry = self.manifest.trial(number)
                if entry["state"] != "RUNNING":
                    continue  # a pack's member, judged with its pack this round
                code = self.backend.poll(entry["job"])
                if code is not None:
                    self._finish(number, code)
            running = [int(n) for n, e in self.manifest.trials.items() if e["state"] == "RUNNING"]
            while self._jobs(running) < self._slots(running):
                numbers = self._ask_some(self.pack)
                if not numbers:
                    if running and not self._waits_on_trials():
                        self.backend.release_idle("no trial may start until the budget allows it")
                    break
                self._start_all(numbers)
                running += numbers
            if not running:
                self._note_cut()
                break
            self._keep_wall()
            time.sleep(self.settings.poll_s)


def pack_args(pack_dir: Path) -> list[str]:
    """A packed job's arguments: ``python -m kdsweep --pack DIR`` (its members' in DIR/pack.json)."""
    return ["--pack", str(pack_dir)]


def member_exit(entry: dict[str, Any], exit_code: int | str) -> int | str:
    """What a packed job's end means for one member, as its own job's exit would have: 0 for a member whose record
    says it completed or was pruned (the pack may have gone on, and failed or been killed, after it left); else the
    pack's (a member that failed: the pack exits 1; one still training when the pack was killed: its signal)."""
    status = read_run(entry["run_dir"]).get("status")
    return 0 if status in ("completed", "pruned") else exit_code


CRASH_AT = "KDSWEEP_TEST_CRASH_AT"
"""For tests: ``<point>``, ``<point>:<trial>`` or ``<point>:confirm<k>`` (the confirmation's k-th trial) kills the
controller (SIGKILL, as ``kill -9``) at that point of a trial's launch: before_launch, after_launch (before the
manifest says so), after_write."""


def crash_point(point: str, number: int, tag: str | None = None) -> None:
    if os.environ.get(CRASH_AT) in (point, f"{point}:{number}", f"{point}:{tag}"):
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["Controller", "LocalProcesses", "judge", "summary_lines", "FINAL"]
