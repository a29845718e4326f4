"""The GPU check's in-process part: kdsweep's own step (``train_step``, ``micro_batch_backward``, the live and
cached teacher, FSDP2 sharding, LoRA wrapping) on models built in memory with random weights: real Llama 3 shapes
on the GPU, tiny ones in the dry run. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch import nn

from budget import Budget
from memory import per_rank

LLAMA_31_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": False}
LLAMA_32_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
               "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": True}


@dataclass(frozen=True)
class Sizes:
    teacher: dict[str, Any]
    student: dict[str, Any]
    vocab: int
    seq: int
    micro_batch: int
    lora_rank: int
    warmup_steps: int
    timed_steps: int
    max_micro_batch: int
    """The search stops here even when more would fit."""
    cache_rows: int
    cache_k: int = 32
    dtype: torch.dtype = field(default=torch.bfloat16)


REAL = Sizes(teacher=LLAMA_31_8B, student=LLAMA_32_1B, vocab=128256, seq=2048, micro_batch=4, lora_rank=64,
             warmup_steps=2, timed_steps=4, max_micro_batch=256, cache_rows=32)
TINY = Sizes(teacher={**LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2},
             student={**LLAMA_32_1B, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2},
             vocab=512, seq=64, micro_batch=2, lora_rank=8, warmup_steps=1, timed_steps=2, max_micro_batch=8,
             cache_rows=4)


# -- devices -------------------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> int:
    """Start measuring peak memory; returns what is allocated now (bytes; 0 on the CPU)."""
    if device.type != "cuda":
        return 0
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def peak_gb(device: torch.device, base: int = 0) -> float | None:
    """Peak allocated device memory since ``reset_peak`` above ``base`` (None on the CPU: not measured there)."""
    return None if device.type != "cuda" else round((torch.cuda.max_memory_allocated(device) - base) / 2**30, 3)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_matmul(device: torch.device, budget: Budget) -> dict[str, Any]:
    """The dense matmul peak: bf16 8192³ on the GPU (fp32 256³ on the CPU), median of timed runs."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(25):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        sync(device)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 10)
        if budget.left() < 2:
            break
    flops = 2 * n**3 / statistics.median(times)
    return {"flops_per_s": flops, "n": n, "dtype": str(dtype), "summary": f"{flops / 1e12:.1f} TFLOP/s ({dtype}, {n}³)"}


# -- models, data, FLOPs -------------------------------------------------------------------------------------------
def llama(shape: dict[str, Any], sizes: Sizes, device: torch.device) -> nn.Module:
    """A random-init Llama of ``shape`` built on ``device`` in the check's dtype (no file, no download)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=sizes.vocab, max_position_embeddings=max(sizes.seq, 4096), use_cache=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=sizes.dtype)


_TEACHER: dict[str, nn.Module] = {}


def teacher(sizes: Sizes, device: torch.device) -> nn.Module:
    """The frozen teacher, as ``load_teacher`` leaves it; built once and shared by the checks."""
    if "model" not in _TEACHER:
        _TEACHER["model"] = llama(sizes.teacher, sizes, device).eval().requires_grad_(False)
    return _TEACHER["model"]


def student(sizes: Sizes, device: torch.device, lora: bool, dtype: torch.dtype | None = None) -> nn.Module:
    """The student as ``load_student`` makes it: kdsweep's LoRA wrapping (all-linear) or fully trainable (its
    weights in ``dtype``: the check's own by default; fp32 for a full fine-tune's master weights)."""
    from dataclasses import replace

    from kdsweep.config.schema import StudentConfig
    from kdsweep.models.load import student_wrapper

    rank = sizes.lora_rank if lora else 0
    cfg = StudentConfig(zoo="tiny-student", lora_rank=rank, lora_alpha=2.0 * max(rank, 1))
    return student_wrapper(cfg, seed=0)(llama(sizes.student, replace(sizes, dtype=dtype or sizes.dtype), device))


def rows(n: int, sizes: Sizes, seed: int = 0):
    """``n`` random full-length rows (kdsweep's ``Rows``: their batches carry row indices, as a cache needs)."""
    from kdsweep.data.rows import Rows

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, sizes.vocab, (n, sizes.seq + 1), generator=g)
    return Rows.from_rows(ids[:, :-1], ids[:, 1:], None, [sizes.seq] * n, pad_id=0, ignore_index=-100)


