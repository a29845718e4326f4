import subprocess

import pytest

from kdsweep.config import ConfigError
from kdsweep.distributed.env import cuda_index, detect, expand_nodelist, first_slurm_host, slurm_master_port


def test_torchrun_variables():
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (3, 4, 1, "n1", 1234, "torchrun")
    assert not env.is_main
    spawned = detect({"RANK": "1", "WORLD_SIZE": "2", "KDSWEEP_LOCAL_RANKS": "1"})  # kdsweep's own local ranks
    assert spawned.source == "local"


def srun_task(procid: int, **more: str) -> dict[str, str]:
    """What srun gives task ``procid`` of a 2-node × 2-task step."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % 2),
            "SLURM_NODEID": str(procid // 2), "SLURM_NNODES": "2", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_STEP_NODELIST": "gpu[01-02]", **more}


def test_slurm_tasks_of_two_nodes_map_to_ranks_with_one_master():
    envs = [detect(srun_task(r)) for r in range(4)]
    assert [(e.rank, e.local_rank, e.world_size, e.source) for e in envs] == [
        (0, 0, 4, "slurm"), (1, 1, 4, "slurm"), (2, 0, 4, "slurm"), (3, 1, 4, "slurm")]
    assert {e.master_addr for e in envs} == {"gpu01"} and len({e.master_port for e in envs}) == 1
    assert 20000 <= envs[0].master_port < 40000
    # array tasks of one array job, and two steps of one job, must not collide
    assert slurm_master_port("77_1") != slurm_master_port("77_2")
    assert slurm_master_port("4242", "0") != slurm_master_port("4242", "1")
    assert detect(srun_task(0, SLURM_STEP_ID="1")).master_port != envs[0].master_port


def test_a_step_on_part_of_the_allocation_takes_its_master_from_the_step_s_nodes():
    # srun -N1 -r1 in a 3-node allocation: the step runs on the second node only
    env = detect(srun_task(0, SLURM_JOB_NODELIST="gpu[01-03]", SLURM_STEP_NODELIST="gpu02", SLURM_NTASKS="6",
                           SLURM_STEP_NUM_TASKS="2"))
    assert (env.master_addr, env.world_size) == ("gpu02", 2)


def test_a_job_started_in_an_allocation_without_srun_is_refused_at_once():
    batch_step = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}
    with pytest.raises(ConfigError, match=r"not started by srun.*\(srun python -m kdsweep"):
        detect(batch_step)
    assert detect({**batch_step, "SLURM_NTASKS": "1"}).world_size == 1  # one task: it is the job


def test_one_slurm_task_or_nothing_is_a_single_rank():
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1
    assert detect({}).source == "single"


@pytest.mark.parametrize("nodelist,hosts", [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node5", ["node5"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
    ("127.0.0.[1-2],localhost", ["127.0.0.1", "127.0.0.2", "localhost"]),
])
def test_node_lists_expand_as_scontrol_does(nodelist, hosts, monkeypatch):
    assert expand_nodelist(nodelist) == hosts
    try:
        shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        shown = None
    if shown is not None and shown.returncode == 0:  # SLURM's own expansion, where SLURM is installed
        assert shown.stdout.split() == hosts
    monkeypatch.setenv("PATH", "/nonexistent")
    assert first_slurm_host(nodelist) == hosts[0]


def test_the_gpu_of_a_rank_is_what_its_process_sees():
    assert cuda_index(1, 8) == 1  # all the node's GPUs visible: cuda:<local rank>
    assert cuda_index(3, 1) == 0  # one GPU bound per task (--gpus-per-task): it is cuda:0 for every task
    with pytest.raises(ConfigError, match="local rank 3 needs a GPU but this process sees 2"):
        cuda_index(3, 2)


def test_the_ranks_of_a_node_come_from_the_launcher():
    torchrun = detect({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (torchrun.local_world_size, torchrun.nodes, torchrun.node) == (4, 2, 1)
    slurm = [detect(srun_task(r, SLURM_STEP_TASKS_PER_NODE="2(x2)")) for r in range(4)]
    assert [(e.local_world_size, e.nodes, e.node) for e in slurm] == [(2, 2, 0), (2, 2, 0), (2, 2, 1), (2, 2, 1)]
    assert detect(srun_task(3)).nodes == 2  # no tasks-per-node variable: the step's tasks over its nodes
    # tests simulate nodes only among the ranks kdsweep spawned itself, never under a real launcher
    simulated = {"RANK": "3", "WORLD_SIZE": "4", "KDSWEEP_LOCAL_RANKS": "1", "KDSWEEP_TEST_RANKS_PER_NODE": "2"}
    assert (detect(simulated).nodes, detect(simulated).node) == (2, 1)
    assert detect({**simulated, "KDSWEEP_LOCAL_RANKS": ""}).nodes == 1
    uneven = detect({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    assert (uneven.nodes, uneven.node) == (1, 0)  # ranks that do not split evenly count as one node
