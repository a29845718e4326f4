"""Where the models live on 2 simulated nodes × 2 gloo ranks, and what each placement costs on the wire.

The decision (``auto`` against the budget, several teachers one after another, the student's mesh) is checked as a
function; the collectives are counted from what really runs: 4 spawned gloo ranks, a rank's node being rank // 2,
each placement loaded through ``models.load`` and run forward (and the student backward), every collective issued
counted by ``distributed.comm``. The bytes are checked against formulas from the models' own parameters: an
all-gather of a group of ``n`` ranks receives ``(n-1)/n`` of each parameter padded to a multiple of ``n`` rows.
"""

import math
import os

import pytest
import torch

from helpers import gloo_ranks, save_hf_model, word_tokenizer
from kdsweep.config import DistConfig, StudentConfig
from kdsweep.distributed.env import DistEnv
from kdsweep.distributed.placement import GB, TeacherSize, student_placement, teacher_placements

TWO_NODES = DistEnv(rank=0, world_size=4, local_rank=0, source="local", local_world_size=2)


def test_auto_replicates_what_fits_beside_the_student_and_shards_the_rest_per_node():
    cpu = torch.device("cpu")
    fits = DistConfig(device_memory_gb=10, memory_headroom=0.5)  # 5 GB usable
    (a,) = teacher_placements(fits, TWO_NODES, [TeacherSize(int(4 * GB))], 0.5 * GB, cpu)
    (b,) = teacher_placements(fits, TWO_NODES, [TeacherSize(int(4.6 * GB))], 0.5 * GB, cpu)
    assert (a.how, a.shard_ranks) == ("replicate", 1) and "fit 5 GB" in a.why
    assert (b.how, b.shard_ranks, b.two_dimensional) == ("node", 2, True) and "exceed 5 GB" in b.why
    first, second = teacher_placements(fits, TWO_NODES, [TeacherSize(int(3 * GB)), TeacherSize(int(3 * GB))], 0, cpu)  # each on its own
    assert (first.how, second.how) == ("replicate", "node") and "3 GB per rank of the teachers placed before it" in second.why
    for how, shard in (("replicate", 1), ("node", 2), ("world", 4)):
        (p,) = teacher_placements(DistConfig(teacher_placement=how), TWO_NODES, [TeacherSize(1000)], 0, cpu)
        assert (p.how, p.shard_ranks) == (how, shard)
    one_node = DistEnv(rank=0, world_size=4, local_world_size=4, source="local")
    (p,) = teacher_placements(DistConfig(teacher_placement="node"), one_node, [TeacherSize(1000)], 0, cpu)
    assert (p.shard_ranks, p.two_dimensional) == (4, False) and "one node" in p.why
    assert student_placement(DistConfig(student_mesh="hsdp"), TWO_NODES).shard_ranks == 2
    assert student_placement(DistConfig(student_mesh="hsdp"), one_node).how == "fsdp"
    assert student_placement(DistConfig(), DistEnv()).how == "single"


def test_a_teacher_is_placed_beside_what_the_teachers_before_it_really_take():
    """Two teachers that exceed the budget together: the first sharded per node (its 6 GB: 3 GB a rank, and its
    output layer and two decoder layers gathered whole while it runs, 0.5 GB), the second (2 GB) fits beside the
    student alone but not beside what the first takes, so it is sharded too; without the first's gathered layers it
    would fit. Forced placements take their share alike."""
    cpu = torch.device("cpu")
    budget = DistConfig(device_memory_gb=10, memory_headroom=0.5)  # 5 GB usable
    first, second = teacher_placements(budget, TWO_NODES, [TeacherSize(int(6 * GB), int(0.5 * GB)),
                                                            TeacherSize(int(2 * GB))], 0, cpu)
    assert (first.how, first.shard_ranks, second.how) == ("node", 2, "node")
    assert "3.5 GB per rank of the teachers placed before it exceed 5 GB" in second.why
    _, alone = teacher_placements(budget, TWO_NODES, [TeacherSize(int(6 * GB)), TeacherSize(int(2 * GB))], 0, cpu)
    assert alone.how == "replicate" and "3 GB per rank of the teachers placed before it fit" in alone.why
    (beside,) = teacher_placements(budget, TWO_NODES, [TeacherSize(int(2 * GB))], 3.5 * GB, cpu)  # the student's
    assert beside.how == "node" and "beside the student's 3.5 GB per rank exceed" in beside.why
    world = DistConfig(device_memory_gb=10, memory_headroom=0.5, teacher_placement="world")
    assert TeacherSize(int(6 * GB), int(0.5 * GB)).per_rank(4) == 2 * GB
    assert [p.how for p in teacher_placements(world, TWO_NODES, [TeacherSize(int(6 * GB))] * 2, 0, cpu)] == \
        ["world", "world"]


