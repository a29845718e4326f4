"""The shipped lm-eval task's items, and the eval table's statistics against numbers written down."""

import json
import math
from pathlib import Path

import pytest

from kdsweep.evaluation.harness import headline
from kdsweep.evaluation.report import Entry, compare, summary, table_lines
from kdsweep.evaluation.task import CHOICES, CONTEXT_WORDS, TASK, items, task_dir

T_975_2DF = 4.303  # t(0.975, 2 df)


def test_each_item_asks_for_the_word_that_follows_its_context_among_distinct_words():
    docs = [" ".join(f"w{i}" for i in range(40)), " ".join(f"v{i}" for i in range(20))]
    got = items(docs)
    assert len(got) == len(range(CONTEXT_WORDS, 40, 2)) + len(range(CONTEXT_WORDS, 20, 2))
    first = got[0]
    assert first["context"] == " ".join(f"w{i}" for i in range(CONTEXT_WORDS))
    assert first["choices"][first["gold"]] == f"w{CONTEXT_WORDS}"
    assert all(len(set(i["choices"])) == CHOICES for i in got)
    assert got == items(docs)  # seeded


def test_the_shipped_task_is_an_lm_eval_task_of_at_least_500_items():
    from lm_eval.tasks import TaskManager

    d = task_dir()
    rows = [json.loads(line) for line in (d / "items.jsonl").read_text().splitlines()]
    assert len(rows) >= 500
    manager = TaskManager(include_path=str(d), include_defaults=False)
    task = manager.load_task_or_group([TASK])[TASK]
    docs = list(task.test_docs())
    assert len(docs) == len(rows) and task.doc_to_choice(docs[0]) == rows[0]["choices"]
    assert task.doc_to_target(docs[0]) == rows[0]["gold"] and task.doc_to_text(docs[0]) == rows[0]["context"]


def test_a_model_s_interval_is_over_the_items_and_seeds_take_the_t_interval():
    one = Entry("one", [Path("a")], scores=[{TASK: {"metric": "acc", "value": 0.56, "stderr": 0.0122, "items": 1657}}])
    row = summary(one, TASK)
    assert row["half_width"] == pytest.approx(1.96 * 0.0122, rel=1e-4) and row["stderr"] == 0.0122
    seeds = Entry("three", [Path("a")] * 3, scores=[{TASK: {"metric": "acc", "value": v, "stderr": 0.012,
                                                            "items": 1657}} for v in (0.50, 0.52, 0.57)])
    row = summary(seeds, TASK)
    sd = math.sqrt((0.03 ** 2 + 0.01 ** 2 + 0.04 ** 2) / 2)  # 0.036056
    assert row["value"] == pytest.approx(0.53) and row["stderr"] == pytest.approx(sd / math.sqrt(3))
    assert row["half_width"] == pytest.approx(T_975_2DF * sd / math.sqrt(3), rel=1e-3)
    versus = compare(row, {"value": 0.50, "stderr": 0.012})
    assert versus["vs_base"] == pytest.approx(0.03)
    assert versus["vs_base_se"] == pytest.approx(0.03 / math.sqrt((sd / math.sqrt(3)) ** 2 + 0.012 ** 2))
    lines = table_lines([{**row, **versus}])
    expected = f"three  0.5300 ± {row['half_width']:.4f}   vs base +0.0300 ({versus['vs_base_se']:+.1f} SE)"
    assert lines[1].strip() == expected


def test_the_headline_is_acc_else_the_task_s_first_metric():
    got = headline({"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.01, "acc_norm,none": 0.6},
                   {"acc": True, "acc_norm": True})
    assert got == {"metric": "acc", "value": 0.5, "stderr": 0.01, "higher_is_better": True}
    got = headline({"alias": "t", "word_perplexity,none": 25.0, "word_perplexity_stderr,none": "N/A"},
                   {"word_perplexity": False})
    assert got == {"metric": "word_perplexity", "value": 25.0, "stderr": None, "higher_is_better": False}
    got = headline({"alias": "t", "exact_match,strict": 0.25, "exact_match_stderr,strict": "N/A"})
    assert got == {"metric": "exact_match", "value": 0.25, "stderr": None, "higher_is_better": None}
