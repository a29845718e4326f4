"""Small builders shared by tests: random tiny Llama models and tokenizers saved as real HF directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