def linear_weights(shape: dict[str, Any], vocab: int) -> int:
    """Weights of every matmul of one token's forward (the output layer included, embeddings not)."""
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    return n * (2 * h * h + 2 * h * kv + 3 * h * i) + h * vocab


def attention_flops(shape: dict[str, Any], seq: int) -> int:
    """Forward FLOPs per token of attention's scores and values, over the full row."""
    return 4 * shape["num_hidden_layers"] * seq * shape["hidden_size"]


def step_flops(sizes: Sizes, adapter_params: int, lora: bool, tokens: int, causal: bool = False) -> float:
    """FLOPs of one KD step on ``tokens`` (the module docstring of check.py states the convention)."""
    attn = lambda shape: attention_flops(shape, sizes.seq) * (0.5 if causal else 1.0)
    teacher_fwd = 2 * linear_weights(sizes.teacher, sizes.vocab) + attn(sizes.teacher)
    s_lin = 2 * linear_weights(sizes.student, sizes.vocab)
    student = (2 * s_lin + 3 * attn(sizes.student) + 6 * adapter_params) if lora else 3 * (s_lin + attn(sizes.student))
    return float(tokens * (teacher_fwd + student))


# -- the step --------------------------------------------------------------------------------------------------------
def loss_cfg(impl: str):
    from kdsweep.config.schema import LossConfig

    return LossConfig(kd_ratio=0.5, impl=impl)


def timed_steps(model: nn.Module, source: Any, data, sizes: Sizes, impl: str, device: torch.device,
                micro_batch: int, steps: tuple[int, int], compute: Any = contextlib.nullcontext) -> dict[str, Any]:
    """``train_step`` as the loop runs it (AdamW, kdsweep's schedule; under ``compute()``, as a trial's
    ``compute``: autocast for an unsharded ``train.dtype=bf16`` student): warm-up steps, then the median of the timed."""
    from kdsweep.config.schema import OptimConfig
    from kdsweep.distributed import single_process
    from kdsweep.train import schedule
    from kdsweep.train.step import Learner, train_step

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    scheduler = schedule.build(optimizer, OptimConfig(lr=1e-5), 1000)
    warmup, timed = steps
    times, stats = [], None
    base = reset_peak(device)
    for k in range(warmup + timed):
        idx = [(k * micro_batch + j) % len(data) for j in range(micro_batch)]
        batch = data.batch(idx).to(device)
        sync(device)
        t0 = time.perf_counter()
        with compute():
            stats, = train_step([Learner(model, source, optimizer, scheduler, loss_cfg(impl), max_grad_norm=1.0)],
                                [batch], dist=single_process())
        sync(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[warmup:])
    tokens = micro_batch * sizes.seq
    state = sorted({str(v.dtype).removeprefix("torch.") for s in optimizer.state.values() for k, v in s.items()
                    if k in ("exp_avg", "exp_avg_sq")})
    del optimizer
    return {"step_s": round(step_s, 4), "first_step_s": round(times[0], 3), "tokens_per_s": round(tokens / step_s),
            "peak_mem_gb": peak_gb(device, 0), "peak_above_models_gb": peak_gb(device, base), "loss": stats.loss,
            "adamw_state_dtypes": state}


def live(model: nn.Module, impl: str):
    from kdsweep.teacher.live import LiveTeacher

    return LiveTeacher(model, fused=impl == "fused")


