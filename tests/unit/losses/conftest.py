import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """The loss tests use tiny tensors: one intra-op thread is fastest, and far faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
