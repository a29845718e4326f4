"""A warm worker's trial measures its own peak memory, not the worker's maximum so far."""


def test_a_trials_peak_memory_counts_from_its_start():
    import torch

    from kdsweep.train.trial import peak_memory_mb, reset_peak_memory

    big = torch.ones(400 * 2**20 // 4)  # 400 MiB touched
    del big
    high = peak_memory_mb(torch.device("cpu"))
    reset_peak_memory(torch.device("cpu"))
    low = peak_memory_mb(torch.device("cpu"))
    assert high - low > 300, (high, low)
