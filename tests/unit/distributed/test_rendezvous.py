"""The master port a SLURM step's ranks agree on: derived from the job and step, moved on when taken, published
in the shared cache for the other ranks; a rank that never sees it says which directory must be shared."""

import socket
import threading

import pytest

from kdsweep.config import ConfigError
from kdsweep.distributed.env import detect
from kdsweep.distributed.rendezvous import agree_port, port_file, release_port
from test_env import srun_task


def test_the_ranks_of_a_step_agree_on_rank_0_s_port_and_a_taken_port_is_skipped(tmp_path):
    step = srun_task(0)
    main = detect(step)
    with socket.socket() as taken:  # something already listens on the derived port
        taken.bind(("", main.master_port))
        taken.listen()
        got = {}
        reader = threading.Thread(target=lambda: got.update(r3=agree_port(detect(srun_task(3)), tmp_path, 10, srun_task(3))))
        reader.start()  # rank 3 waits for what rank 0 publishes
        agreed = agree_port(main, tmp_path, 10, step)
        reader.join()
    assert agreed.master_port != main.master_port and got["r3"].master_port == agreed.master_port
    release_port(agreed, tmp_path, step)
    assert not port_file(tmp_path, step).exists()


def test_two_concurrent_steps_of_one_job_publish_different_ports(tmp_path):
    ports = []
    for step_id in ("0", "1"):
        environ = srun_task(0, SLURM_STEP_ID=step_id)
        ports.append(agree_port(detect(environ), tmp_path, 10, environ).master_port)
    assert ports[0] != ports[1]
    assert {p.name for p in (tmp_path / "rendezvous").iterdir()} == {"4242.0.0.port", "4242.1.0.port"}


def test_a_rank_that_never_sees_the_port_names_the_directory_to_share(tmp_path):
    with pytest.raises(ConfigError, match=rf"no master port in {tmp_path}.*must be a directory every node"):
        agree_port(detect(srun_task(1)), tmp_path, 0.3, srun_task(1))


def test_torchrun_and_spawned_ranks_keep_their_own_port(tmp_path):
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234"})
    assert agree_port(env, tmp_path, 0.1, {}).master_port == 1234 and not (tmp_path / "rendezvous").exists()
