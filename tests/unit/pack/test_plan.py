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
