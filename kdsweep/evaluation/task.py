"""The shipped lm-evaluation-harness task: next-word choice on the embedded corpus' held-out documents.

``kdsweep_next_word``: at every other word of the documents the default data split holds out (``zoo.SPLIT``: no
embedded model pre-trains on them, and no run on the default split trains on them; a sweep's test split is carved
from what remains), the item's context is the 12 words before it and its choices are the word and 3 other words
drawn, seeded, from the same documents (distinct). Scored by accuracy over the choices' log-likelihoods
(``acc``; ``acc_norm`` by length), as lm-eval scores any multiple-choice task. 1,657 items: built offline, once,
into the kdsweep cache as a task directory lm-eval's ``TaskManager(include_path=...)`` reads (a JSONL data file and
the task's YAML naming it), so it needs no network and no ``evaluate.load``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TASK = "kdsweep_next_word"
CONTEXT_WORDS, STRIDE, CHOICES, SEED = 12, 2, 4, 0
VERSION = 1
"""Part of the task directory's key: a change to the items is a new version (and a new directory)."""


def items(docs: list[str]) -> list[dict[str, Any]]:
    """The task's items from ``docs``: ``context`` (words), ``choices`` (words), ``gold`` (the true word's index)."""
    rng = random.Random(SEED)
    words = [d.split() for d in docs]
    pool = [w for doc in words for w in doc]
    out = []
    for doc in words:
        for i in range(CONTEXT_WORDS, len(doc), STRIDE):
            choices = [doc[i]]
            while len(choices) < CHOICES:
                word = rng.choice(pool)
                if word not in choices:
                    choices.append(word)
            rng.shuffle(choices)
            out.append({"context": " ".join(doc[i - CONTEXT_WORDS:i]), "choices": choices,
                        "gold": choices.index(doc[i])})
    return out


def _yaml(data: Path) -> str:
    return "\n".join([
        f"task: {TASK}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {json.dumps(str(data))}",
        "test_split: test", "output_type: multiple_choice", "doc_to_text: context", "doc_to_choice: choices",
        "doc_to_target: gold", "metric_list:",
        *(f"  - metric: {m}\n    aggregation: mean\n    higher_is_better: true" for m in ("acc", "acc_norm")),
        "metadata:", f"  version: {VERSION}.0", ""])


def task_dir() -> Path:
    """The shipped task's directory (its YAML and data), built once in the kdsweep cache."""
    from kdsweep.data.cache import built_once, kdsweep_cache
    from kdsweep.data.text import embedded_corpus
    from kdsweep.models import zoo

    with built_once(kdsweep_cache() / "eval", f"{TASK}-v{VERSION}") as (final, tmp):
        if tmp is not None:
            rows = items(embedded_corpus(**zoo.SPLIT).eval)
            (tmp / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (tmp / f"{TASK}.yaml").write_text(_yaml(final / "items.jsonl"))  # the path it will have once built
    return final


__all__ = ["TASK", "items", "task_dir"]
