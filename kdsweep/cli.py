"""The ``kdsweep`` console script: ``kdsweep [overrides]`` is ``python -m kdsweep``; plus the sweep subcommands.

    kdsweep status <sweep dir>     the trials of a sweep: state, objective, params, best marked
    kdsweep resume <sweep dir>     continue a sweep after its controller died (same command, same directory)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SUBCOMMANDS = ("status", "resume")


def _sweep_dir(args: list[str], command: str) -> Path:
    if len(args) != 1:
        raise SystemExit(f"usage: kdsweep {command} <sweep dir>")
    return Path(args[0]).resolve()


def status(args: list[str]) -> None:
    from kdsweep.sweep.controller import summary_lines
    from kdsweep.sweep.manifest import Manifest

    manifest = Manifest.load(_sweep_dir(args, "status"))
    settings = manifest.data["settings"]
    print(f"sweep {manifest.path.parent} (study {manifest.data['study_name']}, {len(manifest.trials)} of "
          f"{settings['n_trials']} trials, storage {settings['storage'] or 'sqlite in the sweep dir'})")
    print("\n".join(summary_lines(manifest)))


def resume(args: list[str]) -> None:
    """Re-run the sweep's own command on its directory: the controller picks up where the last one stopped."""
    from kdsweep.sweep.manifest import Manifest

    sweep_dir = _sweep_dir(args, "resume")
    command = [a for a in Manifest.load(sweep_dir).data.get("command", []) if not a.startswith("hydra.sweep.dir=")]
    argv = [sys.executable, "-m", "kdsweep", *command, f"hydra.sweep.dir={sweep_dir}"]
    print("resuming:", " ".join(argv[1:]), flush=True)
    os.execv(sys.executable, argv)


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] in SUBCOMMANDS:
        from kdsweep.config.schema import ConfigError

        try:
            {"status": status, "resume": resume}[args[0]](args[1:])
        except ConfigError as e:
            print(f"kdsweep: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    from kdsweep.app import main as app_main

    app_main()


__all__ = ["main"]
