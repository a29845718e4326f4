"""A search space written in Hydra's override grammar, as Optuna distributions.

    kd_ratio: interval(0.0,1.0)              float in [0, 1]
    lr: tag(log, interval(1e-5,1e-2))        float, sampled on a log scale
    lora_rank: choice(4,8,16,32)             categorical
    train.max_steps: range(20,100,20)        int 20, 40, 60, 80 (end excluded, as Python's range)
    data.seq_len: interval(64,256)           int in [64, 256] (integer bounds make an integer space)

Integer bounds make an integer space, as in hydra-optuna-sweeper; a float field (kd_ratio, lr, ...) given
integer bounds is refused with a line that says how to write it, instead of silently searching {0, 1}.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any

from kdsweep.config.convert import SWEEP_KNOBS
from kdsweep.config.schema import ConfigError, RunConfig

# Where the top-level knobs land in the typed config (they are interpolated there).
KNOB_FIELDS = {"kd_ratio": "loss.kd_ratio", "lr": "optim.lr", "lora_rank": "model.lora_rank", "lmbda": "rollout.lmbda"}
assert set(KNOB_FIELDS) == set(SWEEP_KNOBS)
_INT = re.compile(r"^[+-]?\d+$")


@dataclass(frozen=True)
class Param:
    """One searched key and its distribution."""

    key: str
    kind: str
    """float, int or categorical."""
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: int | None = None
    choices: tuple[Any, ...] = ()

    def distribution(self) -> Any:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "float":
            return FloatDistribution(self.low, self.high, log=self.log)
        if self.kind == "int":
            return IntDistribution(self.low, self.high, log=self.log, step=self.step or 1)
        return CategoricalDistribution(list(self.choices))

    def values(self) -> list[Any]:
        """Every value of a finite space (choices, or a range's steps), for the grid sampler."""
        if self.kind == "categorical":
            return list(self.choices)
        if self.kind == "int" and self.step:
            return list(range(self.low, self.high + 1, self.step))
        raise ConfigError(f"hydra.sweeper.sampler=grid needs {self.key} as choice(...) or range(...), not an interval")

    def corners(self) -> list[Any]:
        """The values that bound the space: both ends of a range, every choice."""
        return list(self.choices) if self.kind == "categorical" else [self.low, self.high]

    def describe(self) -> dict[str, Any]:
        """A JSON-able description: what a resumed sweep compares to refuse a changed space."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v is not False and v != ()}


def field_type(key: str) -> Any:
    """The Python type of the typed-config field a key sets (None when it is not a field, e.g. a group)."""
    path = KNOB_FIELDS.get(key, key).split(".")
    cls: Any = RunConfig
    for part in path:
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def parse_space(params: dict[str, str]) -> list[Param]:
    """Hydra sweep expressions → Params, with one clear line for each mistake."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from hydra.errors import HydraException

    if not params:
        raise ConfigError(
            "hydra.sweeper.params is empty: nothing to search; give at least one on the command line, e.g. "
            "kd_ratio='interval(0.0,1.0)' (or pick hparams_search=kd_optuna)"
        )
    parser = OverridesParser.create()
    space = []
    for key, text in params.items():
        where = f"hydra.sweeper.params.{key}={text}"
        try:
            (override,) = parser.parse_overrides([f"{key}={text}"])
        except HydraException as e:
            raise ConfigError(f"{where} is not a sweep expression ({str(e).splitlines()[0]})") from None
        value = override.value()
        if isinstance(value, IntervalSweep):
            bounds = re.findall(r"interval\(\s*([^,]+?)\s*,\s*([^)]+?)\s*\)", text)
            integer = "int" in value.tags or (bounds and all(_INT.match(b) for b in bounds[0]))
            if integer and field_type(key) is float:
                raise ConfigError(
                    f"{where}: integer bounds make an integer space (only {int(value.start)}..{int(value.end)}), "
                    f"but {key} is a float; write interval({float(value.start)},{float(value.end)})"
                )
            kind = "int" if integer else "float"
            low, high = (int(value.start), int(value.end)) if integer else (value.start, value.end)
            if not low < high:
                raise ConfigError(f"{where}: the interval is empty; the lower bound must be below the upper")
            if "log" in value.tags and low <= 0:
                raise ConfigError(f"{where}: a log scale needs a positive lower bound")
            space.append(Param(key=key, kind=kind, low=low, high=high, log="log" in value.tags))
        elif isinstance(value, RangeSweep):
            if not all(float(v).is_integer() for v in (value.start, value.stop, value.step)) or value.step <= 0:
                raise ConfigError(f"{where}: range() takes integers and a positive step; for real numbers use "
                                  "interval(a,b) or choice(a,b,...)")
            items = list(override.sweep_iterator())
            if not items:
                raise ConfigError(f"{where}: the range is empty")
            step = int(value.step)
            space.append(Param(key=key, kind="int", low=int(items[0]), high=int(items[-1]), step=step))
        elif isinstance(value, ChoiceSweep):
            if not value.list:
                raise ConfigError(f"{where}: choice() needs at least one value")
            space.append(Param(key=key, kind="categorical", choices=tuple(value.list)))
        else:
            raise ConfigError(
                f"{where} is a single value, not a search space; use interval(a,b), choice(a,b,...) or "
                f"range(a,b,step), or set it as a plain override {key}={text}"
            )
    return space


def holds(distribution: Any, value: Any) -> bool:
    """Whether an Optuna distribution can hold ``value`` (a choice of it, or inside its bounds)."""
    if hasattr(distribution, "choices"):
        return value in distribution.choices
    return distribution.low <= value <= distribution.high