def test_the_plan_counts_a_live_teachers_step_and_a_cache_builds_own_memory(tmp_path):
    """A job's plan (kdsweep.models.load.plan) on 2 nodes × 2 ranks: a live teacher is replicated exactly when its
    weights fit beside the student's share of a rank and a training step's activations and loss path (the memory
    model, whose formulas tests/unit/pack/test_plan.py checks); a teacher that builds a cache, beside the build's
    own memory instead (the student is not loaded then). 1 kB either side of the boundary flips the decision."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kdsweep.config import to_run_config
    from kdsweep.models.load import model_bytes, plan, student_wrapper
    from kdsweep.models.memory import build_bytes, step_bytes

    tok = word_tokenizer()
    student, teacher = save_hf_model(tmp_path / "s", tok, hidden=32), save_hf_model(tmp_path / "t", tok, hidden=64)
    weights = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(teacher).parameters())  # fp32

    def placed(logits: str, gb: float):
        cfg = to_run_config({"output_dir": str(tmp_path / "out"), "model": {"path": str(student), "lora_rank": 4},
                             "teacher": {"path": str(teacher), "logits": logits},
                             "data": {"seq_len": 64, "micro_batch_size": 8, "batch_size": 8},
                             "dist": {"device_memory_gb": gb, "memory_headroom": 0.0}, "loss": {"impl": "fused"}})
        return cfg, plan(cfg, student, [teacher], TWO_NODES, torch.device("cpu")).teachers[0]

    cfg, _ = placed("live", 1.0)
    s_bytes, trainable = model_bytes(student, torch.float32, student_wrapper(cfg.model, cfg.train.seed))
    share = (s_bytes + trainable * 3 * 4) / 4  # fp32 weights, a gradient and two AdamW moments over 4 ranks
    live = weights + share + step_bytes(cfg, AutoConfig.from_pretrained(student), live_teacher=True)
    build = weights + build_bytes(cfg, AutoConfig.from_pretrained(teacher), transforms_logits=False)
    assert build != live
    for logits, need, besides in (("live", live, "the student's share and a step's"),
                                  ("cache", build, "its cache build's")):
        fits, over = placed(logits, (need + 1000) / 1e9)[1], placed(logits, (need - 1000) / 1e9)[1]
        assert (fits.how, over.how) == ("replicate", "node"), logits
        assert f"beside {besides}" in fits.why and fits.weight_bytes == weights


def _padded(p: torch.Tensor, n: int) -> int:
    """A parameter's bytes as FSDP2 all-gathers it over ``n`` ranks: dim 0 padded to a multiple of ``n``."""
    rows = math.ceil(p.shape[0] / n) * n
    return rows * (p.numel() // p.shape[0]) * p.element_size()


def _ranks(rank: int, model_dir: str, out: str) -> None:
    from kdsweep.distributed import comm
    from kdsweep.models.load import load_student, load_teacher

    env = DistEnv(rank=rank, world_size=4, local_rank=rank % 2, source="local", local_world_size=2)
    comm.install(2, rank)
    cpu, x = torch.device("cpu"), torch.arange(24).reshape(2, 12) % 20
    logits, counted = {}, {}
    for how in ("replicate", "node", "world"):
        cfg = DistConfig(teacher_placement=how)
        (place,) = teacher_placements(cfg, env, [TeacherSize(0)], 0, cpu)
        teacher = load_teacher(model_dir, "fp32", cpu, env, cfg, place)
        before = comm.TALLY.copy()
        with torch.no_grad():
            logits[how] = teacher(input_ids=x).logits
        counted[how] = comm.TALLY.since(before).record()
        del teacher
    for mesh in ("fsdp", "hsdp"):
        cfg = DistConfig(student_mesh=mesh)
        student = load_student(model_dir, StudentConfig(path=model_dir, lora_rank=4, target_modules=("q_proj", "v_proj")),
                               "fp32", cpu, 0, env, cfg, student_placement(cfg, env))
        before = comm.TALLY.copy()
        student(input_ids=x).logits.sum().backward()
        counted[f"student_{mesh}"] = comm.TALLY.since(before).record()
        trainable = [tuple(p.shape) for p in student.parameters() if p.requires_grad]  # global shapes
    if rank == 0:
        torch.save({"logits": logits, "counted": counted, "trainable": trainable}, os.path.join(out, "placed.pt"))


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement")
    model_dir = save_hf_model(tmp / "m", word_tokenizer(), hidden=32, layers=2)
    gloo_ranks(_ranks, str(model_dir), str(tmp), tmp_path=tmp, nprocs=4, timeout_s=300)
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    return torch.load(tmp / "placed.pt"), plain


def test_the_teacher_all_gathers_nothing_replicated_its_node_share_per_node_and_the_world_share_sharded(placed):
    got, plain = placed
    counted = got["counted"]
    assert "teacher" not in counted["replicate"] and not counted["replicate"]  # no collective at all
    for how, n, cross in (("node", 2, 0.0), ("world", 4, 1.0)):
        want = sum(_padded(p, n) for p in plain.parameters()) * (n - 1) / n
        gathered = counted[how]["teacher"]["all_gather"]
        assert gathered["bytes"] == pytest.approx(want, abs=len(list(plain.parameters())))  # rounding per call
        assert gathered["cross_node_bytes"] == pytest.approx(cross * want, abs=len(list(plain.parameters())))
        assert set(counted[how]) == {"teacher"} and set(counted[how]["teacher"]) == {"all_gather"}
    for how in ("node", "world"):  # the same teacher, to every digit
        assert torch.equal(got["logits"][how], got["logits"]["replicate"])


def test_the_student_reduce_scatters_its_gradients_in_the_group_it_is_sharded_over(placed):
    got, _ = placed
    counted = got["counted"]
    fsdp, hsdp = counted["student_fsdp"]["student"], counted["student_hsdp"]["student"]
    lora = [torch.empty(shape) for shape in got["trainable"]]  # LoRA A and B of q_proj and v_proj: fp32 gradients
    assert len(lora) == 8
    world = sum(_padded(p, 4) for p in lora) * 3 / 4
    node = sum(_padded(p, 2) for p in lora) / 2
    assert fsdp["reduce_scatter"]["bytes"] == pytest.approx(world, abs=8)
    assert fsdp["reduce_scatter"]["cross_node_bytes"] == fsdp["reduce_scatter"]["bytes"]
    assert "all_reduce" not in fsdp
    assert hsdp["reduce_scatter"]["bytes"] == pytest.approx(node, abs=8) and hsdp["reduce_scatter"]["cross_node_bytes"] == 0
    # then across the 2 nodes, each rank's shard: 2·(2-1)/2 of it, all of it between nodes
    shard = sum(_padded(p, 2) for p in lora) / 2
    assert hsdp["all_reduce"]["bytes"] == pytest.approx(shard, abs=8)
    assert hsdp["all_reduce"]["cross_node_bytes"] == hsdp["all_reduce"]["bytes"]
    assert hsdp["all_gather"]["cross_node_bytes"] == 0 < fsdp["all_gather"]["cross_node_bytes"]
