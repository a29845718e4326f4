"""The gloo-rank parts of the architecture matrix and of the teacher-cache cells, N times in a row, each time in fresh
directories (what a flaky rank teardown would fail): ``python tests/loops/gloo_ranks.py arch|cache N``. Not collected by
pytest; it imports the fixtures' own cell builders."""
import sys, tempfile, time
from pathlib import Path
HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE / "integration"), str(HERE)]
import torch
import test_architectures as A
import test_teacher_cache as T
from helpers import gloo_ranks, run_each


def main() -> None:  # spawned ranks import this file: the loop runs only in the launching process
    which, n = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    for i in range(n):
        root = Path(tempfile.mkdtemp(prefix=f"gloo-{which}-{i}-"))
        if which == "arch":
            A.build_models(root)
            cells = [A.cell_config(root, row, mode, impl, 2) for row in A.ROWS for mode in A.MODES for impl in A.IMPLS]
            two = [c for c in cells if A._preflight(c) is None]
        else:
            T.build_models(root)
            two = T.cells(root, 2)
        t = time.time()
        gloo_ranks(run_each, two, tmp_path=root)
        print(which, i + 1, "ok", f"{time.time() - t:.1f}s", len(two), "cells", flush=True)


if __name__ == "__main__":
    main()
