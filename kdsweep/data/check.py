"""Cheap checks of the data before a job starts (no torch, no tokenizer loaded).

Every source is opened and its first rows are checked against its format (the columns exist and hold the right
types, a chat row has messages), a chat source needs a chat template, and a source held out from must keep rows
for training. The whole of every source is checked when the job tokenizes it, before its first step; a bad row
further down then fails the job with the same kind of one line, naming the row.
"""

from __future__ import annotations

import json
from pathlib import Path

from kdsweep import hub
from kdsweep.config.schema import ConfigError, RunConfig
from kdsweep.data.formats import FormatSpec, chat_template, check_row
from kdsweep.data.mixing import split_indices
from kdsweep.data.sources import eval_sources, read_rows, test_sources, train_sources

PEEK = 100
"""Rows of each source checked before launch."""


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether the tokenizer saved in ``tokenizer_dir`` carries a chat template."""
    if any((tokenizer_dir / f).is_file() for f in ("chat_template.jinja", "chat_template.json")):
        return True
    config = tokenizer_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def preflight_data(cfg: RunConfig) -> None:
    d = cfg.data
    template = chat_template(d.chat_template)
    every = train_sources(d) + eval_sources(d) + test_sources(d)
    chat_sources = [key for key, ds in every if ds.format == "chat"]
    if chat_sources and template is None:
        if cfg.model.path is not None and not has_chat_template(hub.model_dir("model.path", cfg.model.path)):
            name = cfg.model.path
            raise ConfigError(
                f"{chat_sources[0]}.format=chat needs a chat template and the tokenizer of {name} has none; "
                "set data.chat_template=<a template or a .jinja file> or use format instruction"
            )
    for key, ds in every:
        rows = read_rows(ds.path, split=ds.split, key=f"{key}.path", limit=PEEK)
        spec = FormatSpec.of(ds, key)
        for i, row in enumerate(rows):
            check_row(row, spec, where=f"{key}: {ds.path} row {i + 1}")
        if key.startswith("data.datasets") and len(rows) < PEEK and not split_indices(len(rows), d)[0]:
            raise ConfigError(
                f"{key}.path: {ds.path} holds {len(rows)} row(s), too few to hold out data.eval_fraction="
                f"{d.eval_fraction} for evaluation (and data.test_fraction={d.test_fraction} for the test split); "
                "add rows or set data.eval_datasets=[...]"
            )
