"""When one rank of a job fails: no rank enters another collective, and the job ends in one line.

Under NCCL a collective that one rank never joins hangs its peers until the watchdog's timeout (30 minutes in the
GPU presets), and a barrier can pair with a collective a peer still has pending. So a rank whose job raises does
not try to agree with its peers: it records what failed (``<run dir>/logs/rank<r>.failure.json``: the error, what
the rank was doing, whether it was only a peer's loss seen through a collective), writes the traceback to its own
log (never the console), refuses every later collective (:func:`kdsweep.distributed.comm.mark_failed`) and ends
its process at once. Its launcher ends the others (torch's elastic agent for local ranks and torchrun, ``srun
--kill-on-bad-exit`` on SLURM), whichever collective they wait in. The job's one line comes from the launching
process (local ranks) or from the failing rank itself (torchrun, SLURM tasks), made from the records
(:func:`kdsweep.metrics.records.failure_line`).

A collective error caused by a peer's death is the job's lost rank, not the run's own failure: rank 0 records the run
``interrupted`` (the sweep retries the trial from its checkpoint, as when the whole job dies) unless its own code
raised first.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from kdsweep.metrics.records import describe_failure, failure_path

log = logging.getLogger(__name__)

DOING = ["starting"]
"""What this rank is doing (one phrase, :func:`doing`), for the line its failure ends in."""
RAISE_AT = "KDSWEEP_TEST_RAISE_AT"
"""For tests: ``<rank>:<step>`` makes that rank raise after that optimizer step, once per run directory;
``<rank>:<step>@<name>`` only in the run directory of that name (a sweep's trial number)."""
PEER_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL communicator",
                "Watchdog caught collective", "Timed out waiting", "ProcessGroupNCCL")
"""What the errors of a collective whose peer is gone say (gloo's and NCCL's), for those raised by ``wait()`` on an
asynchronous collective (FSDP's all-gathers), which the counting wrappers do not see raise."""


def doing(what: str) -> None:
    """This rank now does ``what`` ("training step 5", "building the teacher cache", ...)."""
    DOING[0] = what


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because a peer is gone or stuck (not this rank's own error)."""
    import torch.distributed as dist

    from kdsweep.distributed import comm

    if isinstance(e, comm.CollectiveRefused) or isinstance(e, getattr(dist, "DistError", ())):
        return True
    return comm.collective_error() is not None or any(m in f"{type(e).__name__}: {e}" for m in PEER_MARKERS)


def log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / ("kdsweep.log" if rank == 0 else f"logs/rank{rank}.log")


def clear(run_dir: Path, rank: int) -> None:
    """A new attempt of the run: the last attempt's record of this rank's failure is gone."""
    failure_path(run_dir, rank).unlink(missing_ok=True)


def hint(e: BaseException, lost: bool, timeout_s: float | None) -> str:
    """What to do about it, as far as the error says."""
    from kdsweep.config.schema import ConfigError

    text = str(e)
    if isinstance(e, ConfigError):
        return ""
    if "out of memory" in text.lower() or type(e).__name__ == "OutOfMemoryError":
        return ("lower data.micro_batch_size, or pass dist.activation_checkpointing=true, loss.impl=fused or "
                "dist.teacher_placement=node")
    if "Timed out" in text or "timeout" in text.lower():
        return (f"a rank waited longer than dist.timeout_s={timeout_s:g} s for its peers: if one was only slow, raise "
                "dist.timeout_s" if timeout_s else "raise dist.timeout_s if a rank was only slow")
    if lost:
        return "a peer rank ended first: its own line and log say why"
    return ""


def record(run_dir: Path, rank: int, e: BaseException, timeout_s: float | None = None) -> dict[str, Any]:
    """Write this rank's failure record and its traceback (to its log file, not the console); returns the record."""
    from kdsweep.config.schema import ConfigError

    lost = peer_lost(e)
    entry = {"rank": rank, "host": platform.node(), "pid": os.getpid(), "time": time.time(), "doing": DOING[0],
             "error": f"{type(e).__name__}: {e}".strip()[:2000], "message": str(e)[:2000],
             "config_error": isinstance(e, ConfigError), "peer_lost": lost, "hint": hint(e, lost, timeout_s),
             "log": str(log_path(run_dir, rank))}
    path = failure_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(entry, indent=1))
    os.replace(tmp, path)
    for handler in logging.getLogger().handlers:  # the traceback into this rank's log file only
        if isinstance(handler, logging.FileHandler):
            handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "rank %d failed while %s",
                                          (rank, DOING[0]), (type(e), e, e.__traceback__)))
    return entry


def end_rank(run_dir: Path, rank: int, e: BaseException, timeout_s: float, speak: bool) -> NoReturn:
    """This rank of a job of several failed: record it, refuse every collective, say one line when ``speak`` (a rank
    with no launcher of kdsweep's to say it: torchrun, SLURM), and end the process now, without the barrier or
    teardown a collective would need. Exit code 2 for bad input (as a refused job), else 1."""
    from kdsweep.distributed import comm

    entry = record(run_dir, rank, e, timeout_s)
    comm.mark_failed(f"rank {rank} failed while {entry['doing']}")
    if speak and (not entry["peer_lost"] or rank == 0):
        print(f"kdsweep: error: {describe_failure(entry)}", file=sys.stderr, flush=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if entry["config_error"] else 1)


def injected(rank: int, step: int, run_dir: Path) -> None:
    """Tests: raise here when :data:`RAISE_AT` names this rank and step (once per run directory: its retry runs)."""
    spec, here = os.environ.get(RAISE_AT), f"{rank}:{step}"
    if spec not in (here, f"{here}@{Path(run_dir).name}"):
        return
    mark = Path(run_dir) / f".raised-{rank}-{step}"
    if mark.exists():
        return
    mark.touch()
    raise RuntimeError(f"injected failure of rank {rank} after step {step} ({RAISE_AT})")

