"""One model on lm-evaluation-harness tasks: the shipped task (:mod:`kdsweep.evaluation.task`), tasks in a user's own
YAML directory (``include``), or any task lm-eval ships (those read their datasets through the Hugging Face cache)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from kdsweep.config.schema import ConfigError

log = logging.getLogger(__name__)

INSTALL = "pip install 'kdsweep[eval]'"


def require_lm_eval(who: str = "kdsweep eval") -> Any:
    """The lm_eval module, or one line with the command that installs it (``who``: what runs lm-eval)."""
    try:
        import lm_eval
    except ImportError:
        raise ConfigError(f"{who} runs lm-evaluation-harness, which is not installed; {INSTALL} "
                          "(lm_eval>=0.4.10)") from None
    return lm_eval


def task_manager(tasks: list[str], include: list[Path], flags: tuple[str, str] = ("--tasks", "--include DIR")) -> Any:
    """lm-eval's TaskManager over the shipped task and ``include``; lm-eval's own tasks are indexed too (seconds)
    only when a task is not among those. An unknown task is one line, naming the task and include ``flags``."""
    from lm_eval.tasks import TaskManager

    from kdsweep.evaluation.task import TASK, task_dir

    paths = [str(task_dir()), *map(str, include)]
    manager = TaskManager(include_path=paths, include_defaults=False)
    if all(t in manager.all_tasks for t in tasks):
        return manager
    manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"{flags[0]}: lm-eval knows no task {unknown[0]!r}; use {TASK} (shipped), a task of "
                          f"`lm-eval ls tasks`, or one in a YAML directory given with {flags[1]}")
    return manager


def evaluate(model_dir: Path, tasks: list[str], manager: Any, batch_size: int,
             limit: int | None) -> dict[str, dict[str, Any]]:
    """``{task: {metric, value, stderr, higher_is_better, items}}`` of the Hugging Face model in ``model_dir`` (fp32;
    on the GPU when there is one); ``manager``: :func:`task_manager`'s. lm-eval is given the loaded model, so it sets
    up no distribution of its own: in a trial's rank 0, with the job's process group open, it would otherwise take
    the job's ranks for its own and wait for them."""
    lm_eval = require_lm_eval()
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("lm-eval: %s on %s (%s)", ", ".join(tasks), model_dir, device)
    if device == "cuda":  # in a trial, what its training freed goes back before another copy of the student loads
        torch.cuda.empty_cache()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), batch_size=batch_size)
    with _offline():
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager, log_samples=False)
    return {task: {**headline(out["results"][task], out["higher_is_better"].get(task, {})),
                   "items": out["n-samples"][task]["effective"]} for task in tasks}


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """HF_HUB_OFFLINE=1 while lm-eval reads its tasks (a compute node: the shipped task reads no network), and the
    environment as it was after (a warm worker's later trials and their children see no change)."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)


def headline(result: dict[str, Any], higher: dict[str, bool] | None = None) -> dict[str, Any]:
    """A task's headline metric from lm-eval's results: ``acc`` when it has one, else its first metric; with its
    standard error (None when lm-eval gives none) and whether higher is better (``higher``: lm-eval's
    ``higher_is_better`` of the task; None when it does not say)."""
    metrics = [k for k in result if "," in k and "_stderr," not in k and isinstance(result[k], (int, float))]
    if not metrics:
        raise ConfigError(f"lm-eval reported no metric for task {result.get('alias')!r}")
    key = next((k for k in metrics if k.startswith("acc,")), metrics[0])
    name, where = key.split(",", 1)
    stderr = result.get(f"{name}_stderr,{where}")
    return {"metric": name, "value": float(result[key]),
            "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
            "higher_is_better": (higher or {}).get(name)}


__all__ = ["INSTALL", "evaluate", "headline", "require_lm_eval", "task_manager"]
