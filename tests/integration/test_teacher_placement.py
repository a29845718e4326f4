"""Teacher placement in whole jobs on 2 simulated nodes × 2 ranks: the same numbers, the bytes the formula says.

Four ranks spawned on this machine count as 2 nodes of 2 (``KDSWEEP_TEST_RANKS_PER_NODE=2``: a rank's node is
rank // 2, so ``node`` runs its real 2-D mesh and its collectives over real gloo groups). ``auto`` decides from
``dist.device_memory_gb``: with a budget for one teacher beside the student, of two teachers (the same one twice)
the first is replicated and the second, which would exceed what is left, is sharded per node. That job trains to
the same objective and metrics rows (1e-6) as both teachers sharded over the world, and a step's counted teacher
all-gather bytes are 0 replicated, the within-node share per node and the whole-world share over the world, each the
formula from the teacher's own parameters. The teacher cache
built with a replicated teacher equals, to every byte, the one built with a sharded teacher.
"""

import math

import pytest
from safetensors.torch import load_file

from conftest import read_metrics, read_run
from test_multirank import completed, multirun

pytestmark = pytest.mark.slow

STEPS = 2
COMMON = [f"train.max_steps={STEPS}", f"train.eval_every={STEPS}", "checkpoint.save_every=0",
          "checkpoint.export_adapter=false", "checkpoint.export_merged=false", "logger=quiet"]
FOUR = ["dist=fsdp2_local", "dist.nproc_per_node=4", "data.micro_batch_size=2"]  # 16 rows: 2 micro-batches a rank
TWO_TEACHERS = ["teachers=[{zoo: tiny-teacher, weight: 1}, {zoo: tiny-teacher, weight: 3}]"]
MICRO_BATCHES = 2


@pytest.fixture(scope="module")
def placed(tmp_path_factory, zoo_dirs, monkeypatch_module):
    root = tmp_path_factory.mktemp("placement")
    monkeypatch_module.setenv("KDSWEEP_TEST_RANKS_PER_NODE", "2")  # the jobs' processes read it
    cache = ["dist=fsdp2_local", "teacher.logits=cache", "teacher.cache.method=topk"]
    proc, dirs = multirun(root, {
        # a budget for one teacher beside the student (17.9 MiB usable; each teacher 5.0 MiB, the student's share
        # and a step's activations and loss path 10.6 MiB a rank): the first is replicated, the second exceeds what
        # is left and is sharded per node
        "two_auto": [*FOUR, *TWO_TEACHERS, "dist.device_memory_gb=0.025"],
        "two_world": [*FOUR, *TWO_TEACHERS, "dist.teacher_placement=world"],
        "cache_replicated": [*cache, "dist.teacher_placement=replicate", f"teacher.cache.dir={root / 'cache_r'}"],
        "cache_sharded": [*cache, "dist.teacher_placement=world", f"teacher.cache.dir={root / 'cache_s'}"],
    }, *COMMON)
    return completed(proc), dirs, root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def same_rows(a, b, tol=1e-6):
    ra, rb = read_metrics(a), read_metrics(b)
    assert [(r["kind"], r["step"]) for r in ra] == [(r["kind"], r["step"]) for r in rb]
    for x, y in zip(ra, rb):
        for key in ("loss", "ce", "kd", "kl", "grad_norm", "student_ce", "teacher_ce"):
            if key in x:
                assert x[key] == pytest.approx(y[key], abs=tol), (x["kind"], x["step"], key)
    assert read_run(a)["objective"] == pytest.approx(read_run(b)["objective"], abs=tol)


def gathered_per_step(weights: dict, n: int) -> float:
    """A step's all-gather bytes a rank receives for a model sharded over ``n`` ranks: per micro-batch, every
    parameter once (its rows padded to a multiple of ``n``), ``(n-1)/n`` of it from the others."""
    padded = sum(math.ceil(w.shape[0] / n) * n * (w.numel() // w.shape[0]) * w.element_size() for w in weights.values())
    return MICRO_BATCHES * padded * (n - 1) / n


def train_rows(run_dir):
    return [r for r in read_metrics(run_dir) if r["kind"] == "train"]


def test_every_placement_trains_the_same_and_auto_takes_each_side_of_its_budget(placed):
    _, dirs, _ = placed
    two = read_run(dirs["two_auto"])["placement"]["teacher"]
    world = read_run(dirs["two_world"])["placement"]["teacher"]
    # each teacher on its own, the first counted against the budget of the second
    assert [(t["placement"], t["sharded_over"], t["nodes"]) for t in two] == [("replicate", 1, 2), ("node", 2, 2)]
    assert "fit" in two[0]["why"] and "exceed" in two[1]["why"] and "a step's" in two[0]["why"]
    assert "5.02 MiB per rank of the teachers placed before it" in two[1]["why"]
    assert [(t["placement"], t["sharded_over"]) for t in world] == [("world", 4), ("world", 4)]
    same_rows(dirs["two_auto"], dirs["two_world"])  # replicated + per node = over the world, to 1e-6


def test_a_steps_teacher_all_gathers_are_none_the_node_share_or_the_world_share(placed, zoo_dirs):
    _, dirs, _ = placed
    teacher = load_file(zoo_dirs["teacher"] / "model.safetensors")
    cases = (("two_auto", "teacher", 0), ("two_auto", "teacher1", 2), ("two_world", "teacher", 4),
             ("two_world", "teacher1", 4))
    for name, owner, n in cases:  # replicated: nothing; per node: the node's share; over the world: the world's
        for row in train_rows(dirs[name]):
            got = row.get(f"comm/{owner}/all_gather", 0)
            want = gathered_per_step(teacher, n) if n else 0
            assert got == pytest.approx(want, abs=20), (name, owner, row["step"])
        per_step = read_run(dirs[name])["comm"]["per_step"].get(owner, {})
        if n == 2:  # within a node: none of it crosses between nodes
            assert per_step["all_gather"]["cross_node_bytes"] == 0
        if n == 4:
            assert per_step["all_gather"]["cross_node_bytes"] == per_step["all_gather"]["bytes"]
    student_rs = {name: [r["comm/student/reduce_scatter"] for r in train_rows(dirs[name])] for name in ("two_auto", "two_world")}
    assert student_rs["two_auto"] == student_rs["two_world"]  # whatever the teachers do


def test_the_cache_built_with_a_replicated_teacher_equals_the_sharded_build_byte_for_byte(placed):
    _, dirs, root = placed
    records = {name: read_run(dirs[name]) for name in ("cache_replicated", "cache_sharded")}
    assert records["cache_replicated"]["placement"]["teacher"]["placement"] == "replicate"
    assert records["cache_sharded"]["placement"]["teacher"]["placement"] == "world"
    built = {name: next((root / f"cache_{name[6]}").glob("*/meta.json")).parent for name in records}
    files = {name: sorted(p.name for p in d.iterdir() if p.name != "meta.json") for name, d in built.items()}
    assert files["cache_replicated"] == files["cache_sharded"] and files["cache_replicated"]
    for name in files["cache_replicated"]:
        assert (built["cache_replicated"] / name).read_bytes() == (built["cache_sharded"] / name).read_bytes(), name
    same_rows(dirs["cache_replicated"], dirs["cache_sharded"], tol=0)
