"""`python -m kdsweep --help`: Hydra's groups and config, and every field of the SLURM launcher (hydra.launcher.*)
from a checked-in table that must match the launcher's own config; fast, because it imports neither torch nor
submitit."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def table() -> dict[str, str]:
    """The help's launcher table: field -> the default it shows."""
    footer = yaml.safe_load((REPO / "conf" / "hydra" / "help" / "kdsweep.yaml").read_text())["footer"]
    lines = footer.split("  field ", 1)[1].splitlines()[1:]
    rows = [line.split() for line in lines if line.startswith("  ") and line.split()]
    return {row[0]: row[1] for row in rows}


def shown(value) -> str:
    """A default as the table writes it (an interpolation as <key>: Hydra's help substitutes every $)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and value.startswith("${"):
        return value.replace("${", "<").replace("}", ">")
    return str(value)


def test_the_launcher_table_is_every_field_of_the_launcher_s_own_config_with_its_default():
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    own = {f.name: shown(f.default if f.default is not dataclasses.MISSING else f.default_factory())
           for f in dataclasses.fields(SlurmQueueConf) if f.name != "_target_"}
    assert table() == own


def test_help_lists_the_launcher_s_fields_without_importing_torch_or_submitit(tmp_path):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "kdsweep", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "== SLURM jobs: hydra/launcher=submitit_slurm" in proc.stdout
    for field, default in table().items():
        assert f"  {field} " in proc.stdout and default in proc.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines() if "|" in line}
    assert "hydra" in imported and not imported & {"torch", "submitit", "transformers"}
