"""kdsweep.train.knobs: a loss knob that cannot act in the run's setting is one warning, not silence."""

import logging

import pytest

from kdsweep.config.schema import DownstreamConfig, LossConfig, RunConfig
from kdsweep.distributed import single_process
from kdsweep.train.knobs import warn_idle_knobs


@pytest.mark.parametrize("impl, chunk_mb, warned", [("dense", 64.0, True), ("dense", 128.0, False),
                                                    ("fused", 64.0, False), ("chunked", 0.5, False)])
def test_a_chunk_budget_under_the_dense_loss_is_warned_of(impl, chunk_mb, warned, caplog):
    cfg = RunConfig(output_dir="out", loss=LossConfig(impl=impl, chunk_mb=chunk_mb))
    with caplog.at_level(logging.WARNING, logger="kdsweep.train.knobs"):
        warn_idle_knobs(cfg, single_process())
    lines = [r.getMessage() for r in caplog.records if "chunk_mb" in r.getMessage()]
    assert lines == ([f"loss.chunk_mb={chunk_mb:g} has no effect with loss.impl=dense (the loss is one chunk whatever "
                      "its size)"] if warned else [])


@pytest.mark.parametrize("tasks, warned", [((), True), (("kdsweep_next_word",), False)])
def test_a_downstream_setting_without_a_task_is_warned_of(tasks, warned, caplog):
    cfg = RunConfig(output_dir="out", downstream=DownstreamConfig(tasks=tasks, limit=100))
    with caplog.at_level(logging.WARNING, logger="kdsweep.train.knobs"):
        warn_idle_knobs(cfg, single_process())
    lines = [r.getMessage() for r in caplog.records if "downstream" in r.getMessage()]
    assert lines == (["downstream.limit has no effect: downstream.tasks is empty (no lm-eval task is scored)"]
                     if warned else [])
