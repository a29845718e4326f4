"""The job's teacher: a live model, or a teacher-logit cache (built first by this job's ranks if nobody has yet)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable

import torch

from kdsweep.config.schema import RunConfig
from kdsweep.data.dataset import RunData
from kdsweep.distributed import DistEnv
from kdsweep.distributed.placement import Placement
from kdsweep.distributed.waits import from_rank0
from kdsweep.metrics.records import ALIGNMENT_FIELDS
from kdsweep.models.check import cross_tokenizer
from kdsweep.teacher.source import TeacherSource
from kdsweep.data.sampling import StepSampler
from kdsweep.teacher.build import Selection, ensure
from kdsweep.teacher.cache import Spec, cache_key, cache_root, teacher_hash
from kdsweep.teacher.cached import CachedSplit, CachedTeacher
from kdsweep.teacher.live import LiveTeacher

log = logging.getLogger(__name__)

SEMANTICS = {
    "full": ("exact", "exact (T=1)"),
    "sample": ("exact", "unbiased estimate from {k} draws at T={t:g}"),
    "topk": ("exact", "lower bound: the top {k} tokens and one tail outcome, at T={t:g}"),
}
"""What the held-out teacher numbers are, per cache method: (teacher CE, KL to the teacher)."""


@dataclass
class Teacher:
    """Where the train and eval targets come from, and what run.json says about them."""

    train: TeacherSource
    eval: TeacherSource
    record: dict[str, Any]
    identity: str
    """What its targets are made of (its cache, or its weights' content): the sweep's shared baseline is keyed by it."""

    def tokens(self) -> dict[str, int]:
        """Teacher tokens (positions) computed by a model and read from a cache, by this rank so far; and a
        cross-tokenizer teacher's alignment over the training steps' batches (summed over several teachers)."""
        sources = {id(s): s for s in (self.train, self.eval)}.values()
        counts = {"teacher_tokens_computed": sum(s.tokens_computed for s in sources),
                  "teacher_tokens_read": sum(s.tokens_read for s in sources)}
        members = getattr(self.train, "sources", [self.train])  # a mixture's teachers, or this one
        for name in ALIGNMENT_FIELDS:
            having = [getattr(s, name) for s in members if hasattr(s, name)]
            if having:
                counts[name] = sum(having)
        return counts


def vocab_size(model_dir: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size)


def check_reads(reader: Any, data: RunData, section: str, ignore_index: int, rows: int = 16) -> None:
    """The teacher reads the first training rows back as the same text (one line, before the first step, if its
    tokenizer changes the text: lossy normalisation)."""
    from kdsweep.config.schema import ConfigError
    from kdsweep.teacher.align import align_spans
    from kdsweep.teacher.reader import KEEP_THE_TEXT, check_unchanged

    batch = data.train.batch(torch.arange(min(rows, len(data.train))))
    for read in reader.read_batch(batch, "train", ignore_index):
        check_unchanged(read, section)
        try:
            align_spans(read.text, read.student, read.teacher, read.skipped)
        except ValueError as e:
            raise ConfigError(f"{section}: its tokenizer does not give the data's text back as it is ({e}); "
                              f"{KEEP_THE_TEXT}") from None


@dataclass
class CrossPair:
    """A teacher with another tokenizer and the student: how one reads the other's rows, the tokens they share,
    how the spans are scored, and what run.json says of it; live (:meth:`live`) or cached alike."""

    reads: dict[str, Any]
    """Per split, each row as the teacher reads it, aligned (:class:`~kdsweep.teacher.aligned_rows.AlignedRows`):
    from its tokens (:class:`~kdsweep.teacher.reader.RowReader`), or a chat row in the teacher's own template from
    what was kept beside it (:class:`~kdsweep.teacher.views.ViewReads`)."""
    scoring: dict[str, Any]
    """:class:`~kdsweep.losses.aligned.Aligned`'s settings: ``student_vocab``, ``loss``, ``vocab_map``, the GOLD
    weights, the logged divergence."""
    teacher_vocab: int
    """The teacher's output layer's rows (its logits' width)."""
    record: dict[str, Any]
    fused: bool = False
    """``loss.impl=fused``: the teacher's final hidden states, projected one chunk's spans at a time."""

    def live(self, model: torch.nn.Module, split: str = "train", fused: bool | None = None) -> Any:
        """The live teacher of ``split``'s rows (``fused``: whether it gives its hidden states; default
        :attr:`fused`)."""
        from kdsweep.teacher.cross import CrossTokenizerTeacher

        fused = self.fused if fused is None else fused
        return CrossTokenizerTeacher(model, self.reads, split=split, fused=fused, **self.scoring)

    def producer(self, model: torch.nn.Module, spec: Spec) -> Any:
        """What the teacher gives its cache: its hidden states projected a block of spans at a time, unless it
        transforms its logits after its output layer."""
        from kdsweep.models.heads import logit_transform
        from kdsweep.teacher.cross_cache import SpanTargets

        return SpanTargets(self.live(model, fused=logit_transform(model) is None), spec)


def cross_pair(cfg: RunConfig, teacher_dir: Path, student_dir: Path, data: RunData, device: torch.device) -> CrossPair:
    """The teacher reads each row in its tokens, its targets come on the student's (one line for a pair that
    cannot: a model larger than its output layer, a teacher that does not give the text back)."""
    from transformers import AutoConfig

    from kdsweep.config.schema import ConfigError
    from kdsweep.models.load import load_tokenizer
    from kdsweep.teacher.aligned_rows import aligned_splits
    from kdsweep.teacher.cross import vocab_map_of
    from kdsweep.teacher.reader import RowReader
    from kdsweep.teacher.views import ViewReads

    s_tok, t_tok = load_tokenizer(student_dir), load_tokenizer(teacher_dir)
    t_conf = AutoConfig.from_pretrained(teacher_dir).get_text_config()
    s_rows = int(AutoConfig.from_pretrained(student_dir).get_text_config().vocab_size)
    for section, tok, rows in (("model", s_tok, s_rows), ("teacher", t_tok, int(t_conf.vocab_size))):
        if len(tok) > rows:
            raise ConfigError(f"{section}: its tokenizer has {len(tok)} tokens but its output layer only {rows} rows "
                              "(vocab_size in config.json); the model does not match its tokenizer")
    vocab_map = vocab_map_of(s_tok, t_tok, int(t_conf.vocab_size)).to(device)
    loss = cfg.loss
    reader = RowReader(s_tok, t_tok) if data.train.views is None else \
        ViewReads({"train": data.train.views, "eval": data.eval.views})
    check_reads(reader, data, "teacher", loss.ignore_index)
    pad_id = t_tok.pad_token_id if t_tok.pad_token_id is not None else t_tok.eos_token_id
    reads = aligned_splits(reader, data, t_tok, int(t_conf.max_position_embeddings), pad_id)
    w_m = vocab_map.matched_share if loss.gold_matched_weight is None else loss.gold_matched_weight
    w_u = 1.0 - w_m if loss.gold_unmatched_weight is None else loss.gold_unmatched_weight
    log.info("teacher: its own tokenizer (%d tokens; the student's %d; %d shared): %s over aligned spans%s",
             len(t_tok), len(s_tok), len(vocab_map.teacher), loss.cross_tokenizer,
             f", weights {w_m:.3f} (shared: {loss.divergence}) and {w_u:.3f} (ULD)"
             if loss.cross_tokenizer == "gold" else "")
    distance = (f"gold ({w_m:.4g}·{loss.divergence} over the shared tokens + {w_u:.4g}·ULD over the rest)"
                if loss.cross_tokenizer == "gold" else "ULD (sorted-probability L1)")
    record = {"cross_tokenizer": {
        "loss": loss.cross_tokenizer, "student_vocab": len(s_tok), "teacher_vocab": len(t_tok),
        "shared_tokens": len(vocab_map.teacher), "w_matched": w_m, "w_unmatched": w_u},
        "teacher_ce": "the teacher's cross-entropy of the same text (its own tokens), per student token",
        "kl": f"{distance} between the two models' distributions over each aligned span, at T=1, per student token"}
    scoring = {"student_vocab": len(s_tok), "loss": loss.cross_tokenizer, "vocab_map": vocab_map,
               "w_matched": loss.gold_matched_weight, "w_unmatched": loss.gold_unmatched_weight,
               "kl_divergence": loss.divergence, "kl_beta": loss.beta}
    return CrossPair(reads, scoring, teacher_vocab=int(t_conf.vocab_size), record=record,
                     fused=cfg.teacher_gives_hidden(vocab_size(student_dir)))


def open_teacher(cfg: RunConfig, teacher_dir: Path, student_dir: Path, data: RunData, dist: DistEnv,
                 device: torch.device, announce: Callable[[dict[str, float]], None] = lambda progress: None,
                 keep: Callable[[str, Callable[[], Hashable], Callable[[], Any]], Any] = (
                     lambda kind, key, build: build()),
                 slot: str = "", placement: Placement | None = None) -> Teacher:
    """The job's teacher; ``announce`` hears how a cache build progresses (rank 0: seconds so far and to go).
    ``keep(kind, key, build)``: how a worker keeps a live teacher's weights while its files, dtype and placement stay
    the same (``train.kept.Kept.get``); a plain job builds it. ``slot``: which of several teachers this is (each
    kept apart, its collectives counted as ``teacher<slot>``'s). ``placement``: where its weights live on the ranks
    (as ``dist.teacher_placement`` alone would say when not given)."""
    from kdsweep.models.load import load_teacher

    load = lambda: load_teacher(teacher_dir, cfg.train.dtype, device, dist, cfg.dist, placement, f"teacher{slot}")
    if cfg.teacher.logits == "live":
        # its files' content (memoized by size and mtime), hashed by rank 0 while its peers wait outside collectives
        identity = from_rank0(dist, "hash the teacher's files",
                              lambda: teacher_hash(teacher_dir, cache_root(cfg) / "hashes"))
        d = cfg.dist
        key = lambda: (identity, cfg.train.dtype, str(device), dist.world_size, placement and placement.how,
                       (d.reshard_after_forward, d.cpu_offload, d.compile))
        model = keep(f"live_teacher{slot}", key, load)
        held = {"source": "live",
                "weights_dtype": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})}
        if cross_tokenizer(cfg):
            pair = cross_pair(cfg, teacher_dir, student_dir, data, device)
            return Teacher(pair.live(model, "train"), pair.live(model, "eval"), {**held, **pair.record}, identity)
        live = LiveTeacher(model, fused=cfg.teacher_gives_hidden(vocab_size(student_dir)))
        return Teacher(live, live, {**held, "teacher_ce": "exact", "kl": "exact (T=1)"}, identity)
    if cross_tokenizer(cfg):
        return cached_teacher(cfg, teacher_dir, student_dir, data, dist, device, announce, load,
                              cross_pair(cfg, teacher_dir, student_dir, data, device))
    return cached_teacher(cfg, teacher_dir, student_dir, data, dist, device, announce, load)


