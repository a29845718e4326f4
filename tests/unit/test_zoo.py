"""The embedded zoo builds deterministically, caches by content, and survives concurrent builders."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kdsweep.models import zoo

BUILD = "from kdsweep.models import zoo; print(zoo.tokenizer_dir())"


def build_in(cache: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD], env={**os.environ, "KDSWEEP_CACHE": str(cache)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def digest(d: Path) -> str:
    return hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()


def test_tokenizer_is_deterministic_and_concurrent_builds_agree(tmp_path):
    a, b = build_in(tmp_path / "one"), build_in(tmp_path / "one")  # two builders racing on one cache
    c = build_in(tmp_path / "two")
    outs = [p.communicate()[0].strip() for p in (a, b, c)]
    assert all(p.returncode == 0 for p in (a, b, c))
    assert outs[0] == outs[1]
    assert [p.name for p in (tmp_path / "one" / "zoo").iterdir() if not p.name.startswith(".")] == [Path(outs[0]).name]
    assert digest(Path(outs[0])) == digest(Path(outs[2]))  # same inputs, same tokenizer, bit for bit
    assert Path(outs[0]).name == Path(outs[2]).name  # the directory name is the content key


def test_cache_key_covers_the_corpus_and_the_recipe(tmp_path, monkeypatch):
    """The key changes with the recipe and with the corpus' content, so a stale model is never reused."""
    key = zoo._digest(zoo.ARCHS["tiny-teacher"], zoo.RECIPES["tiny-teacher"])
    assert zoo._digest(zoo.ARCHS["tiny-teacher"], {**zoo.RECIPES["tiny-teacher"], "steps": 1}) != key
    corpus = tmp_path / "kjv.txt"
    corpus.write_bytes(zoo.EMBEDDED_CORPUS.read_bytes() + b"one more document\n")
    monkeypatch.setattr(zoo, "EMBEDDED_CORPUS", corpus)
    assert zoo._digest(zoo.ARCHS["tiny-teacher"], zoo.RECIPES["tiny-teacher"]) != key


def test_each_model_pretrains_through_the_zoo_s_own_code_at_two_steps(tmp_path, monkeypatch):
    """The first-run build, end to end, at a two-step recipe (CI keeps the real zoo between runs: zoo_store): the
    tokenizers trained, each model pre-trained, saved and loadable as a Hugging Face directory, bit for bit the same
    in a second cache, and trained: its weights are not those the same build saves at a learning rate of 0, which
    are the initialisation at the recipe's seed."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    built = {}
    recipes = dict(zoo.RECIPES)
    for cache, change in (("one", {}), ("two", {}), ("zero", {"lr": 0.0})):
        for name in zoo.ARCHS:
            monkeypatch.setitem(zoo.RECIPES, name, {**recipes[name], "steps": 2, **change})
        monkeypatch.setenv("KDSWEEP_CACHE", str(tmp_path / cache))
        with torch.random.fork_rng():
            built[cache] = {name: zoo.model_dir(name) for name in zoo.ARCHS}
    for name, d in built["one"].items():
        assert json.loads((d / "kdsweep_zoo.json").read_text())["recipe"]["steps"] == 2
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d)
        assert len(tok) == zoo.vocab_size(name) == model.config.vocab_size
        assert model.config.hidden_size == zoo.ARCHS[name]["hidden_size"]
        assert (d / "model.safetensors").read_bytes() == (built["two"][name] / "model.safetensors").read_bytes(), name
        with torch.random.fork_rng():
            torch.manual_seed(zoo.RECIPES[name]["seed"])
            init = LlamaForCausalLM(LlamaConfig.from_pretrained(d)).state_dict()
        weights, untrained = (load_file(b[name] / "model.safetensors") for b in (built["one"], built["zero"]))
        assert weights.keys() == init.keys() == untrained.keys()
        assert all(torch.equal(untrained[k], init[k]) for k in init), name
        assert not torch.equal(weights["lm_head.weight"], init["lm_head.weight"]), name


def test_ci_s_store_gives_a_fresh_cache_its_key_s_zoo_and_keeps_only_that_key(tmp_path, monkeypatch):
    import zoo_store

    built = tmp_path / "cache_a" / "zoo"
    for entry in ("tokenizer-1", "tiny-teacher-2", ".tiny-student-3-tmp"):  # the last: a build cut short
        (built / entry).mkdir(parents=True)
        (built / entry / "model.safetensors").write_bytes(entry.encode())
    (built / ".tiny-teacher-2.lock").write_text("")
    store = tmp_path / "store"
    assert zoo_store.save(store, built) == ["tiny-teacher-2", "tokenizer-1"]
    assert zoo_store.save(store, built) == []  # kept once
    fresh = tmp_path / "cache_b" / "zoo"
    assert zoo_store.restore(store, fresh) == ["tiny-teacher-2", "tokenizer-1"]
    assert sorted(p.name for p in fresh.iterdir() if p.is_dir()) == ["tiny-teacher-2", "tokenizer-1"]  # no temp dir
    assert (fresh / "tiny-teacher-2" / "model.safetensors").read_bytes() == b"tiny-teacher-2"

    # the key covers the zoo's code and what it imports from kdsweep/data: a change there is another key
    repo = tmp_path / "repo"
    shutil.copytree(zoo_store.REPO / "kdsweep" / "models", repo / "kdsweep" / "models")
    shutil.copytree(zoo_store.REPO / "kdsweep" / "data", repo / "kdsweep" / "data")
    assert zoo_store.key(repo) == zoo_store.key()
    text = repo / "kdsweep" / "data" / "text.py"
    text.write_text(text.read_text() + "\n")
    assert zoo_store.key(repo) != zoo_store.key()
    monkeypatch.setattr(zoo_store, "key", lambda repo=None: "another")  # another key finds nothing; saving it
    assert zoo_store.restore(store, tmp_path / "cache_c" / "zoo") == []  # keeps only its own zoo
    assert zoo_store.save(store, built) == ["tiny-teacher-2", "tokenizer-1"]
    assert [p.name for p in store.iterdir()] == ["another"]
