import pytest

from kdsweep.config import OptimConfig
from kdsweep.train.schedule import lr_factor


def test_warmup_then_cosine_to_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, cfg, 20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, cfg, 20) == pytest.approx(1.0)
    assert lr_factor(12, cfg, 20) == pytest.approx(0.55)  # halfway through the decay
    assert lr_factor(20, cfg, 20) == pytest.approx(0.1)
    values = [lr_factor(s, cfg, 20) for s in range(4, 21)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_linear_and_constant():
    lin = OptimConfig(lr=1.0, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    assert lr_factor(5, lin, 10) == pytest.approx(0.5)
    const = OptimConfig(lr=1.0, warmup_steps=2, schedule="constant")
    assert lr_factor(0, const, 10) == 0.5 and lr_factor(9, const, 10) == 1.0
