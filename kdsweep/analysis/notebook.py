"""Run an analysis notebook on a sweep with its parameters set (papermill's convention, without papermill), and
strip a notebook's outputs before it is committed.

    python -m kdsweep.analysis.notebook notebooks/sweep_analysis.ipynb out.ipynb sweep_dir=outputs/sweeps/...

The cell tagged ``parameters`` is replaced by one assignment per given parameter (values are Python literals
when they parse as one, else strings); the other cells run unchanged, in a kernel started in ``cwd``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

from kdsweep.config.schema import ConfigError


def with_parameters(nb: Any, parameters: dict[str, Any]) -> Any:
    """A copy of ``nb`` whose ``parameters`` cell assigns ``parameters`` instead of its defaults."""
    import copy

    nb = copy.deepcopy(nb)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ConfigError(f"the notebook needs exactly one cell tagged 'parameters' (found {len(cells)})")
    defaults = _assigned(cells[0].source)
    unknown = sorted(set(parameters) - defaults)
    if unknown:
        raise ConfigError(f"unknown notebook parameter(s) {unknown}; the notebook takes {sorted(defaults)}")
    cells[0].source = "\n".join([cells[0].source, "# injected", *(f"{k} = {v!r}" for k, v in parameters.items())])
    return nb


def _assigned(source: str) -> set[str]:
    return {t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def execute(path: str | Path, parameters: dict[str, Any], cwd: str | Path | None = None, timeout: int = 600) -> Any:
    """Execute the notebook at ``path`` with ``parameters``; returns the executed notebook (an error in a cell
    raises nbclient's CellExecutionError, naming the cell and the traceback)."""
    import nbformat
    from nbclient import NotebookClient

    nb = with_parameters(nbformat.read(str(path), as_version=4), parameters)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd or Path(path).parent)}})
    client.execute()
    return nb


def strip(nb: Any) -> Any:
    """``nb`` without outputs, execution counts or execution metadata: what goes into git."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def main(argv: list[str]) -> None:
    import nbformat

    if len(argv) < 2:
        raise SystemExit("usage: python -m kdsweep.analysis.notebook <notebook> <executed copy> [name=value ...]")
    parameters = {}
    for item in argv[2:]:
        name, _, value = item.partition("=")
        try:
            parameters[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parameters[name] = value
    nbformat.write(execute(argv[0], parameters, cwd=Path.cwd()), argv[1])


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        print(f"kdsweep: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
