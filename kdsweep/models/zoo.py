"""The embedded tiny zoo: a tokenizer, a teacher and a student base, built locally and deterministically.

Nothing is downloaded. The first use trains a byte-level BPE tokenizer on the embedded corpus, pre-trains a
small Llama teacher and a smaller Llama student base on the corpus' training split, and saves each as an
ordinary Hugging Face directory, so they load through the very code that loads ``/ckpts/Llama-3.2-1B``. A second
teacher (``tiny-teacher-other``) is the same architecture and recipe in its own tokenizer (SentencePiece-style BPE
with byte fallback, another vocabulary): with the tiny student, a cross-tokenizer pair.
Each artefact is cached under ``$KDSWEEP_CACHE`` (default ``~/.cache/kdsweep``) in a directory named by a
hash of everything that determines it; concurrent builders wait on a file lock and the directory appears by
an atomic rename, so a killed build never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from kdsweep.data.cache import built_once, kdsweep_cache
from kdsweep.data.text import EMBEDDED_CORPUS, embedded_corpus

log = logging.getLogger(__name__)

ZOO_VERSION = 1
# The default data split (DataConfig defaults): the tiny models never see the default held-out documents.
SPLIT = {"eval_fraction": 0.05, "split_seed": 1234}
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] + ':' + ' ' + message['content'] }}"
                 "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
"""The zoo tokenizers' chat template, made of tokens they already have (``user: hi`` / ``assistant: hello</s>``, a
line each), so ``data=chat`` runs on the embedded models and an export's tokenizer renders conversations."""
TOKENIZER = {"vocab_size": 2048, "min_frequency": 2, "chat_template": CHAT_TEMPLATE}
"""The tiny tokenizer: byte-level BPE (``Ġ`` for a space), shared by the tiny teacher and student."""
OTHER_TOKENIZER = {"vocab_size": 1536, "min_frequency": 2, "pieces": "sentencepiece_byte_fallback",
                   "chat_template": CHAT_TEMPLATE}
"""The second teacher's own: BPE on the same documents in SentencePiece's conventions (``▁`` for a space, unknown
characters as ``<0xAB>`` byte tokens) and a smaller vocabulary, so the pair is a real cross-tokenizer pair."""
TOKENIZERS = {"tiny": TOKENIZER, "tiny_other": OTHER_TOKENIZER}
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
ARCHS: dict[str, dict[str, Any]] = {
    "tiny-teacher": {
        "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "max_position_embeddings": 512, "rope_theta": 10000.0,
    },
    "tiny-student": {
        "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 10000.0,
    },
}
ARCHS["tiny-teacher-other"] = ARCHS["tiny-teacher"]  # the same teacher, in its own tokens
TOKENIZER_OF = {"tiny-teacher": "tiny", "tiny-student": "tiny", "tiny-teacher-other": "tiny_other"}
# Pre-training recipes. The teacher learns all training documents; the student base only the first half of
# them (Genesis and part of Proverbs), so distilling on the whole corpus is a real domain transfer, as when a
# generic 1B student learns a teacher's domain.
RECIPES: dict[str, dict[str, Any]] = {
    "tiny-teacher": {"steps": 400, "batch_size": 16, "seq_len": 128, "lr": 5e-3, "warmup": 20, "seed": 0, "docs": 1.0},
    "tiny-student": {"steps": 150, "batch_size": 16, "seq_len": 128, "lr": 3e-3, "warmup": 10, "seed": 1, "docs": 0.5},
}
RECIPES["tiny-teacher-other"] = RECIPES["tiny-teacher"]


def cache_root() -> Path:
    return kdsweep_cache() / "zoo"


def max_positions(name: str) -> int:
    """Context length of a zoo model, known without building it."""
    return int(ARCHS[name]["max_position_embeddings"])


def vocab_size(name: str) -> int:
    """The vocabulary of a zoo model's tokenizer, known without building it."""
    return int(TOKENIZERS[TOKENIZER_OF[name]]["vocab_size"])


def _digest(*parts: Any) -> str:
    h = hashlib.sha256(EMBEDDED_CORPUS.read_bytes())
    h.update(json.dumps([ZOO_VERSION, SPLIT, *parts], sort_keys=True).encode())
    return h.hexdigest()[:16]


def tokenizer_dir(which: str = "tiny") -> Path:
    """A zoo tokenizer, trained on the embedded corpus' training documents, built once: ``tiny`` (byte-level BPE)
    or ``tiny_other`` (SentencePiece-style pieces with byte fallback)."""
    spec = TOKENIZERS[which]
    name = "tokenizer" if which == "tiny" else f"tokenizer-{which}"  # the first one's name and key as before
    with built_once(cache_root(), f"{name}-{_digest(spec, SPECIAL_TOKENS)}") as (final, tmp):
        if tmp is not None:
            log.info("building the %s tokenizer (once) in %s", which, final)
            (_train_tokenizer if which == "tiny" else _train_other_tokenizer)().save_pretrained(tmp)
    return final


def _train_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER["vocab_size"],
        min_frequency=TOKENIZER["min_frequency"],
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(embedded_corpus(**SPLIT).train, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS)


def _train_other_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(
        vocab_size=OTHER_TOKENIZER["vocab_size"],
        min_frequency=OTHER_TOKENIZER["min_frequency"],
        special_tokens=[*SPECIAL_TOKENS.values(), *(f"<0x{b:02X}>" for b in range(256))],
        limit_alphabet=100,
        show_progress=False,
    )
    tok.train_from_iterator(embedded_corpus(**SPLIT).train, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS)


def model_dir(name: str) -> Path:
    """HF directory of zoo model ``name`` (weights + config + tokenizer), built and cached on first use."""
    if name not in ARCHS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(ARCHS)}")
    which = TOKENIZER_OF[name]
    tok_dir = tokenizer_dir(which)
    spec = TOKENIZERS[which] if which != "tiny" else TOKENIZER
    key = _digest(spec, SPECIAL_TOKENS, ARCHS[name], RECIPES[name])
    with built_once(cache_root(), f"{name}-{key}") as (final, tmp):
        if tmp is not None:
            log.info("pre-training the embedded %s (once) into %s", name, final)
            _pretrain(name, tok_dir, tmp)
    return final


def _pretrain(name: str, tok_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kdsweep.data.sampling import StepSampler
    from kdsweep.data.text import tokenize_to_sequences

    recipe = RECIPES[name]
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(recipe["seed"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        use_cache=False,
        **ARCHS[name],
    )
    model = LlamaForCausalLM(config)
    docs = embedded_corpus(**SPLIT).train
    seqs = tokenize_to_sequences(tokenizer, docs[: round(len(docs) * recipe["docs"])], recipe["seq_len"])
    sampler = StepSampler(len(seqs), recipe["batch_size"], recipe["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / recipe["warmup"]) * max(0.05, 1 - s / recipe["steps"])
    )
    model.train()
    for step in range(recipe["steps"]):
        batch = seqs[sampler.global_batch(step)]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == recipe["steps"] - 1:
            log.info("%s pre-training step %d/%d: loss %.3f", name, step + 1, recipe["steps"], loss.item())
    # not save_pretrained: in a rank of a process group other than 0 (the one that won the build's lock) transformers
    # writes no weights and no config, and the zoo would keep a model without them
    from safetensors.torch import save_model

    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    (out / "kdsweep_zoo.json").write_text(json.dumps({"name": name, "arch": ARCHS[name], "recipe": recipe}, indent=2))
