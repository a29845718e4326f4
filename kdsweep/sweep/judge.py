"""What a finished trial job means for its trial: COMPLETE, PRUNED, FAIL (with its one-line reason) or RETRY, from
its exit code (or the scheduler's state), its run.json, its ranks' failure records and its logs. Decided once, from
records and exit states, never from error text: a rank that failed on its own (it wrote a record that is not a lost
peer's) fails the trial with its line; a rank lost to something outside the trial (killed, preempted, its node
gone: no record of its own) is an interruption, retried up to ``retries`` times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kdsweep.evaluation.downstream import lower_is_better
from kdsweep.metrics.records import describe_failure, failure_line, rank_failures, read_run


@dataclass
class Outcome:
    state: str  # COMPLETE, PRUNED, FAIL or RETRY
    values: list[float] | None = None
    reason: str = ""
    test: list[float] | None = None
    """The objectives on the test split (a confirmation trial's, ``train.eval_test``; None: not evaluated)."""
    also: dict[str, float] | None = None
    """A confirmation trial's second measures (``confirm.also``), on the split it is scored on."""


def judge(run_dir: Path, exit_code: int | str, objectives: tuple[str, ...], attempts: int, retries: int,
          logs: list[str] = (), also: tuple[str, ...] = ()) -> Outcome:
    """What a finished job means for its trial, from its exit code (or scheduler state) and its run.json; ``also``:
    the second measures a confirmation trial is scored on (a missing one is nan: the verdict leaves that seed out)."""
    record = read_run(run_dir)
    status = record.get("status")
    if status == "completed" and (exit_code == 0 or isinstance(exit_code, str)):
        wrong_way = next(filter(None, (lower_is_better(record, m) for m in (*objectives, *also))), None)
        if wrong_way:
            return Outcome("FAIL", reason=wrong_way)
        values = [float((record.get("eval_after") or {}).get(o, float("nan"))) for o in objectives]
        if not all(math.isfinite(v) for v in values):
            return Outcome("FAIL", reason=f"the objective is not finite: {values}")
        test = record.get("test_after")
        scored = test or record.get("eval_after") or {}
        return Outcome("COMPLETE", values=values, test=[float(test[o]) for o in objectives] if test else None,
                       also={m: float(scored.get(m, float("nan"))) for m in also} or None)
    if status == "pruned":
        return Outcome("PRUNED")
    if exit_code == "CANCELLED":  # by a user (scancel): not retried
        return Outcome("FAIL", reason="the SLURM job was cancelled (scancel)")
    refused = next(filter(None, (_refusal(Path(p)) for p in reversed(logs))), "") if status is None else ""
    if refused:  # it refused its input before writing a record (seen as "gone" when no controller watched it)
        return Outcome("FAIL", reason=refused[:500])
    # a signal, or an end the job did not choose (vanished, cancelled, timed out, node failure) mid-run; or a rank
    # of the job lost: rank 0 saw a peer's end through a collective (interrupted), or was ended by its launcher
    # before it could record anything (still running)
    killed = ((isinstance(exit_code, int) and exit_code < 0)
              or (isinstance(exit_code, str) and status in (None, "running", "preempted")))
    own = _own_failure(run_dir)
    if own and status != "preempted":  # a rank failed on its own (an error, an OOM): the trial's fault, not retried
        return Outcome("FAIL", reason=own[:500])
    if killed or status in ("preempted", "interrupted", "running"):
        ranks = _rank_failure(run_dir)
        why = f"the job was interrupted (exit {exit_code}{'; ' + ranks if ranks else ''})"
        if attempts <= retries:
            return Outcome("RETRY", reason=f"{why}; restarting it")
        return Outcome("FAIL", reason=f"the job was interrupted {attempts} times (last: exit {exit_code}"
                                      f"{'; ' + ranks if ranks else ''}); retries exhausted"[:500])
    reason = (record.get("error") or next(filter(None, (_last_error_line(Path(p)) for p in reversed(logs))), "")
              or f"the job exited with {exit_code}")
    return Outcome("FAIL", reason=reason[:500])


def _own_failure(run_dir: Path) -> str:
    """The line of a rank that failed on its own (its record says so: not a peer lost, which a rank killed from
    outside, with no record of its own, leaves), or ""."""
    found = rank_failures(run_dir)
    return describe_failure(found[0]) if found and not found[0]["peer_lost"] else ""


def _rank_failure(run_dir: Path) -> str:
    """What the job's ranks recorded of their failure (``distributed.failure``), in one line, or ""."""
    return failure_line(run_dir) or ""


def _refusal(log_path: Path) -> str:
    """The one line a job wrote when it refused its input (``kdsweep: error: ...``), or ""."""
    if not log_path.exists():
        return ""
    return next((line.strip() for line in reversed(log_path.read_text(errors="replace").splitlines())
                 if line.startswith("kdsweep: error:")), "")


def _last_error_line(log_path: Path) -> str:
    if not log_path.exists():
        return ""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()
             if line.strip() and "HYDRA_FULL_ERROR" not in line]
    for marker in ("kdsweep: error:", "Error", "error"):
        for line in reversed(lines):
            if marker in line:
                return line
    return lines[-1] if lines else ""
