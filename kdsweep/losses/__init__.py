"""Pure KD loss math (imports only torch)."""

from kdsweep.losses.divergences import (
    DIVERGENCES,
    check_divergence,
    divergence_per_token,
    divergence_sum,
    forward_kl,
    jsd,
    jsd_normalized,
    log_probs,
    reverse_kl,
    symmetric_kl,
    temperature_factor,
    total_variation,
)
from kdsweep.losses.kd import (
    LossSums,
    align_vocab,
    cross_entropy_sum,
    forward_kl_sum,
    kd_loss_sums,
    split_chunks,
    split_like,
    token_chunks,
)

__all__ = [
    "DIVERGENCES",
    "LossSums",
    "align_vocab",
    "check_divergence",
    "cross_entropy_sum",
    "divergence_per_token",
    "divergence_sum",
    "forward_kl",
    "forward_kl_sum",
    "jsd",
    "jsd_normalized",
    "kd_loss_sums",
    "log_probs",
    "reverse_kl",
    "split_chunks",
    "split_like",
    "token_chunks",
    "symmetric_kl",
    "temperature_factor",
    "total_variation",
]