def cached_teacher(cfg: RunConfig, teacher_dir: Path, student_dir: Path, data: RunData, dist: DistEnv,
                   device: torch.device, announce: Callable[[dict[str, float]], None],
                   load: Callable[[], torch.nn.Module], pair: CrossPair | None = None) -> Teacher:
    """The teacher's targets from its cache, built first by this job's ranks if nobody has yet (``pair``: a teacher
    with another tokenizer, whose targets the cache keeps on the student's positions)."""
    from kdsweep.teacher.build import PlainTargets
    from kdsweep.teacher.cross_cache import CachedCrossTeacher

    if pair is None:
        spec = Spec.of(cfg, min(vocab_size(teacher_dir), vocab_size(student_dir)))
        produce = lambda: PlainTargets(load(), spec, cfg.loss.ignore_index, device)
        source = lambda split: CachedTeacher(split, device)
        described = {"teacher_ce": SEMANTICS[spec.method][0],
                     "kl": SEMANTICS[spec.method][1].format(k=spec.k, t=spec.temperature)}
    else:
        spec = Spec.of(cfg, pair.teacher_vocab, aligned=True)
        produce = lambda: pair.producer(load(), spec)
        source = lambda split: CachedCrossTeacher(split, device, pair.scoring)
        described = {**pair.record, "kl": pair.record["kl"].replace("at T=1", f"at T={spec.temperature:g}")} \
            if spec.method != "full" else pair.record
        if spec.method == "sample":
            log.warning("teacher.cache.method=sample with a teacher of another tokenizer: GOLD and ULD are computed "
                        "from the empirical distribution of %d draws, a biased plug-in estimate; "
                        "teacher.cache.method=topk keeps the top tokens' probabilities", spec.k)
    root = cache_root(cfg)
    digest = from_rank0(dist, "hash the teacher's files", lambda: teacher_hash(teacher_dir, root / "hashes"))
    used = torch.arange(len(data.train))
    prepared = (root / cache_key(spec, digest, data.cache_dir.name, "all")).is_dir()  # every row: `kdsweep prepare`
    if cfg.teacher.cache.rows == "used" and not prepared:
        used = StepSampler(len(data.train), cfg.data.batch_size, cfg.train.seed).rows_of_first_steps(
            cfg.train.max_steps)
    # the rows it holds: all (shared by any run on these rows), or those of this seed, batch size and length
    coverage = "all" if len(used) == len(data.train) else {
        "seed": cfg.train.seed, "batch_size": cfg.data.batch_size, "max_steps": cfg.train.max_steps}
    key = cache_key(spec, digest, data.cache_dir.name, coverage)
    info = {"teacher": str(teacher_dir), "teacher_hash": digest, "data_key": data.cache_dir.name, "rows": coverage}
    splits = {"train": Selection(data.train, used), "eval": Selection(data.eval, torch.arange(len(data.eval)))}
    path, built = ensure(root, key, spec, splits, produce, dist, device, cfg.data.micro_batch_size, info, announce)
    if built is not None:
        log.info("teacher cache: built %s in %s in %.1f s (%d teacher tokens, %d ranks); the teacher is unloaded",
                 spec.describe(), path, built["seconds"], built["teacher_tokens"], built["ranks"])
    else:
        log.info("teacher cache: reused %s in %s (the teacher is not loaded)", spec.describe(), path)
    record = {"source": "cache", "method": spec.method, "k": spec.k, "temperature": spec.temperature, "rows": coverage,
              "bytes_per_position": spec.bytes_per_position(), "dir": str(path), "built": built is not None,
              "build": built, "ready": True, **described,
              "kl_temperature": 1.0 if spec.method == "full" else spec.temperature}
    return Teacher(source(CachedSplit(path, "train", data.train)), source(CachedSplit(path, "eval", data.eval)), record,
                   path.name)
