"""A warm trial worker: one long-lived job that runs a sweep's trials one after another (``hydra.sweeper.workers``).

``python -m kdsweep.worker SWEEP_DIR NAME`` starts the ranks its spec names (``workers/NAME/spec.json``, written by
the controller), joins their process group once, and then waits for tasks. The controller assigns a trial by
writing ``workers/NAME/task-<seq>.json`` (the trial's arguments, as a job gets them); every rank reads it from the
sweep directory (no server, no port), runs the trial in-process through the same Hydra path as
``python -m kdsweep ARGS`` (``app.trial_in_process``), and rank 0 writes ``done-<seq>.json`` with the exit code a
job would have left. The controller alone judges it and tells the study, as it does for a job.

What the worker keeps between trials is its process (modules, the process group) and ``train.kept.Kept``
(tokenizer, tokenized rows, a live teacher), each under the key of what it depends on. Every trial reseeds, and
builds its own student, adapter, optimizer, sinks and pruner handle; its torch threads and compiled graphs are reset.

The worker leaves when told to (``{"stop": true}``), after ``idle_s`` without a task (a controller that died and
was not resumed), or after a trial it checkpointed at USR2/SIGTERM (it is being preempted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from kdsweep.metrics.records import read_run
from kdsweep.startup import import_frozen
from kdsweep.sweep.workers import read_json, worker_dir

log = logging.getLogger("kdsweep.worker")

POLL_S = 0.1
STARTED = "KDSWEEP_WORKER_STARTED"


class WorkerSession:
    """``app.SESSION`` in a worker: every trial runs in the worker's process group, with the worker's ``Kept``."""

    def __init__(self, env: Any, device: Any) -> None:
        from kdsweep.train.kept import Kept

        self.env, self.device, self._kept = env, device, Kept()

    @contextlib.contextmanager
    def joined(self, run_cfg: Any) -> Iterator[Any]:
        """The worker's process group, if the trial fits it: the same ranks, the same kind of device."""
        from kdsweep.config.schema import ConfigError
        from kdsweep.distributed import device_for

        ranks = run_cfg.dist.nproc_per_node
        if self.env.source in ("single", "local") and ranks != self.env.world_size:  # SLURM's tasks decide there
            raise ConfigError(f"dist.nproc_per_node={ranks} but this sweep's workers have {self.env.world_size} "
                              "rank(s): a trial cannot change its ranks; search over it with hydra.sweeper.workers=0")
        device = device_for(run_cfg.train.device, self.env)  # no such device here: its own one line
        if device.type != self.device.type:
            raise ConfigError(f"train.device={run_cfg.train.device} but this sweep's workers run on "
                              f"{self.device.type}: a trial cannot change its device; search over it with "
                              "hydra.sweeper.workers=0")
        yield self.env

    def kept(self) -> Any:
        return self._kept