def real_shapes(sizes: Sizes, device: torch.device, peak_flops: float | None, budget: Budget) -> dict[str, Any]:
    """tokens/s, step time, peak memory and MFU of the KD step, LoRA and full × chunked and fused; then the loss
    alone (output layers and KD loss, forward and backward) chunked vs fused at the same micro-batch."""
    budget.need(20, "building the teacher")
    t = teacher(sizes, device)
    data = rows(4 * sizes.micro_batch, sizes)
    arms: dict[str, Any] = {}
    for lora in (True, False):
        for impl in ("chunked", "fused"):
            name = f"{'lora' if lora else 'full'}_{impl}"
            if budget.left() < 15:
                arms[name] = {"status": "skipped: the check's budget is spent"}
                continue
            s = student(sizes, device, lora)
            adapter = sum(p.numel() for p in s.parameters() if p.requires_grad) if lora else 0
            r = timed_steps(s, live(t, impl), data, sizes, impl, device, sizes.micro_batch,
                            (sizes.warmup_steps, sizes.timed_steps))
            flops = step_flops(sizes, adapter, lora, sizes.micro_batch * sizes.seq)
            # what benchmarks/gpu/memory.py (the README's table) predicts for this arm: one rank, no activation
            # checkpointing, LoRA adapters in fp32 over the bf16 base, a full fine-tune all in bf16 here
            predicted = per_rank(sizes.teacher, sizes.student, sizes.vocab, lora_rank=sizes.lora_rank if lora else 0,
                                 seq=sizes.seq, micro_batch=sizes.micro_batch, activation_checkpointing=False, loss=impl,
                                 pure_bf16=not lora)
            r.update(status="ok", flops_per_step=flops, trainable_params=sum(p.numel() for p in s.parameters() if p.requires_grad),
                     predicted_peak_gib=round(predicted.total / 2**30, 3), predicted=predicted.row())
            if peak_flops:
                r["mfu"] = round(flops / r["step_s"] / peak_flops, 4)
                r["mfu_causal"] = round(step_flops(sizes, adapter, lora, sizes.micro_batch * sizes.seq, causal=True)
                                        / r["step_s"] / peak_flops, 4)
            arms[name] = r
            del s
            free(device)
            print(f"   {name}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']} tokens/s, MFU {r.get('mfu')}", flush=True)
    loss = loss_alone(sizes, t, device, budget)
    rows_out = [f"{n}: {a['step_s'] * 1e3:.0f} ms/step, {a['tokens_per_s']} tok/s, peak {a['peak_mem_gb']} GiB "
                f"(predicted {a['predicted_peak_gib']}), MFU {a.get('mfu')} (causal {a.get('mfu_causal')})"
                if a.get("status") == "ok" else f"{n}: {a['status']}" for n, a in arms.items()]
    rows_out.append(f"loss alone at micro-batch {sizes.micro_batch}: fused/chunked memory {loss.get('memory_ratio')}, "
                    f"time {loss.get('time_ratio')}")
    lora = arms.get("lora_chunked", {})
    return {"sizes": {"seq": sizes.seq, "vocab": sizes.vocab, "micro_batch": sizes.micro_batch,
                      "lora_rank": sizes.lora_rank, "teacher": sizes.teacher, "student": sizes.student,
                      "dtype": str(sizes.dtype)},
            "peak_flops_per_s": peak_flops, "arms": arms, "loss_alone": loss, "rows": rows_out,
            "summary": f"LoRA chunked MFU {lora.get('mfu')}, {lora.get('tokens_per_s')} tokens/s"}


