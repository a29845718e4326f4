from kdsweep.distributed.env import detect, first_slurm_host, slurm_master_port


def test_torchrun_variables():
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (3, 4, 1, "n1", 1234, "torchrun")
    assert not env.is_main


def test_slurm_variables_map_to_ranks_with_a_job_derived_port():
    slurm = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
             "SLURM_JOB_NODELIST": "127.0.0.1"}
    env = detect(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (1, 2, 1, "slurm")
    assert env.master_port == detect({**slurm, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).master_port
    assert 20000 <= env.master_port < 40000
    # array tasks of one array job must not collide
    assert slurm_master_port("77_1") != slurm_master_port("77_2")


def test_one_slurm_task_or_nothing_is_a_single_rank():
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1
    assert detect({}).source == "single"


def test_first_host_of_a_node_list_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert first_slurm_host("gpu[07-09],cpu1") == "gpu07"
    assert first_slurm_host("node5") == "node5"