class _Tee:
    """Writes go to the trial's job.log and to the worker's own output."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.streams[-1].fileno()


class Worker:
    def __init__(self, sweep_dir: Path, name: str, env: Any, spec: dict[str, Any]) -> None:
        from kdsweep.metrics.records import process_started

        self.dir, self.env, self.spec = worker_dir(sweep_dir, name), env, spec
        # the worker's start (its launching process's, when that spawned the ranks): its first trial counts from it
        self.name, self.trials_run, self.started = name, 0, float(os.environ.get(STARTED) or process_started())
        self.idle_since, self.idle_s = time.time(), 0.0
        self.leave, self.cold = False, True

    def state(self, state: str, **more: Any) -> None:
        """``worker.json``: what the controller and ``kdsweep status`` read (rank 0 writes it)."""
        if not self.env.is_main:
            return
        from kdsweep.metrics.records import slurm, write_json_atomic

        write_json_atomic(self.dir / "worker.json", {
            "name": self.name, "pid": os.getpid(), "host": os.uname().nodename,
            "ranks": self.env.world_size, "slurm": slurm(), "state": state, "trials_run": self.trials_run,
            "idle_s": self.idle_s, "updated": time.time(), **more})

    def next_task(self, seq: int) -> dict[str, Any] | None:
        """The task numbered ``seq`` once the controller wrote it; None after ``idle_s`` without one."""
        path = self.dir / f"task-{seq}.json"
        waited_from = time.time()
        while (task := read_json(path)) is None:
            if time.time() - waited_from > self.spec.get("idle_s", 600):
                log.info("worker %s: no task for %.0f s: leaving", self.name, time.time() - waited_from)
                return None
            time.sleep(POLL_S)
        return task

    def resume_seq(self) -> int:
        """The last task this worker answered. A requeued worker (SLURM) starts again in its own directory: the trial
        it was running when it went is answered "requeued" (the controller retries it, from its checkpoint)."""
        if not self.env.is_main:
            return self.env.broadcast_object(None)
        from kdsweep.metrics.records import write_json_atomic

        seq = max((int(p.stem.split("-")[1]) for p in self.dir.glob("done-*.json")), default=0)
        earlier = read_json(self.dir / "worker.json")
        if earlier is not None:
            self.trials_run, self.idle_s = earlier.get("trials_run", 0), earlier.get("idle_s", 0.0)
            if earlier.get("state") == "busy" and earlier.get("seq") == seq + 1:
                log.warning("worker %s: requeued while it ran trial %s", self.name, earlier.get("trial"))
                write_json_atomic(self.dir / f"done-{seq + 1}.json", {"exit_code": "requeued", "ended": time.time()})
                seq += 1
        return self.env.broadcast_object(seq)

    def serve(self) -> None:
        seq = self.resume_seq()
        self.state("idle", ready=True)
        while not self.leave:
            seq += 1
            task = self.next_task(seq)
            if task is None or task.get("stop"):
                break
            self.idle_s += time.time() - self.idle_since
            self.state("busy", trial=task["trial"], seq=seq, ready=True)
            code = self.run(task)
            if self.env.is_main:
                from kdsweep.metrics.records import write_json_atomic

                write_json_atomic(self.dir / f"done-{seq}.json", {"exit_code": code, "ended": time.time()})
            self.trials_run += 1
            self.idle_since = time.time()
            self.state("idle", ready=True, last_trial=task["trial"])
            # a refusal (exit 2) comes before any collective of the trial, on every rank alike: the worker goes on.
            # Any other failure may have left a peer inside a collective (a rank that failed inside the trial's
            # process group has already ended its process: distributed.failure)
            if code not in (0, 2) and self.env.world_size > 1:
                self.end_after_failure(task, code)
        self.idle_s += time.time() - self.idle_since  # from its last trial until it left
        self.state("left", ready=True)

    def end_after_failure(self, task: dict[str, Any], code: int) -> None:
        """A trial failed on this rank: a peer may be inside a collective of it, so nothing is agreed with them (no
        barrier: under NCCL it could pair with a collective a peer still has pending). This rank leaves at once;
        the worker's launcher ends the others, and the pool starts another worker (a rank lost mid-trial is the
        worker's fault: the controller retries the trial, from its checkpoint, as an attempt)."""
        from kdsweep.distributed import comm

        comm.mark_failed(f"trial {task['trial']} exited {code} on rank {self.env.rank}")
        log.error("worker %s: trial %s failed on rank %d (exit %s): this worker leaves without agreeing with its other "
                  "ranks", self.name, task["trial"], self.env.rank, code)
        self.state("left", ready=True, last_trial=task["trial"])
        logging.shutdown()
        os._exit(1)

    def run(self, task: dict[str, Any]) -> int:
        """Run one trial as its job would; return the exit code that job would have left."""
        import torch

        from kdsweep import app
        from kdsweep.metrics.records import JOB_STARTED, SHARED_THREADS, WORKER

        run_dir = Path(task["run_dir"])
        run_dir.mkdir(parents=True, exist_ok=True)
        # the first trial counts the worker's start-up (cold), the next ones from the moment they were picked up
        os.environ[JOB_STARTED] = str(self.started if self.cold else time.time())
        boot = time.time() - self.started if self.cold else 0.0
        os.environ[WORKER] = f"{self.name}:{self.trials_run}:{'cold' if self.cold else 'warm'}:{boot:.3f}"
        self.cold = False
        threads = torch.get_num_threads()
        torch.set_num_threads(task.get("threads") or threads)
        if task.get("shared_threads"):
            os.environ[SHARED_THREADS] = str(task["shared_threads"])
        torch._dynamo.reset()  # no compiled graph of an earlier trial's knobs is reused
        log.info("worker %s: trial %s (%s)", self.name, task["trial"], run_dir)
        out = open(run_dir / "job.log", "a") if self.env.is_main else None
        streams = (lambda s: _Tee(out, s)) if out else (lambda s: s)
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level  # Hydra configures logging for the trial: restored after
        # and a trial's preemption watch, even one that failed before it could restore them (submitit's handler
        # must stay the one a later trial hands its signal over to)
        signals = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
        code = 0
        try:
            with contextlib.redirect_stdout(streams(sys.stdout)), contextlib.redirect_stderr(streams(sys.stderr)):
                app.trial_in_process(task["args"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # the job's own handler logs what fails; this is what escaped it
            log.exception("worker %s: trial %s failed", self.name, task["trial"])
            code = 1
        finally:
            for signum, handler in signals.items():
                signal.signal(signum, handler)
            for h in [h for h in root.handlers if h not in handlers]:
                root.removeHandler(h)
                h.close()
            root.handlers[:], root.level = handlers, level
            if out:
                out.close()
            torch.set_num_threads(threads)
            os.environ.pop(SHARED_THREADS, None)
        from kdsweep.pack.jobs import SPEC, member_dirs

        runs = member_dirs(run_dir) if (run_dir / SPEC).exists() else [run_dir]  # a packed job: its members'
        if any(read_run(d).get("status") == "preempted" for d in runs):
            self.leave = True  # checkpointed at the scheduler's signal: this worker is going
        return code


def serve(sweep_dir: str, name: str) -> None:
    """One rank of the worker: join the process group once, then run trials until told to stop."""
    import_frozen()  # a rank forked from its forkserver: what the server imported, frozen here
    from kdsweep import app
    from kdsweep.data.cache import kdsweep_cache
    from kdsweep.distributed import detect, device_for, process_group
    from kdsweep.distributed.rendezvous import agree_port, release_port

    spec = json.loads((worker_dir(Path(sweep_dir), name) / "spec.json").read_text())
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    env = agree_port(detect(), kdsweep_cache(), spec.get("timeout_s", 600))
    device = device_for(spec.get("device", "auto"), env)
    with process_group(env, device, timeout_s=spec.get("timeout_s", 600)):
        release_port(env, kdsweep_cache())
        app.SESSION = WorkerSession(env, device)
        Worker(Path(sweep_dir), name, env, spec).serve()


def main() -> None:
    """``python -m kdsweep.worker SWEEP_DIR NAME``: a worker that cannot start (no such device, ...) says why in one
    line, which the controller repeats when no worker of its pool could start."""
    from kdsweep.config.schema import ConfigError, RanksFailed

    try:
        _main()
    except ConfigError as e:
        print(f"kdsweep: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except RanksFailed as e:  # a rank left after a failed trial: the trial's own records say why
        print(f"kdsweep: worker ended: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def _main() -> None:
    import_frozen()  # what its trials import, paid once (a cold start)
    from kdsweep.config.schema import DistConfig
    from kdsweep.distributed import detect
    from kdsweep.distributed.launch import spawn

    from kdsweep.metrics.records import process_started

    sweep_dir, name = sys.argv[1], sys.argv[2]
    os.environ[STARTED] = str(process_started())  # spawned ranks inherit it
    spec = json.loads((worker_dir(Path(sweep_dir), name) / "spec.json").read_text())
    ranks = int(spec.get("nproc", 1))
    if ranks > 1 and detect().world_size == 1:  # a local worker of N ranks (SLURM and torchrun start their own)
        spawn(serve, (sweep_dir, name), DistConfig(nproc_per_node=ranks,
                                                   master_addr=spec.get("master_addr", "127.0.0.1"), master_port=0))
    else:
        serve(sweep_dir, name)


if __name__ == "__main__":
    main()
