"""The gloo-rank parts of the architecture matrix and of the teacher-cache cells, N times in a row, each time in fresh
directories (what a flaky rank teardown would fail): ``python tests/loops/gloo_ranks.py arch|cache N``. Not collected by
pytest; it imports the fixtures' own cell builders."""
import random, sys, tempfile, time, json
from pathlib import Path
HERE = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(HERE / "integration"), str(HERE)]
import torch
import test_architectures as A
import test_teacher_cache as T
from helpers import ARCHS, WORDS, gloo_ranks, run_each, save_arch, save_hf_model, word_lines, word_tokenizer


def main() -> None:  # spawned ranks import this file: the loop runs only in the launching process
    which, n = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    for i in range(n):
        root = Path(tempfile.mkdtemp(prefix=f"gloo-{which}-{i}-"))
        if which == "arch":
            extra = tuple(f"w{j}" for j in range(40))
            tok = word_tokenizer(extra)
            (root / "corpus.txt").write_text("\n".join(word_lines(120, [*WORDS, *extra][:30], seed=0)) + "\n")
            for arch in ARCHS:
                save_arch(root / f"student_{arch}", arch, tok, hidden=32, layers=2, seed=0)
                save_arch(root / f"teacher_{arch}", arch, tok, hidden=48, layers=2, seed=1)
            save_arch(root / "teacher_qwen2_padded", "qwen2", tok, hidden=48, layers=2, seed=1, pad_vocab=16)
            cells = [A.cell_config(root, row, mode, impl, 2) for row in A.ROWS for mode in A.MODES for impl in A.IMPLS]
            two = [c for c in cells if A._preflight(c) is None]
        else:
            rng = random.Random(0)
            (root / "docs.jsonl").write_text("".join(
                json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.choice([3, 5, 9, 17, 30])))}) + "\n" for _ in range(90)))
            tok = word_tokenizer()
            save_hf_model(root / "student", tok, hidden=32, layers=2, seed=0)
            save_hf_model(root / "teacher", tok, hidden=48, layers=2, seed=1, pad_vocab=8)
            two = T.cells(root, 2)
        t = time.time()
        gloo_ranks(run_each, two, tmp_path=root)
        print(which, i + 1, "ok", f"{time.time() - t:.1f}s", len(two), "cells", flush=True)


if __name__ == "__main__":
    main()