def precision(sizes: Sizes, device: torch.device, budget: Budget) -> dict[str, Any]:
    """A full fine-tune of the 1B-shaped student as ``train.dtype=bf16`` trains it (fp32 master weights and AdamW
    state, bf16 compute through autocast) and as ``bf16_pure`` (bf16 weights and state): step time, peak memory, the
    dtypes of the weights and of AdamW's moments, and how many of a matrix's weights updates of 1e-5 moved."""
    from kdsweep.models.precision import Precision

    budget.need(20, "building the teacher")
    t = teacher(sizes, device)
    data = rows(2 * sizes.micro_batch, sizes)
    out: dict[str, Any] = {}
    for name, dtype in (("bf16", torch.float32), ("bf16_pure", torch.bfloat16)):
        if budget.left() < 10:
            out[name] = {"status": "skipped: the check's budget is spent"}
            continue
        s = student(sizes, device, lora=False, dtype=dtype)
        watched = next(p for n, p in s.named_parameters() if "q_proj" in n)
        before = watched.detach().clone()
        r = timed_steps(s, live(t, "fused"), data, sizes, "fused", device, sizes.micro_batch,
                        (sizes.warmup_steps, sizes.timed_steps), compute=lambda: Precision(name).autocast(device, False))
        r.update(status="ok", weights_dtype=str(watched.dtype).removeprefix("torch."),
                 moved_fraction=round(float((watched.detach() != before).float().mean()), 4))
        out[name] = r
        del s, watched, before
        free(device)
    rows_out = [f"{n}: {a['step_s'] * 1e3:.0f} ms/step, peak {a['peak_mem_gb']} GB, weights {a['weights_dtype']}, AdamW "
                f"{'/'.join(a['adamw_state_dtypes'])}, moved {a['moved_fraction']:.1%}" if a.get("status") == "ok"
                else f"{n}: {a['status']}" for n, a in out.items()]
    return {"arms": out, "rows": rows_out, "summary": "full fine-tune: fp32 master (bf16) vs pure bf16"}


class _HeadOnly(nn.Module):
    """A student reduced to its output layer fed fixed final hidden states: ``micro_batch_backward`` on it costs
    what the loss costs (the projection, the KD loss and their backward), nothing of the decoder."""

    def __init__(self, head: nn.Module, hidden: torch.Tensor) -> None:
        super().__init__()
        self.lm_head, self.hidden = head, hidden

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, **inputs: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.lm_head(self.hidden))


class _TeacherHead:
    """A teacher reduced to its output layer over fixed final hidden states, giving targets as a live teacher does."""

    def __init__(self, head: nn.Module, hidden: torch.Tensor, fused: bool) -> None:
        self.head, self.hidden, self.fused = head, hidden, fused

    def prefetch(self, batches) -> None:  # nothing to read ahead
        pass

    @property
    def share_key(self) -> tuple:  # kdsweep.teacher.source.TeacherSource's: learners of one head share its targets
        return "head", id(self.head), self.fused

    @contextmanager
    def targets(self, batch) -> Iterator[Any]:
        from kdsweep.losses.targets import Logits

        if self.fused:
            yield Logits(hidden=self.hidden, head=self.head)
            return
        with torch.no_grad():
            logits = self.head(self.hidden)
        yield Logits(logits=logits)


def loss_alone(sizes: Sizes, t: nn.Module, device: torch.device, budget: Budget) -> dict[str, Any]:
    from kdsweep.train.step import micro_batch_backward

    if budget.left() < 10:
        return {"status": "skipped: the check's budget is spent"}
    mb, seq = sizes.micro_batch, sizes.seq
    s_head = nn.Linear(sizes.student["hidden_size"], sizes.vocab, bias=False, device=device, dtype=sizes.dtype)
    s_head.requires_grad_(False)  # tied to the frozen embeddings under LoRA
    batch = rows(mb, sizes).batch(list(range(mb))).to(device)
    out: dict[str, Any] = {}
    for impl in ("chunked", "fused"):
        h_s = torch.randn(mb, seq, sizes.student["hidden_size"], device=device, dtype=sizes.dtype, requires_grad=True)
        h_t = torch.randn(mb, seq, sizes.teacher["hidden_size"], device=device, dtype=sizes.dtype)
        model, source = _HeadOnly(s_head, h_s), _TeacherHead(t.get_output_embeddings(), h_t, impl == "fused")
        times, peaks = [], []
        for _ in range(4):
            h_s.grad = None
            base = reset_peak(device)
            t0 = time.perf_counter()
            with source.targets(batch) as targets:
                micro_batch_backward(model, targets, batch, loss_cfg(impl), torch.tensor(1 / (mb * seq), device=device))
            sync(device)
            times.append(time.perf_counter() - t0)
            peaks.append(peak_gb(device, base))
        out[impl] = {"seconds": round(statistics.median(times[1:]), 4), "peak_gb": peaks[-1]}
        del h_s, h_t, model, source
        free(device)
    chunked, fused = out["chunked"], out["fused"]
    out["time_ratio"] = round(fused["seconds"] / chunked["seconds"], 3)
    out["memory_ratio"] = round(fused["peak_gb"] / chunked["peak_gb"], 4) if chunked["peak_gb"] else None
    out["goals"] = {"memory_ratio_at_most": 0.125, "time_ratio_at_most": 1.1}
    return out


