"""The data pipeline end to end: sources → split → samples → mix → rows, and the tokenization cache."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import word_tokenizer
from kdsweep.config.schema import ConfigError, DataConfig, DatasetConfig
from kdsweep.data import dataset as data_mod
from kdsweep.data import key as data_key_mod
from kdsweep.data.dataset import load_data
from kdsweep.data.sampling import StepSampler

WORDS = "the cat sat on a mat while dogs ran over hills and birds sang in tall green trees".split()
IGNORE = -100


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    t = word_tokenizer(("###", "Instruction", "Input", "Response", ":", "user", "assistant"))
    t.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                       "{% if add_generation_prompt %}assistant {% endif %}")
    t.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import random

    rng = random.Random(0)
    root = tmp_path_factory.mktemp("data")
    inst = [{"instruction": sentence(rng, 3), "input": "", "output": sentence(rng, rng.randint(1, 12)), "src": "a"}
            for _ in range(120)]
    chat = [{"messages": [{"role": "user", "content": sentence(rng, 4)},
                          {"role": "assistant", "content": sentence(rng, rng.randint(1, 9))}], "src": "b"}
            for _ in range(60)]
    text = [{"text": sentence(rng, rng.randint(2, 30))} for _ in range(80)]
    return {"inst": write_jsonl(root / "inst.jsonl", inst), "chat": write_jsonl(root / "chat.jsonl", chat),
            "text": write_jsonl(root / "text.jsonl", text), "root": root}


def data_cfg(tmp_path, **kw):
    return DataConfig(cache_dir=str(tmp_path / "cache"), **kw)


def test_embedded_stream_rows_are_the_windows_of_the_eos_joined_corpus(tmp_path):
    from kdsweep.data.text import embedded_corpus, tokenize_to_sequences
    from kdsweep.models import zoo

    from transformers import AutoTokenizer

    tok_dir = zoo.tokenizer_dir()
    t = AutoTokenizer.from_pretrained(tok_dir)
    data = load_data(data_cfg(tmp_path), t, tok_dir)
    corpus = embedded_corpus(0.05, 1234)
    for rows, docs in ((data.train, corpus.train), (data.eval, corpus.eval)):
        w = tokenize_to_sequences(t, docs, 128)
        batch = rows.batch(range(len(rows)))
        assert torch.equal(batch.input_ids, w[:, :-1]) and torch.equal(batch.labels, w[:, 1:])
        assert batch.position_ids is None and batch.attention_mask is None


def test_packed_and_padded_rows_hold_the_same_samples(tmp_path, files, tok, tok_dir):
    src = (DatasetConfig(path=files["inst"], format="instruction"),)
    packed = load_data(data_cfg(tmp_path, datasets=src, sequences="pack", seq_len=32), tok, tok_dir)
    padded = load_data(data_cfg(tmp_path, datasets=src, sequences="pad", seq_len=32), tok, tok_dir)
    st_pack, st_pad = packed.stats["train"], padded.stats["train"]
    assert st_pack["samples"] == st_pad["samples"] == st_pad["rows"] == 120 - st_pack["sources"][0]["held_out"]
    assert st_pack["tokens"] == st_pad["tokens"] == int(padded.train.tokens.sum()) == int(packed.train.tokens.sum())
    assert st_pack["targets"] == st_pad["targets"] > 0
    assert st_pack["rows"] < st_pad["rows"] and 0 <= st_pack["padding_fraction"] < 0.5
    # a packed row: positions restart at every document; padded micro-batches carry a mask when lengths differ
    b = packed.train.batch([0, 1])
    assert b.position_ids is not None and b.attention_mask is None and b.input_ids.shape == (2, 32)
    assert (b.position_ids == 0).sum(-1).min() >= 2  # several documents in a row
    b = padded.train.batch(range(8))
    assert b.attention_mask is not None and b.input_ids.shape[1] == int(padded.train.lengths[:8].max())
    assert (b.labels[b.attention_mask == 0] == IGNORE).all()
    # each padded row is one rendered sample: its prompt masked, its response (and EOS) kept
    first = padded.train.batch([0])
    text = tok.convert_ids_to_tokens(first.labels[0][first.labels[0] != IGNORE].tolist())
    assert text[-1] == "</s>" and "Instruction" not in text and "Response" not in text


def test_weighted_mix_matches_its_weights_and_is_seeded(tmp_path, files, tok, tok_dir):
    src = (DatasetConfig(path=files["inst"], format="instruction", weight=3.0),
           DatasetConfig(path=files["chat"], format="chat", weight=1.0))
    cfg = data_cfg(tmp_path, datasets=src, mix="weighted", mix_samples=400, sequences="pad", seq_len=64)
    data = load_data(cfg, tok, tok_dir)
    shares = [s["samples"] for s in data.stats["train"]["sources"]]
    assert shares == [300, 100]  # exact counts by largest remainder; the chat source is up-sampled
    # the source of every row: chat samples start with "user"
    first = torch.stack([data.train.input_ids[int(o)] for o in data.train.offsets[:-1]])
    is_chat = (first == tok.convert_tokens_to_ids("user")).tolist()
    assert sum(is_chat) == 100
    # within the batches the run draws, the chat share stays near 1/4 (binomial tolerance, 4 sigma)
    sampler = StepSampler(len(data.train), 16, seed=0)
    drawn = torch.cat([sampler.global_batch(k) for k in range(10)]).tolist()
    share = sum(is_chat[i] for i in drawn) / len(drawn)
    assert abs(share - 0.25) < 4 * (0.25 * 0.75 / len(drawn)) ** 0.5
    # the same seed gives the same rows; another seed another order
    again = data_mod.build(cfg, tok, IGNORE)[0]["train"]
    assert torch.equal(again.input_ids, data.train.input_ids)
    other = data_mod.build(DataConfig(**{**vars(cfg), "split_seed": 7}), tok, IGNORE)[0]["train"]
    assert not torch.equal(other.input_ids[:200], data.train.input_ids[:200])


def test_batch_order_is_identical_across_world_sizes(tmp_path, files, tok, tok_dir):
    src = (DatasetConfig(path=files["inst"], format="instruction"), DatasetConfig(path=files["text"]))
    data = load_data(data_cfg(tmp_path, datasets=src, mix="weighted", sequences="pack", seq_len=32), tok, tok_dir)
    sampler = StepSampler(len(data.train), 8, seed=3)
    for step in range(5):
        whole = data.train.batch(sampler.global_batch(step))
        for world in (2, 4):
            parts = [data.train.batch(idx) for r in range(world)
                     for idx in sampler.rank_micro_batches(step, r, world, micro_batch_size=1)]
            assert torch.equal(torch.cat([p.input_ids for p in parts]), whole.input_ids)
            assert torch.equal(torch.cat([p.position_ids for p in parts]), whole.position_ids)


def test_explicit_eval_datasets_or_a_seeded_held_out_fraction(tmp_path, files, tok, tok_dir):
    src = (DatasetConfig(path=files["text"]),)
    held = load_data(data_cfg(tmp_path, datasets=src, eval_fraction=0.25, sequences="pad"), tok, tok_dir)
    assert held.stats["train"]["sources"][0]["held_out"] == 20 == held.stats["eval"]["samples"]
    assert held.stats["train"]["samples"] == 60
    explicit = load_data(data_cfg(tmp_path, datasets=src, eval_datasets=(DatasetConfig(path=files["inst"],
                                                                                      format="instruction"),),
                                  sequences="pad"), tok, tok_dir)
    assert explicit.stats["train"]["samples"] == 80 and explicit.stats["eval"]["samples"] == 120


def test_a_test_split_is_disjoint_and_leaves_the_eval_rows_as_they_were(tmp_path, files, tok, tok_dir):
    src = (DatasetConfig(path=files["text"]),)
    rows = lambda data: {tuple(data.input_ids[int(a):int(b)].tolist()) for a, b in zip(data.offsets, data.offsets[1:])}
    without = load_data(data_cfg(tmp_path, datasets=src, eval_fraction=0.25, sequences="pad"), tok, tok_dir)
    assert without.test is None and "test" not in without.stats
    split = load_data(data_cfg(tmp_path, datasets=src, eval_fraction=0.25, test_fraction=0.25, sequences="pad"),
                      tok, tok_dir)
    assert torch.equal(split.eval.input_ids, without.eval.input_ids)  # the eval rows are the same rows
    assert split.stats["test"]["samples"] == 15 == split.stats["train"]["sources"][0]["test"]  # 25% of the 60 left
    assert split.stats["train"]["samples"] == 45
    assert rows(split.test) | rows(split.train) == rows(without.train)  # carved from the training rows alone
    assert not rows(split.test) & rows(split.train) and not rows(split.test) & rows(split.eval)
    explicit = load_data(data_cfg(tmp_path, datasets=src, eval_fraction=0.25, sequences="pad",
                                  test_datasets=(DatasetConfig(path=files["inst"], format="instruction"),)),
                         tok, tok_dir)
    assert explicit.stats["test"]["samples"] == 120 and explicit.stats["train"]["samples"] == 60
    with pytest.raises(ConfigError, match="data.test_fraction=0.8 must be in"):
        DataConfig(eval_fraction=0.25, test_fraction=0.8)


def test_the_cache_is_reused_and_keyed_by_what_shapes_the_rows(tmp_path, files, tok, tok_dir, monkeypatch):
    src = (DatasetConfig(path=files["inst"], format="instruction"),)
    cfg = data_cfg(tmp_path, datasets=src, sequences="pack", seq_len=32)
    first = load_data(cfg, tok, tok_dir)
    assert not first.reused

    def no_tokenizing(*a, **kw):
        raise AssertionError("re-tokenized")

    monkeypatch.setattr(data_mod, "render", no_tokenizing)
    second = load_data(DataConfig(**{**vars(cfg), "batch_size": 4, "micro_batch_size": 2}), tok, tok_dir)
    assert second.reused and second.cache_dir == first.cache_dir
    assert torch.equal(second.train.input_ids, first.train.input_ids)
    monkeypatch.undo()
    key = lambda c, d=tok_dir: data_key_mod.cache_key(c, d, IGNORE, tmp_path / "memo")
    base = key(cfg)
    assert key(DataConfig(**{**vars(cfg), "seq_len": 64})) != base
    assert key(DataConfig(**{**vars(cfg), "train_on_prompt": True})) != base
    assert key(DataConfig(**{**vars(cfg), "sequences": "pad"})) != base
    assert key(DataConfig(**{**vars(cfg), "eval_batch_size": 3})) == base
    copy = Path(files["root"]) / "copy.jsonl"
    copy.write_bytes(Path(files["inst"]).read_bytes())
    moved = DataConfig(**{**vars(cfg), "datasets": (DatasetConfig(path=str(copy), format="instruction"),)})
    assert key(moved) == base  # keyed by content, not by where the file lies
    copy.write_text(copy.read_text().replace("cat", "dog"))
    assert key(moved) != base
    other_tok = tmp_path / "tok2"
    word_tokenizer(("zebra",)).save_pretrained(other_tok)
    assert key(cfg, other_tok) != base
    with_template = DataConfig(**{**vars(cfg), "chat_template": "{{ messages }}"})
    assert key(with_template) != base
    as_text = Path(files["root"]) / "same_bytes.txt"  # the same bytes read another way give other rows
    as_text.write_bytes(Path(files["inst"]).read_bytes())
    assert key(DataConfig(**{**vars(cfg), "datasets": (DatasetConfig(path=str(as_text), format="instruction"),)})) != base


BUILD = textwrap.dedent("""
    import json, sys
    from transformers import AutoTokenizer
    from kdsweep.config.schema import DataConfig, DatasetConfig
    from kdsweep.data.dataset import load_data
    cache, path, tok_dir = sys.argv[1:4]
    cfg = DataConfig(cache_dir=cache, datasets=(DatasetConfig(path=path, format="instruction"),),
                     sequences="pack", seq_len=16)
    d = load_data(cfg, AutoTokenizer.from_pretrained(tok_dir), __import__("pathlib").Path(tok_dir))
    print(json.dumps({"reused": d.reused, "dir": str(d.cache_dir), "sum": int(d.train.input_ids.sum()),
                      "rows": len(d.train)}))
