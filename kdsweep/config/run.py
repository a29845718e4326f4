"""One kdsweep job's whole configuration: every section, and the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kdsweep.config.base import _check
from kdsweep.config.checkpoint import CheckpointConfig
from kdsweep.config.data import DataConfig
from kdsweep.config.dist import DistConfig
from kdsweep.config.downstream import DownstreamConfig
from kdsweep.config.logger import LoggerConfig
from kdsweep.config.loss import LossConfig
from kdsweep.config.model import StudentConfig, TeacherConfig, TeacherMember
from kdsweep.config.optim import OptimConfig
from kdsweep.config.profiler import ProfilerConfig
from kdsweep.config.rollout import RolloutConfig
from kdsweep.config.train import TrainConfig
from kdsweep.config.trial import TrialConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One kdsweep job: what to distil into what, on which data, with which loss and schedule."""

    output_dir: str
    """The run directory: checkpoints, exports, metrics and records go here."""
    model: StudentConfig = field(default_factory=lambda: StudentConfig(zoo="tiny-student"))
    teacher: TeacherConfig = field(default_factory=lambda: TeacherConfig(zoo="tiny-teacher"))
    teachers: tuple[TeacherMember, ...] = ()
    """Several teachers distilled at once, each with its own tokenizer and a weight (their KD term: the weighted
    mean of the divergences to each); when set, ``teacher.path``/``teacher.zoo`` are not read, its ``logits`` and
    ``cache`` apply to every teacher. Empty: the one ``teacher``."""
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)

    def __post_init__(self) -> None:
        _check(bool(self.output_dir), "output_dir is empty; pass hydra.run.dir=<directory>")
        self._check_teachers()
        self._check_cache()
        self._check_rollout()
        _check(not self.train.eval_test or self.data.has_test,
               "train.eval_test=true but data has no test split; set data.test_fraction=0.05 (or data.test_datasets)")
        _check(not self.train.eval_test or self.teacher.logits == "live",
               "train.eval_test=true: teacher.logits=cache holds no test rows; pass teacher.logits=live")
        pr = self.profiler
        _check(
            not pr.enabled or pr.wait + pr.warmup + pr.active <= self.train.max_steps,
            f"profiler.wait+warmup+active={pr.wait + pr.warmup + pr.active} steps exceed train.max_steps="
            f"{self.train.max_steps}, so no trace would be written; lower profiler.active or profiler.wait",
        )

    def loss_chunks(self, vocab: int) -> dict[str, int]:
        """The loss's chunks per training micro-batch and per held-out batch, from the configured sizes (``data``'s
        ``micro_batch_size`` and ``eval_batch_size`` × ``seq_len``), so every rank and batch takes the same path;
        ``vocab``: the student's output rows."""
        d = self.data
        return {"train": self.loss.chunks_for(d.micro_batch_size * d.seq_len, vocab),
                "eval": self.loss.chunks_for(d.eval_batch_size * d.seq_len, vocab)}

    def teacher_gives_hidden(self, vocab: int) -> bool:
        """Whether a live teacher gives its final hidden states (and its output layer) instead of its logits: for the
        fused loss when it splits (:meth:`loss_chunks`), so that no ``[N, V]`` teacher logits exist; otherwise its own
        forward's logits, which the plain graph reads at once."""
        return self.loss.impl == "fused" and max(self.loss_chunks(vocab).values()) > 1

    def teacher_views(self) -> list[tuple[float, "RunConfig"]]:
        """Each teacher's weight and the config as that teacher's alone (``teacher`` is it, ``teachers`` empty):
        one view of weight 1 without ``teachers``."""
        if not self.teachers:
            return [(1.0, self)]
        return [(m.weight, replace(self, teacher=replace(self.teacher, path=m.path, zoo=m.zoo), teachers=()))
                for m in self.teachers]

    def _check_teachers(self) -> None:
        """Weights that make a mean, and what several teachers cannot do yet: one line each."""
        if not self.teachers:
            return
        for i, m in enumerate(self.teachers):
            _check(m.weight >= 0, f"teachers.{i}.weight={m.weight} is negative; a teacher's weight is its share of the "
                                  f"KD term: pass teachers.{i}.weight=<0 or more>")
        weights = [m.weight for m in self.teachers]
        _check(sum(weights) > 0, f"teachers: the weights {weights} sum to {sum(weights):g}; give at least one teacher "
                                 "a positive weight, e.g. teachers.0.weight=1")
        _check(not self.rollout.active, "lmbda and rollout.seq_kd: generation with several teachers is not supported "
                                        "yet; pass lmbda=0 rollout.seq_kd=false, or one teacher")

    @property
    def cache_temperature(self) -> float:
        """The temperature the teacher cache's sparse targets are taken at (teacher.cache.temperature or the loss's)."""
        t = self.teacher.cache.temperature
        return self.loss.temperature if t is None else t

    def _check_cache(self) -> None:
        """What a teacher-logit cache method cannot give the loss: one line naming what would work."""
        c, loss = self.teacher.cache, self.loss
        if self.teacher.logits != "cache" or c.method == "full":
            return
        _check(
            c.method != "sample" or loss.divergence == "forward_kl",
            f"loss.divergence={loss.divergence} cannot be trained from teacher.cache.method=sample: draws from the "
            "teacher estimate only forward_kl without bias (the others need the teacher's probability wherever the "
            "student puts mass); use loss.divergence=forward_kl, or teacher.cache.method=topk (every divergence on "
            "the top k + tail) or full",
        )
        _check(
            self.cache_temperature == loss.temperature,
            f"teacher.cache.temperature={c.temperature} but loss.temperature={loss.temperature}: "
            f"{c.method} targets taken at one temperature are not the teacher at another; set "
            f"teacher.cache.temperature=null (the loss's), or use teacher.cache.method=full (logits: any temperature)",
        )

    def _check_rollout(self) -> None:
        """What generation needs from the data and the teacher: one line naming what would work."""
        r, d = self.rollout, self.data
        if not r.active:
            return
        knob = f"lmbda={r.lmbda}" if r.lmbda > 0 else "rollout.seq_kd=true"
        texts = [ds for ds in d.datasets if ds.format == "text"]
        _check(bool(d.datasets) and not texts and d.sequences != "stream",
               f"{knob} needs prompts to complete, and text data has none; use data=instruction or data=chat "
               "(prompts: instructions, or a chat's last assistant turn), or pass lmbda=0 rollout.seq_kd=false")
        _check(self.teacher.logits == "live",
               f"{knob} needs the teacher on generated tokens, and teacher.logits=cache holds only the fixed data's; "
               "pass teacher.logits=live")
        _check(r.max_new_tokens < d.seq_len,
               f"rollout.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in data.seq_len={d.seq_len}; "
               f"pass rollout.max_new_tokens=<less than {d.seq_len}>")

    def check_world_size(self, world_size: int) -> None:
        """The global batch must split evenly into micro-batches on every rank."""
        d = self.data
        _check(
            d.batch_size % (d.micro_batch_size * world_size) == 0,
            f"data.batch_size={d.batch_size} does not split over {world_size} ranks × data.micro_batch_size="
            f"{d.micro_batch_size}; make batch_size a multiple of {d.micro_batch_size * world_size} "
            "(or lower micro_batch_size)",
        )