def max_micro_batch(sizes: Sizes, device: torch.device, budget: Budget) -> dict[str, Any]:
    """The largest micro-batch one LoRA train_step fits in, chunked vs fused: doubling until out of memory, then
    halving the gap once or twice as the budget allows (stops at ``sizes.max_micro_batch``)."""
    budget.need(20, "building the teacher")
    t = teacher(sizes, device)
    out: dict[str, Any] = {}
    for impl in ("chunked", "fused"):
        s = student(sizes, device, lora=True)
        fits, fails, mb = 0, None, sizes.micro_batch
        while mb <= sizes.max_micro_batch and budget.left() > 10:
            try:
                timed_steps(s, live(t, impl), rows(mb, sizes), sizes, impl, device, mb, (0, 1))
                fits = mb
            except torch.OutOfMemoryError:
                fails = mb
                s.zero_grad(set_to_none=True)  # what the step left half-done
            free(device)
            if fails is None:
                mb *= 2
            elif fails - fits <= max(1, fits // 4):
                break
            else:
                mb = (fits + fails) // 2
        out[impl] = {"fits": fits, "fails_at": fails,
                     "capped": fails is None and fits * 2 > sizes.max_micro_batch}
        del s
        free(device)
    out["summary"] = (f"chunked {out['chunked']['fits']}, fused {out['fused']['fits']} rows of {sizes.seq} tokens "
                      f"(LoRA{', search capped' if any(out[i]['capped'] for i in ('chunked', 'fused')) else ''})")
    return out


def teacher_cache(sizes: Sizes, device: torch.device, work: Path, budget: Budget) -> dict[str, Any]:
    """Build a ``sample`` cache with kdsweep's builder (teacher tokens/s), then a LoRA trial's step reading it vs
    the live teacher, same shapes and micro-batch."""
    from kdsweep.distributed import single_process
    from kdsweep.teacher.build import PlainTargets, Selection, ensure
    from kdsweep.teacher.cache import Spec
    from kdsweep.teacher.cached import CachedSplit, CachedTeacher

    budget.need(30, "building the teacher and its cache")
    t = teacher(sizes, device)
    train, held = rows(sizes.cache_rows, sizes), rows(1, sizes, seed=1)
    spec = Spec(method="sample", k=sizes.cache_k, temperature=1.0, seed=0, vocab=sizes.vocab,
                dtype="bfloat16" if sizes.dtype == torch.bfloat16 else "float32")
    splits = {"train": Selection(train, torch.arange(len(train))), "eval": Selection(held, torch.arange(1))}
    key = f"check-{time.time_ns()}"
    path, built = ensure(work / "teacher_cache", key, spec, splits, lambda: PlainTargets(t, spec, -100, device),
                         single_process(), device, sizes.micro_batch, info={})
    steps = (sizes.warmup_steps, sizes.timed_steps)
    s = student(sizes, device, lora=True)
    cached = timed_steps(s, CachedTeacher(CachedSplit(path, "train", train), device), train, sizes, "chunked", device,
                         sizes.micro_batch, steps)
    del s
    free(device)
    s = student(sizes, device, lora=True)
    live_step = timed_steps(s, live(t, "chunked"), train, sizes, "chunked", device, sizes.micro_batch, steps)
    tokens_per_s = built["teacher_tokens"] / built["seconds"]
    return {"spec": spec.__dict__, "build": built, "build_teacher_tokens_per_s": round(tokens_per_s),
            "bytes_per_token": spec.bytes_per_position(), "cached_step": cached, "live_step": live_step,
            "step_ratio": round(cached["step_s"] / live_step["step_s"], 3),
            "summary": f"build {tokens_per_s:.0f} teacher tokens/s; cached step {cached['step_s'] * 1e3:.0f} ms vs "
                       f"live {live_step['step_s'] * 1e3:.0f} ms"}
