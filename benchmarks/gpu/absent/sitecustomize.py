"""For the GPU check's dry run: the packages the GPU machine lacks (and that benchmarks/gpu/prepare.sh does not
bring) look absent, as they are there: ``import`` fails and ``importlib.util.find_spec`` says None, so a kdsweep job
that starts to need one fails here, in CI, and not on the GPU machine.

Active only when ``GPU_CHECK_ABSENT`` names them (comma-separated modules, with their submodules) and this folder is
on ``PYTHONPATH``."""

import os
import sys

_ABSENT = tuple(m for m in os.environ.get("GPU_CHECK_ABSENT", "").split(",") if m)


def _absent(name):
    return any(name == m or name.startswith(m + ".") for m in _ABSENT)


class _Hiding:
    """A meta-path finder that finds nothing absent and defers everything else to the finder it wraps."""

    def __init__(self, inner):
        self._inner = inner

    def find_spec(self, name, path=None, target=None):
        if _absent(name) or not hasattr(self._inner, "find_spec"):
            return None
        return self._inner.find_spec(name, path, target)

    def find_distributions(self, context=None):  # importlib.metadata: an absent package has no version either
        found = getattr(self._inner, "find_distributions", lambda context=None: [])(context)
        return [d for d in found if not _absent((d.metadata["Name"] or "").lower().replace("-", "_"))]

    def __getattr__(self, attr):
        return getattr(self._inner, attr)


if _ABSENT:
    sys.meta_path[:] = [_Hiding(f) for f in sys.meta_path]
