"""Small builders shared by tests: random tiny Llama models and tokenizers saved as real HF directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kdsweep.startup import RANK_IMPORTS

WORDS = "the cat sat on a mat while dogs ran over hills and birds sang in tall green trees".split()


def tiny_llama(vocab: int = 96, hidden: int = 32, layers: int = 2, seed: int = 0, max_positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, use_cache=False,
    )
    return LlamaForCausalLM(cfg)


def chunk_mb_for(chunks: int, tokens: int, vocab: int) -> float:
    """A ``loss.chunk_mb`` that splits ``tokens`` tokens over a vocabulary of ``vocab`` into ``chunks`` chunks (a
    smaller micro-batch of the same step gets fewer, a larger one more)."""
    return tokens * vocab * 4 / chunks / 2**20 * (1 + 1e-9)


def word_tokenizer(extra_words: tuple[str, ...] = ()):
    """A tiny word-level fast tokenizer with BOS/EOS/PAD/UNK, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>", *WORDS, *extra_words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


# Tiny random-init models of the architectures users bring, built from transformers' own config classes. Every
# one shares the word tokenizer's ids (BOS 1, EOS 2, PAD 3), so any two of them can be teacher and student.
ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "gpt_neox", "olmo2")


def arch_config(arch: str, vocab: int, hidden: int = 32, layers: int = 2, max_positions: int = 64):
    """The config of a tiny ``arch`` model (4 query heads, 2 KV heads where the family has GQA)."""
    import transformers as tf

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
    common = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": 4, "max_position_embeddings": max_positions,
              "use_cache": False, **ids}
    gqa = {**common, "num_key_value_heads": 2}
    head = {"head_dim": hidden // 4}
    return {
        "llama": lambda: tf.LlamaConfig(**gqa, tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**gqa, tie_word_embeddings=True),  # Qwen2.5-0.5B ties its embeddings
        "qwen3": lambda: tf.Qwen3Config(**gqa, **head, tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**gqa, tie_word_embeddings=False),
        # logit soft-capping, tied embeddings, a scaled embedding buffer, sliding window every other layer
        "gemma2": lambda: tf.Gemma2Config(**gqa, **head, sliding_window=8),
        # two rotary buffers (local and global) and the scaled embedding buffer
        "gemma3": lambda: tf.Gemma3TextConfig(**gqa, **head, sliding_window=8),
        "phi3": lambda: tf.Phi3Config(**gqa, tie_word_embeddings=False),  # fused qkv_proj and gate_up_proj
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common),  # Pythia: query_key_value, dense, dense_h_to_4h, ...
        "olmo2": lambda: tf.Olmo2Config(**gqa),
    }[arch]()


def save_arch(path: Path, arch: str, tokenizer, *, hidden: int = 32, layers: int = 2, seed: int = 0,
              pad_vocab: int = 0, max_positions: int = 64) -> Path:
    """A tiny random-init ``arch`` model and ``tokenizer``, saved as a Hugging Face directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = arch_config(arch, len(tokenizer) + pad_vocab, hidden, layers, max_positions)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def word_lines(n: int, vocab: list[str], seed: int, shortest: int = 8, longest: int = 30) -> list[str]:
    """``n`` seeded lines of random words: a corpus for tiny models."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choices(vocab, k=rng.randint(shortest, longest))) for _ in range(n)]


def save_hf_model(path: Path, tokenizer, *, hidden: int = 32, layers: int = 2, seed: int = 0, max_positions: int = 64, pad_vocab: int = 0) -> Path:
    model = tiny_llama(vocab=len(tokenizer) + pad_vocab, hidden=hidden, layers=layers, seed=seed, max_positions=max_positions)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Import into a test module of tiny-tensor tests (gradchecks): one intra-op thread is fastest there, and far
    faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# What a gloo rank imports, once per test worker: a job's rank's imports and these helpers (its bodies' module).
GLOO_PRELOAD = [*RANK_IMPORTS, "helpers"]


def gloo_ranks(body, *args, tmp_path: Path, nprocs: int = 2, timeout_s: float = 120) -> None:
    """Run ``body(rank, *args)`` in ``nprocs`` gloo ranks of one process group (a module-level function: the ranks
    import it). Every test that starts ranks itself goes through here, so all of them tear down the same safe way
    (see :func:`_gloo_rank`).

    The ranks are forked from multiprocessing's forkserver, as a local job's ranks are (``distributed.launch``):
    a fresh process that imported :data:`GLOO_PRELOAD` once for this test worker, never one that ran OpenMP kernels
    (a fork after those can deadlock in the first matmul). Each rank takes this process's environment and
    directory of now, as a spawned one would."""
    import multiprocessing
    import tempfile

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(GLOO_PRELOAD)  # for a server started now; a running one keeps its own
    mp.start_processes(_gloo_rank, args=(body, tempfile.mktemp(dir=tmp_path), nprocs, timeout_s, args,
                                         dict(os.environ), os.getcwd()),
                       nprocs=nprocs, start_method="forkserver")


def _gloo_rank(rank: int, body, init_file: str, world: int, timeout_s: float, args: tuple, env: dict,
               cwd: str) -> None:
    """One rank: join, run ``body``, then leave only once every rank is done with every collective.

    - A barrier after joining: the ranks' connections are all made before any rank goes on.
    - A barrier after ``body``: no rank closes its sockets (by leaving) while a peer still works or communicates.
    - ``gc.collect()`` before ``destroy_process_group``: models sharded with FSDP2 hold the group through their
      device mesh, often in reference cycles; collected here, the group's threads and sockets end on this thread,
      not at interpreter exit in whatever order finalisers run.
    """
    import datetime
    import faulthandler
    import gc

    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    faulthandler.enable()  # a native abort prints every thread's stack into the test's output
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))  # a hang fails the test instead
    try:
        dist.barrier()
        body(rank, *args)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


def run_each(rank: int, configs: list) -> None:
    """A ``gloo_ranks`` body: every config in turn, as a job's rank runs it."""
    from kdsweep.distributed import detect
    from kdsweep.train import run

    for cfg in configs:
        run(cfg, dist=detect())


_ONCE: dict = {}


def once(name: str, build):
    """``build()`` the first time ``name`` is asked for in this test session, its value (or its error, raised again:
    a failed build is not tried twice) every later time. For an artefact several test modules check (a sweep, a
    run): a fixture imported into a second module would be a second fixture there, and build it again."""
    if name not in _ONCE:
        try:
            _ONCE[name] = build()
        except Exception as e:  # noqa: BLE001 - kept to be raised for every test that asks
            _ONCE[name] = e
            raise
    if isinstance(_ONCE[name], Exception):
        raise _ONCE[name]
    return _ONCE[name]


def byte_level_bpe(corpus: list[str], special_tokens: list[str], vocab_size: int):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained here on ``corpus`` (five passes), GPT-2 style: every byte
    is in its alphabet, and ``special_tokens`` are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 5, trainer)
    return tok


def with_sitecustomize(directory: Path, code: str) -> dict[str, str]:
    """The environment whose Python processes run ``code`` at start-up (a ``sitecustomize`` in ``directory``, first
    on ``PYTHONPATH``, before the one the environment had)."""
    import os

    directory.mkdir()
    (directory / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}