""")


def test_jobs_building_at_once_build_once_and_agree(tmp_path, files, tok_dir):
    big = [json.loads(line) for line in Path(files["inst"]).read_text().splitlines()] * 20
    path = write_jsonl(tmp_path / "big.jsonl", big)
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path / "cache"), path, str(tok_dir)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["reused"] for o in outs) == [False, True, True]  # one builder, two waited and reused
    assert len({(o["dir"], o["sum"], o["rows"]) for o in outs}) == 1
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".") and p.is_dir()]
    assert leftovers == []  # no temp directory left behind


def test_a_bad_row_deep_in_a_source_is_one_line_naming_it(tmp_path, tok, tok_dir):
    rows = [{"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]}] * 150
    rows.append({"messages": []})
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = data_cfg(tmp_path, datasets=(DatasetConfig(path=path, format="chat"),), sequences="pack", seq_len=32)
    with pytest.raises(ConfigError, match=r"data\.datasets\[0\]: .*chat\.jsonl row 151: a chat row needs") as e:
        load_data(cfg, tok, tok_dir)
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "cache").glob("*/train.pt"))  # nothing cached


def test_a_weight_0_source_is_neither_trained_on_nor_held_out(tmp_path, files, tok, tok_dir):
    src = (DatasetConfig(path=files["inst"], format="instruction", weight=1.0),
           DatasetConfig(path=files["chat"], format="chat", weight=0.0))
    data = load_data(data_cfg(tmp_path, datasets=src, mix="weighted", sequences="pad"), tok, tok_dir)
    assert [s["samples"] for s in data.stats["train"]["sources"]] == [114, 0]
    assert [s["key"] for s in data.stats["eval"]["sources"]] == ["data.datasets[0]"]


def test_a_source_with_nothing_to_train_on_says_why(tmp_path, tok, tok_dir):
    rows = [{"messages": [{"role": "human", "content": "the cat"}, {"role": "gpt", "content": "sat"}]}] * 10
    path = write_jsonl(tmp_path / "sharegpt.jsonl", rows)
    cfg = data_cfg(tmp_path, datasets=(DatasetConfig(path=path, format="chat"),), sequences="pack", seq_len=32)
    with pytest.raises(ConfigError, match=r"^data\.datasets\[0\]\.path: .*sharegpt\.jsonl: no row has a token to "
                                          r"train on \(format chat trains on messages whose role is 'assistant'\)"):
        load_data(cfg, tok, tok_dir)
