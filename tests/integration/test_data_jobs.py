"""Jobs on users' data: a packed weighted mix of instruction and chat data trains the same on 1 and 2 ranks,
its counts are logged and recorded, and the trials of a sweep share one tokenization cache."""

import json
import random
import re
from pathlib import Path

import pytest

from conftest import QUIET, kdsweep, read_run
from test_multirank import assert_same_run
from test_sweep import search

pytestmark = pytest.mark.slow

QWEN3_TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen3.jinja"
"""Qwen3's reasoning template as Qwen ships it: earlier turns lose the <think> block the last one gets."""


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, zoo_dirs):
    """Alpaca-style JSONL and chat Parquet made of the embedded corpus' words, lengths skewed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kdsweep.data.text import EMBEDDED_CORPUS

    words = EMBEDDED_CORPUS.read_text().split()
    rng = random.Random(0)
    text = lambda n: " ".join(words[(k := rng.randrange(len(words) - n)): k + n])
    root = tmp_path_factory.mktemp("data")
    rows = [{"instruction": text(8), "input": text(rng.choice([0, 5])), "output": text(int(rng.lognormvariate(3, 0.8)))}
            for _ in range(200)]
    (root / "inst.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    def chat(k):
        system = [{"role": "system", "content": text(4), "reasoning_content": None}] * (k % 3 == 0)
        turns = [[{"role": "user", "content": text(6), "reasoning_content": None},
                  {"role": "assistant", "content": text(rng.randint(2, 20)), "reasoning_content": text(3) if k % 2 else None}]
                 for _ in range(1 + k % 3)]  # one to three exchanges, some with reasoning
        return {"messages": system + [m for t in turns for m in t]}

    pq.write_table(pa.Table.from_pylist([chat(k) for k in range(80)]), root / "chat.parquet")
    (root / "chat.jinja").write_text(QWEN3_TEMPLATE.read_text())
    return root


def mix_args(data_dir, cache):
    return ["data=mixture", f"data.datasets.0.path={data_dir / 'inst.jsonl'}",
            f"data.datasets.1.path={data_dir / 'chat.parquet'}", f"data.chat_template={data_dir / 'chat.jinja'}",
            "data.seq_len=128", "data.batch_size=8", "data.micro_batch_size=2", "data.eval_batch_size=8",
            "data.max_eval_sequences=16", f"data.cache_dir={cache}", "train.max_steps=4", "train.eval_every=2",
            "checkpoint.save_every=0", "checkpoint.export_merged=false", *QUIET]


def chat_turns_trained(rows, tokenizer, seq_len):
    """For every chat sample of packed ``rows`` shorter than ``seq_len`` (not truncated): the decoded runs of its
    labelled tokens."""
    ids, labels, pos = rows.input_ids.tolist(), rows.labels.tolist(), rows.position_ids.tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    samples = []
    for a, b in zip(starts, starts[1:]):
        if b - a >= seq_len or not tokenizer.decode(ids[a:b]).startswith("<|im_start|>"):
            continue
        runs, run = [], []
        for t in labels[a:b] + [rows.ignore_index]:
            if t != rows.ignore_index:
                run.append(t)
            elif run:
                runs, run = runs + [tokenizer.decode(run)], []
        samples.append(runs)
    return samples


def test_a_packed_weighted_mix_trains_the_same_on_one_and_two_ranks(data_dir, tmp_path, zoo_dirs):
    args = mix_args(data_dir, tmp_path / "cache")
    kdsweep(*args, f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path)
    kdsweep(*args, "dist=fsdp2_local", f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two")
    one, two = read_run(tmp_path / "one"), read_run(tmp_path / "two")
    assert one["data"]["cache_reused"] is False and two["data"]["cache_reused"] is True
    train = one["data"]["train"]
    assert [s["share"] for s in train["sources"]] == pytest.approx([0.7, 0.3], abs=0.01)
    assert train["rows"] < train["samples"] and 0 <= train["padding_fraction"] < 0.2
    log = (tmp_path / "one" / "kdsweep.log").read_text()
    line = re.search(r"data train: (\d+) samples \(inst.jsonl 70.\d%, chat.parquet 29.\d%\) -> (\d+) rows \(pack, "
                     r"seq_len 128\): \d+ tokens, \d+ targets, \d+ truncated, \d+ dropped, padding \d+\.\d%", log)
    assert line and int(line[1]) == train["samples"] and int(line[2]) == train["rows"]
    # the chats train on each assistant turn as Qwen3's template renders the whole conversation: the last turn with
    # its reasoning block, earlier ones without (the template drops it once a later user turn follows)
    from transformers import AutoTokenizer

    from kdsweep.data.rows import Rows

    samples = chat_turns_trained(Rows.load(Path(one["data"]["cache_dir"]) / "train.pt"),
                                 AutoTokenizer.from_pretrained(zoo_dirs["student"]), seq_len=128)
    assert len(samples) >= 10 and any(len(runs) >= 2 for runs in samples)
    for runs in samples:
        assert "<think>" in runs[-1][:12] and "</think>" in runs[-1] and runs[-1].endswith("<|im_end|>\n"), runs
        assert all(r.endswith("<|im_end|>\n") and "think>" not in r for r in runs[:-1]), runs


def test_the_second_trial_of_a_sweep_reuses_the_tokenization_cache(data_dir, tmp_path):
    """Two trial jobs (workers=0: a warm worker keeps the rows in memory instead, test_workers) share the cache."""
    sweep_dir = tmp_path / "sweep"
    args = search(tmp_path, "cache", {"n_trials": 2, "max_concurrent": 1, "workers": 0, "sampler": "random",
                                      "pruner": "none", "params": {"kd_ratio": "choice(0.3,0.7)"}})
    kdsweep(*args, *mix_args(data_dir, tmp_path / "cache"), f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path)
    logs = [(sweep_dir / str(n) / "kdsweep.log").read_text() for n in (0, 1)]
    built = re.search(r"data: tokenized and cached in (\S+) in ([\d.]+) s", logs[0])
    reused = re.search(r"data: reused the tokenization cache (\S+) \(nothing tokenized; loaded in ([\d.]+) s\)", logs[1])
    assert built and reused and built[1] == reused[1], logs
    assert "tokenized and cached" not in logs[1]
    assert [read_run(sweep_dir / str(n))["data"]["cache_reused"] for n in (0, 1)] == [False, True]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_bad_row_past_the_preflight_is_one_line_before_the_first_step(data_dir, tmp_path, ranks):
    good = (data_dir / "inst.jsonl").read_text()
    (tmp_path / "bad.jsonl").write_text(good + '{"instruction": "x", "input": ""}\n')  # row 201: no output
    proc = kdsweep("data=instruction", f"data.datasets.0.path={tmp_path / 'bad.jsonl'}", "data.seq_len=128",
                   f"data.cache_dir={tmp_path / 'cache'}", f"dist.nproc_per_node={ranks}",
                   f"hydra.run.dir={tmp_path / 'run'}", *QUIET, cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "data.datasets[0]: " in lines[0] and "bad.jsonl row 201: no column 'output'" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_run_resumes_only_on_the_same_data_wherever_it_lies(data_dir, tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text((data_dir / "inst.jsonl").read_text())
    run = [f"hydra.run.dir={tmp_path / 'run'}", "data=instruction", "data.seq_len=128", "data.batch_size=4",
           "data.micro_batch_size=2", "data.max_eval_sequences=4", f"data.cache_dir={tmp_path / 'cache'}",
           "train.max_steps=2", "train.eval_every=2", "checkpoint.export_merged=false", *QUIET]
    kdsweep(*run, f"data.datasets.0.path={src}", cwd=tmp_path)
    src.write_text(src.read_text().replace("the", "a"))  # same path, other content: refused
    proc = kdsweep(*run, f"data.datasets.0.path={src}", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "holds checkpoints of a different training config (data.content:" in proc.stderr
    moved = tmp_path / "moved.jsonl"  # the original content elsewhere: resumed
    moved.write_text((data_dir / "inst.jsonl").read_text())
    kdsweep(*run, f"data.datasets.0.path={moved}", cwd=tmp_path)
    assert read_run(tmp_path / "run")["start_step"] == 2


def test_data_chat_runs_on_the_embedded_models_as_shipped(data_dir, tmp_path):
    """No data.seq_len, no data.chat_template: the preset's length is the embedded models' context and the embedded
    tokenizers carry a chat template (the student renders the chats in its own, the second teacher in its own)."""
    kdsweep("data=chat", f"data.datasets.0.path={data_dir / 'chat.parquet'}", "teacher=tiny_other", "data.batch_size=4",
            "data.micro_batch_size=2", "data.max_eval_sequences=4", "train.max_steps=2", "train.eval_every=2", "checkpoint.save_every=0", "checkpoint.export_merged=false", *QUIET,
            f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    record = read_run(tmp_path / "run")
    assert record["status"] == "completed" and record["steps"] == 2 and record["config"]["data"]["seq_len"] == 512
    assert "alignment" in record  # across tokenizers
