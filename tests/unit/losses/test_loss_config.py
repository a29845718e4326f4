"""LossConfig: the divergence settings validate in one line, and the train step passes them to the loss."""

import pytest
import torch

from kdsweep.config import ConfigError, LossConfig
from helpers import one_thread  # noqa: F401  (autouse: tiny tensors run fastest on one thread)


@pytest.mark.parametrize(
    "kwargs,field,fix",
    [
        (dict(beta=1.5), "loss.beta=1.5", "pass loss.beta=<value in [0, 1]>"),
        (dict(beta=-0.01), "loss.beta=-0.01", "pass loss.beta=<value in [0, 1]>"),
        (dict(beta=float("nan")), "loss.beta=nan", "pass loss.beta="),
        (dict(temperature=0.0), "loss.temperature=0.0", "pass loss.temperature=1.0"),
        (dict(temperature=-2.0), "loss.temperature=-2.0", "pass loss.temperature=1.0"),
        (dict(divergence="js"), "loss.divergence='js'", "use one of forward_kl, reverse_kl, jsd, jsd_normalized, tvd, symmetric"),
        (dict(impl="sparse"), "loss.impl='sparse' is unknown", "use one of auto, dense, chunked, fused"),
        (dict(chunk_mb=0.0), "loss.chunk_mb=0.0 must be > 0", "pass loss.chunk_mb=128"),
    ],
)
def test_bad_loss_settings_name_the_field_and_the_fix_in_one_line(kwargs, field, fix):
    with pytest.raises(ConfigError) as e:
        LossConfig(**kwargs)
    message = str(e.value)
    assert field in message and fix in message and "\n" not in message


@pytest.mark.parametrize("divergence", LossConfig.DIVERGENCES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_every_divergence_and_beta_end_is_accepted(divergence, beta):
    assert LossConfig(divergence=divergence, beta=beta).divergence == divergence


def test_the_chunks_are_as_many_as_the_byte_budget_asks():
    """ceil(tokens · vocab · 4 B / chunk_mb): a real vocabulary in chunks of at most 128 MiB, a small model's whole
    loss in one (the plain graph), dense always one."""
    default = LossConfig()
    assert default.impl == "auto" and default.chunk_mb == 128.0
    assert default.chunks_for(2048, 128256) == 8  # 1,002 MiB: Llama-3's vocabulary, 2,048 tokens
    assert default.chunks_for(2048, 151936) == 10  # Qwen3's output rows: 1,187 MiB
    assert default.chunks_for(8192, 128256) == 32
    assert default.chunks_for(1024, 2052) == 1  # the embedded default's micro-batch: 8 MiB
    assert LossConfig(chunk_mb=0.5).chunks_for(1024, 512) == 4  # 2 MiB exactly
    assert LossConfig(chunk_mb=0.5).chunks_for(1025, 512) == 5
    assert LossConfig(impl="dense", chunk_mb=0.001).chunks_for(8192, 128256) == 1


@pytest.mark.parametrize(
    "divergence,beta,impl", [("tvd", 0.5, "chunked"), ("jsd_normalized", 0.2, "dense"), ("reverse_kl", 0.5, "chunked")]
)
def test_train_step_passes_the_divergence_settings(divergence, beta, impl):
    """The logged KD term of a one-micro-batch step is the loss engine's, with these settings."""
    from helpers import tiny_llama
    from kdsweep.distributed import single_process
    from kdsweep.losses import kd_loss_sums
    from kdsweep.data.batch import Batch
    from kdsweep.teacher.live import LiveTeacher
    from kdsweep.train.step import Learner, train_step

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 96, (2, 9), generator=g)
    y = torch.randint(0, 96, (2, 9), generator=g)
    y[1, 4:] = -100
    student, teacher = tiny_llama(seed=1).train(), tiny_llama(seed=3).eval().requires_grad_(False)
    with torch.no_grad():
        s_logits, t_logits = student(input_ids=x).logits, teacher(input_ids=x).logits
        want = kd_loss_sums(s_logits, t_logits, y, divergence=divergence, beta=beta, temperature=2.0)
    cfg = LossConfig(divergence=divergence, beta=beta, impl=impl, temperature=2.0, kd_ratio=0.5)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learner = Learner(student, LiveTeacher(teacher, fused=impl == "fused"), opt, sched, cfg, max_grad_norm=0.0)
    stats, = train_step([learner], [Batch(x, y)], dist=single_process())
    assert stats.kd == pytest.approx((want.kd / want.tokens).item(), rel=1e-5)
    assert stats.kl == pytest.approx((want.kl / want.tokens).item(), rel=1e-5)


def test_a_live_teacher_gives_hidden_states_only_when_the_fused_loss_splits():
    """The teacher's side follows the student's chunk count: logits for the plain graph (one chunk) and for the
    chunked loss, hidden states (no [N, V] teacher logits) only for a fused loss of several chunks."""
    from kdsweep.config.schema import DataConfig, RunConfig

    data = DataConfig(seq_len=1024, micro_batch_size=2, eval_batch_size=2)
    run = lambda **loss: RunConfig(output_dir="out", data=data, loss=LossConfig(**loss))  # noqa: E731
    assert run(impl="fused").loss_chunks(128256) == {"train": 8, "eval": 8}
    assert run(impl="fused").teacher_gives_hidden(128256)
    assert not run(impl="fused").teacher_gives_hidden(2052)  # 16 MiB: one chunk, the plain graph
    assert not run(impl="chunked").teacher_gives_hidden(128256)
    assert not run(impl="fused", chunk_mb=2048.0).teacher_gives_hidden(128256)
