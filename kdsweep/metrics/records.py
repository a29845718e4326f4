"""``run.json``: what ran, how it ended, and where it came from."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = ("kdsweep", "torch", "transformers", "peft", "hydra-core", "safetensors", "tokenizers")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_sha() -> str | None:
    """The commit of the kdsweep checkout this code runs from (None for an installed wheel)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


COST_FIELDS = ("steps", "train_tokens", "trial_seconds", "device_seconds", "loop_seconds", "startup_seconds",
               "teacher_tokens_computed", "teacher_tokens_read", "teacher_tokens_generated")
"""What a run's ``cost`` sums over its attempts: optimizer steps, trained tokens (a data step's non-padding tokens, a
generating step's completions), wall seconds from the job's start, device-seconds (wall seconds × ranks), the
seconds of its steps and evals (``loop_seconds``), the seconds before its first step (``startup_seconds``: the
process's imports, the config, data, models, caches and the first evaluation; a warm worker's trial starts from
when it was handed over, ``environment.worker`` says which), the teacher positions a model computed (live, the
cache's build, and the tokens the teacher generated) or a cache supplied, and of those the tokens the teacher
generated."""

ALIGNMENT_FIELDS = ("kd_spans", "kd_spans_dropped", "tokens_unaligned")
"""A teacher with another tokenizer (run.json ``alignment``, summed over attempts): in the training steps'
micro-batches (not the evaluations', which a sweep's trials may share), the spans that took a KD term, the spans with
trained tokens that could not (part untrained, or no teacher position before them), and the student's content
tokens in no span (a row cut inside a span)."""

SLURM_VARS = {
    "job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID", "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT", "nodelist": "SLURM_JOB_NODELIST", "ntasks": "SLURM_NTASKS",
    "partition": "SLURM_JOB_PARTITION",
}


def slurm() -> dict[str, str] | None:
    """The SLURM job this attempt runs in (a requeued job keeps its id and counts SLURM_RESTART_COUNT up)."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    info = {k: os.environ[v] for k, v in SLURM_VARS.items() if v in os.environ}
    info.setdefault("restart_count", "0")
    return info


WORKER = "KDSWEEP_WORKER"
"""Set by a warm trial worker for each trial it runs: ``<name>:<trials it ran before this one>:<cold|warm>:<boot s>``
(cold: the first trial of its process, which pays the process's start; boot: the seconds from the worker's start to
its taking this trial, 0 when warm: the worker's one-time cost, which no later trial pays)."""


def worker() -> dict[str, Any] | None:
    """The warm worker this attempt runs in: its name, the trials it ran before, whether it started cold, and the
    worker's own start-up before this trial (``boot_seconds``)."""
    if not os.environ.get(WORKER):
        return None
    name, before, start, boot = os.environ[WORKER].rsplit(":", 3)
    return {"name": name, "trials_before": int(before), "start": start, "boot_seconds": float(boot)}


def environment() -> dict[str, Any]:
    return {
        "git_sha": git_sha(), "packages": package_versions(), "host": platform.node(), "pid": os.getpid(),
        "slurm": slurm(), "worker": worker(),
    }


JOB_STARTED = "KDSWEEP_JOB_STARTED"
"""The environment variable holding when the job's first process started (epoch seconds): ranks spawned later
inherit it, so a job's seconds count from its start (imports, tokenization) to its end."""


SHARED_THREADS = "KDSWEEP_SHARED_THREADS"
"""Set by the sweep controller on a local trial it starts alone to build the teacher cache with every core: the
threads the trial takes once the cache is ready and other trials share the machine."""


def process_started() -> float:
    """When this process started (epoch seconds), from /proc; now where that cannot be read."""
    import time

    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


def job_started() -> float:
    """When this job started: what the first process of the job put in the environment, else this process's start."""
    return float(os.environ.get(JOB_STARTED) or process_started())


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


_PARSED: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}  # a JSON file -> (inode, mtime, size; content)
SETTLED_S = 2.0
"""A JSON file not written for this long is kept parsed until it changes: a later write moves its mtime by more than
the clock's tick, so (inode, mtime, size) tells it apart; a younger one is parsed at every read."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON record's content, ``{}`` while it does not exist; read-only (a settled file's content is kept parsed
    and given again: a sweep's controller reads every trial's record at every poll). A damaged one is one line."""
    from kdsweep.config.schema import ConfigError

    try:
        stat = path.stat()
    except FileNotFoundError:
        return {}
    version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
    known = _PARSED.get(path)
    if known is not None and known[0] == version:
        return known[1]
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:  # replaced between the stat and the read: not there yet, as far as this read knows
        return {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); the record is damaged") from None
    if time.time() - stat.st_mtime > SETTLED_S:
        _PARSED[path] = (version, content)
    return content


def read_run(run_dir: Path | str) -> dict[str, Any]:
    """A run's ``run.json`` (:class:`RunRecord` writes it), ``{}`` before the run wrote one: every reader of run
    records reads them here (read-only)."""
    return read_json(Path(run_dir) / "run.json")


class RunRecord:
    """The run's ``run.json``, rewritten atomically whenever its status changes."""

    def __init__(self, path: Path, config: dict[str, Any], overrides: list[str], world_size: int = 1) -> None:
        self.path = path
        previous = json.loads(path.read_text()) if path.exists() else {}
        env = environment()
        self.data: dict[str, Any] = {
            "status": "running",
            "config": config,
            "overrides": overrides,
            "world_size": world_size,
            "environment": env,
            "attempts": previous.get("attempts", 0) + 1,
            # every attempt's SLURM job (ids stay across requeues; restart counts do not)
            "slurm_attempts": previous.get("slurm_attempts", []) + ([env["slurm"]] if env["slurm"] else []),
        }
        self._earlier_costs: list[dict[str, float]] = previous.get("costs", [])

    def cost(self, attempt: dict[str, float]) -> None:
        """Record what this attempt has cost so far (``costs``: one entry per attempt; ``cost``: their sums)."""
        costs = [*self._earlier_costs, attempt]
        alignment = {k: sum(c.get(k, 0) for c in costs) for k in ALIGNMENT_FIELDS if any(k in c for c in costs)}
        self.update(costs=costs, cost={k: sum(c.get(k, 0) for c in costs) for k in COST_FIELDS},
                    **({"alignment": alignment} if alignment else {}))

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        write_json_atomic(self.path, self.data)


def failure_path(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` of a job of several records why it failed (``kdsweep.distributed.failure``)."""
    return Path(run_dir) / "logs" / f"rank{rank}.failure.json"


def rank_failures(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank's failure record of the run's last attempt: the ranks' own errors first, then by time."""
    out = []
    for path in sorted((Path(run_dir) / "logs").glob("rank*.failure.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(out, key=lambda r: (r.get("peer_lost", False), r.get("time", 0)))


def describe_failure(entry: dict[str, Any]) -> str:
    """One line: the rank, where, what it was doing, the error, the fix, and where its traceback is."""
    if entry.get("config_error"):
        return entry["message"]
    what = (f"rank {entry['rank']} ({entry['host']}) {'lost a peer' if entry['peer_lost'] else 'failed'} while "
            f"{entry['doing']}: {entry['error'].splitlines()[0][:300]}")
    fix = f"; {entry['hint']}" if entry.get("hint") else ""
    return f"{what}{fix}; its traceback is in {entry['log']}"


def failure_line(run_dir: Path) -> str | None:
    """The line a job that failed across ranks ends with (None when no rank recorded a failure)."""
    found = rank_failures(run_dir)
    return describe_failure(found[0]) if found else None
