"""Pure KD loss math (imports only torch)."""

from kdsweep.losses.kd import (
    LossSums,
    align_vocab,
    cross_entropy_sum,
    forward_kl_per_token,
    forward_kl_sum,
    kd_loss_sums,
    split_chunks,
)

__all__ = [
    "LossSums",
    "align_vocab",
    "cross_entropy_sum",
    "forward_kl_per_token",
    "forward_kl_sum",
    "kd_loss_sums",
    "split_chunks",
]
