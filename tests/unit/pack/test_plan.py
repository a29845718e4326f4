"""The memory plan of a pack (kdsweep.pack.plan): its step terms are the written formulas (numbers worked out by
hand), and K follows from fixed + K · per_member against the usable memory. Its counts of the real models:
tests/integration/test_pack_job.py."""

import pytest

from kdsweep.config.schema import ConfigError
from kdsweep.pack.plan import PackPlan, activation_bytes, check_fits, loss_path_bytes


def test_the_step_terms_are_the_written_formulas():
    assert activation_bytes(1024, 2, 64, False, 2) == 4_456_448  # 1024 tokens · 2 layers · 34 · 64 bytes
    assert activation_bytes(1024, 2, 64, False, 4) == 8_912_896  # fp32: twice
    assert activation_bytes(1024, 16, 64, True, 2) == 4_325_376  # checkpointed: 1024 · (16 · 2 · 64 + 34 · 64)
    assert loss_path_bytes(1024, 1000, "fused", 1.0, True) == 4_194_304  # 4 chunks of 1 MiB (4·N·V is more)
    assert loss_path_bytes(16, 1000, "fused", 1.0, True) == 256_000  # 4 · 4 · 16 · 1000: under one chunk
    assert loss_path_bytes(1024, 1000, "chunked", 1.0, True) == 12_288_000  # (10 + 2) · N · V
    assert loss_path_bytes(1024, 1000, "chunked", 1.0, False) == 10_240_000  # a cache: no teacher logits


def test_the_largest_pack_and_the_refusal():
    plan = PackPlan(fixed=10e9, per_member=3e9, usable=20e9, source="dist.device_memory_gb=26.7")
    assert plan.bytes(3) == 19e9 and plan.largest() == 3 and plan.fits(3) and not plan.fits(4)
    check_fits(plan, 3, "hydra.sweeper.pack=3", "pass hydra.sweeper.pack={n}", "unpacked")
    with pytest.raises(ConfigError) as e:
        check_fits(plan, 5, "hydra.sweeper.pack=5", "pass hydra.sweeper.pack={n}", "unpacked")
    assert str(e.value) == ("hydra.sweeper.pack=5: a pack of 5 will not fit, says the memory plan: a pack of 5 needs "
                            "25 GB (10 GB once, 3 GB per member) of 20 GB usable (dist.device_memory_gb=26.7); the "
                            "most that fit is 3: pass hydra.sweeper.pack=3")
    one = PackPlan(fixed=16e9, per_member=3e9, usable=20e9, source="x")
    with pytest.raises(ConfigError, match="not even two fit: unpacked$"):
        check_fits(one, 2, "k", "{n}", "unpacked")
    with pytest.raises(ConfigError, match="not even one trial fits this device$"):
        check_fits(PackPlan(fixed=21e9, per_member=3e9, usable=20e9, source="x"), 1, "k", "{n}", "unpacked")


def test_a_runs_step_and_its_cache_build_are_the_written_formulas():
    """What the teachers' placement counts beside a teacher (kdsweep.models.memory): a step of 2 rows of 512 tokens
    of a 16-layer, 2,048-wide student at a 128,256 vocabulary in bf16, and a cache build of a 4,096-wide teacher."""
    from types import SimpleNamespace as NS

    from kdsweep.models.memory import build_bytes, step_bytes

    cfg = NS(data=NS(micro_batch_size=2, seq_len=512), dist=NS(activation_checkpointing=False), train=NS(dtype="bf16"),
             loss=NS(impl="fused", chunk_mb=128.0))
    student, teacher = NS(num_hidden_layers=16, hidden_size=2048, vocab_size=128256), NS(hidden_size=4096,
                                                                                          vocab_size=128256)
    assert step_bytes(cfg, student, True) == 1_677_721_600  # 1024 · 16 · 34 · 2048 + 4 chunks of 128 MiB
    assert build_bytes(cfg, teacher, False) == 276_824_064  # 1024 · 34 · 4096 + 4 fp32 blocks of 8M elements
    assert build_bytes(cfg, teacher, True) == 539_492_352  # and its [1024, 128256] bf16 logits (soft-capped)
    assert build_bytes(cfg, NS(hidden_size=64, vocab_size=1000), False) == 10_420_224  # a row's block: 512 · 1000
