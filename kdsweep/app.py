"""The Hydra application: DictConfig → typed RunConfig (once) → ``train.run`` → the float objective.

Nothing below this module sees Hydra or OmegaConf. torch is imported only once a job really runs, so
``python -m kdsweep --help`` and config validation stay fast.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from kdsweep.config import ConfigError, RunConfig, to_run_config
from kdsweep.config.convert import check_key

log = logging.getLogger("kdsweep")


def conf_dir() -> str:
    """The config tree: inside the package when installed from a wheel, beside it in a checkout."""
    here = Path(__file__).resolve().parent
    packaged = here / "conf"
    return str(packaged if packaged.is_dir() else here.parent / "conf")


def _fail(message: str, output_dir: str | None) -> None:
    """One line on stderr, exit code 2; remove the run directory if Hydra created it empty just now."""
    print(f"kdsweep: error: {message}", file=sys.stderr)
    if output_dir:
        try:
            os.rmdir(output_dir)  # only succeeds when empty: never removes anything a run wrote
        except OSError:
            pass
    raise SystemExit(2)


def _resolve(cfg: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = e.full_key
        raise ConfigError(f"{key} is required but not set; pass {key}=<value> on the command line") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '') or 'config'}: {e.msg if hasattr(e, 'msg') else e}") from None


def validate(raw: dict[str, Any]) -> RunConfig:
    """Typed config + every check that needs no weights (paths, tokenizers, context length, data files)."""
    from kdsweep.data.check import preflight_data
    from kdsweep.models.check import preflight_models

    cfg = to_run_config(raw)
    preflight_models(cfg)
    preflight_data(cfg)
    return cfg


def _add_file_log(output_dir: str) -> None:
    handler = logging.FileHandler(Path(output_dir) / "kdsweep.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    logging.getLogger().addHandler(handler)


def task(cfg: DictConfig) -> float:
    """One KD job; returns the held-out student CE (the objective)."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    output_dir = hc.runtime.output_dir
    try:
        raw = _resolve(cfg)
        raw["output_dir"] = output_dir
        run_cfg = validate(raw)
    except ConfigError as e:
        _fail(str(e), output_dir)
    _add_file_log(output_dir)

    from kdsweep.train import run

    try:
        result = run(run_cfg, resolved_config=raw, overrides=list(hc.overrides.task))
    except ConfigError as e:  # a problem only visible once the data is tokenized
        _fail(str(e), None)
    print(
        f"held-out CE: before {result.eval_before.student_ce:.4f} -> after {result.eval_after.student_ce:.4f} "
        f"(teacher {result.eval_after.teacher_ce:.4f}, {result.steps} steps, {result.status})\n"
        f"outputs: {result.output_dir} (run.json, metrics.jsonl, kdsweep.log"
        + "".join(f", {name}: {path}" for name, path in result.exports.items())
        + ")",
        flush=True,
    )
    return result.objective


_hydra_main = hydra.main(version_base=None, config_path=conf_dir(), config_name="config")(task)


def _check_command_line(args: list[str]) -> None:
    """Unknown keys get kdsweep's one line (with the valid keys) before Hydra composes anything."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        overrides = OverridesParser.create().parse_overrides(get_args_parser().parse_known_args(args)[0].overrides)
    except (HydraException, SystemExit):
        return  # malformed syntax: Hydra's own message says where
    groups = tuple(sorted(p.name for p in Path(conf_dir()).iterdir() if p.is_dir() and p.name != "hydra"))
    for o in overrides:
        key = o.key_or_group
        if o.is_add() or o.is_delete() or o.is_force_add() or key.startswith("hydra") or o.package:
            continue
        try:
            check_key(key, groups)
        except ConfigError as e:
            _fail(str(e), None)


def main() -> None:
    """Entry point of ``python -m kdsweep`` and the ``kdsweep`` script."""
    _check_command_line(sys.argv[1:])
    _hydra_main()
