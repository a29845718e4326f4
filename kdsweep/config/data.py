"""The ``data`` section: the sources a run trains and evaluates on, and how samples become rows."""

from __future__ import annotations

from dataclasses import dataclass

from kdsweep.config.base import _check


@dataclass(frozen=True, kw_only=True)
class DatasetConfig:
    """One local data source (kdsweep.data.sources reads it) and how its rows become samples (kdsweep.data.formats)."""

    path: str
    """A ``.jsonl``/``.json``/``.parquet``/``.csv``/``.tsv`` file, a ``.txt`` file (one document per line), a folder
    saved by ``datasets``' ``save_to_disk``, a folder of text files (one document each) or of data-file shards."""
    format: str = "text"
    """One of :data:`FORMATS`: ``text``, ``instruction`` (alpaca-style columns) or ``chat`` (a list of messages)."""
    weight: float = 1.0
    """Share of the mix when ``data.mix=weighted`` (weights are normalized; proportions count samples)."""
    split: str | None = None
    """The split of a ``DatasetDict`` folder (default: train)."""
    text_column: str = "text"
    instruction_column: str = "instruction"
    input_column: str | None = "input"
    """The optional input column of an instruction row; null when the dataset has none."""
    output_column: str = "output"
    messages_column: str = "messages"


FORMATS = ("text", "instruction", "chat")

MIXES = ("concat", "weighted")

SEQUENCES = ("stream", "pack", "pad")

TRUNCATIONS = ("truncate", "drop")

PACK_STRATEGIES = ("best_fit", "sequential")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What a run trains and evaluates on, and how samples become sequences (kdsweep.data.dataset)."""

    datasets: tuple[DatasetConfig, ...] = ()
    """Training sources; empty means the embedded corpus that ships with kdsweep (format text)."""
    eval_datasets: tuple[DatasetConfig, ...] = ()
    """Held-out sources; empty means a seeded ``eval_fraction`` of every training source is held out."""
    eval_fraction: float = 0.05
    """Fraction of each training source's rows held out for evaluation when no ``eval_datasets`` are given."""
    test_datasets: tuple[DatasetConfig, ...] = ()
    """Test sources: rows no search selects on (the sweep's confirmation scores its verdict on them); empty means a
    seeded ``test_fraction`` of every training source, when that is above 0."""
    test_fraction: float = 0.0
    """Fraction of each training source's rows held out as the test split (taken after the eval rows, which it leaves
    as they are; the training rows lose it): evaluated once after training under ``train.eval_test``. The shipped
    searches set 0.05; 0 with no ``test_datasets``: no test split."""
    split_seed: int = 1234
    """Seed of the held-out splits and of the mix; separate from ``train.seed`` so a seed sweep keeps its data."""
    mix: str = "concat"
    """``concat``: every sample of every source once; ``weighted``: sources drawn in proportion to their weights
    (up- or down-sampled, seeded) into ``mix_samples`` samples."""
    mix_samples: int = 0
    """Size of a weighted mix in samples (0 = as many as the sources hold together)."""
    sequences: str = "stream"
    """How samples become rows: ``stream`` (text only: documents joined with EOS and cut into ``seq_len`` windows),
    ``pack`` (whole samples packed into ``seq_len`` rows, no attention across documents) or ``pad`` (one sample
    per row, each micro-batch padded to its longest)."""
    truncation: str = "truncate"
    """Samples longer than ``seq_len`` (pack, pad): ``truncate`` them or ``drop`` them; both are counted."""
    pack_strategy: str = "best_fit"
    """``best_fit`` (longest first, into the fullest row that holds it) or ``sequential`` (in order)."""
    train_on_prompt: bool = False
    """Train on prompt tokens too (instruction prompts, non-assistant chat turns); by default they are masked."""
    chat_template: str | None = None
    """A Jinja chat template (or a path to a ``.jinja`` file) used instead of the tokenizer's own."""
    add_bos: bool = False
    """Prepend the tokenizer's BOS token to text and instruction samples (chat templates write their own)."""
    cache_dir: str | None = None
    """Where tokenized data is cached (default ``$KDSWEEP_CACHE/data``); shared by every trial and rank."""
    seq_len: int = 128
    """Tokens per training row."""
    batch_size: int = 16
    """Rows per optimizer step, over all ranks and micro-batches (the global batch)."""
    micro_batch_size: int = 8
    """Rows per forward/backward on one rank; gradients accumulate over ``batch_size / micro_batch_size``."""
    eval_batch_size: int = 16
    """Rows per forward during evaluation."""
    max_eval_sequences: int = 0
    """Evaluate on at most this many rows of the eval split, and of the test split (0 = all of them)."""

    def __post_init__(self) -> None:
        _check(self.seq_len >= 2, f"data.seq_len={self.seq_len} must be >= 2")
        _check(self.batch_size >= 1, f"data.batch_size={self.batch_size} must be >= 1")
        _check(self.micro_batch_size >= 1, f"data.micro_batch_size={self.micro_batch_size} must be >= 1")
        _check(
            self.batch_size % self.micro_batch_size == 0,
            f"data.batch_size={self.batch_size} is not a multiple of data.micro_batch_size={self.micro_batch_size}; "
            "choose a micro_batch_size that divides the batch_size",
        )
        _check(self.eval_batch_size >= 1, f"data.eval_batch_size={self.eval_batch_size} must be >= 1")
        _check(self.max_eval_sequences >= 0, f"data.max_eval_sequences={self.max_eval_sequences} must be >= 0")
        _check(
            0.0 <= self.eval_fraction < 1.0,
            f"data.eval_fraction={self.eval_fraction} must be in [0, 1); it is the held-out share of each source",
        )
        _check(
            bool(self.eval_datasets) or self.eval_fraction > 0,
            "data has no eval split: set data.eval_datasets=[...] or data.eval_fraction to a value in (0, 1)",
        )
        held = (0.0 if self.eval_datasets else self.eval_fraction) + (0.0 if self.test_datasets else self.test_fraction)
        _check(
            0.0 <= self.test_fraction < 1.0 and held < 1.0,
            f"data.test_fraction={self.test_fraction} must be in [0, 1) and leave training rows beside "
            f"data.eval_fraction={self.eval_fraction}; e.g. data.test_fraction=0.05",
        )
        for knob, value, allowed in (("mix", self.mix, MIXES), ("sequences", self.sequences, SEQUENCES),
                                     ("truncation", self.truncation, TRUNCATIONS),
                                     ("pack_strategy", self.pack_strategy, PACK_STRATEGIES)):
            _check(value in allowed, f"data.{knob}={value} is unknown; use one of {', '.join(allowed)}")
        _check(self.mix_samples >= 0, f"data.mix_samples={self.mix_samples} must be >= 0 (0 = the sources' size)")
        for key in ("datasets", "eval_datasets", "test_datasets"):
            for i, ds in enumerate(getattr(self, key)):
                where = f"data.{key}[{i}]"
                _check(ds.format in FORMATS, f"{where}.format={ds.format} is an unknown data format; use one of "
                       f"{', '.join(FORMATS)}")
                _check(ds.weight >= 0 and ds.weight < float("inf"), f"{where}.weight={ds.weight} must be a finite "
                       "number >= 0")
                _check(self.sequences != "stream" or ds.format == "text",
                       f"data.sequences=stream joins plain text, but {where} has format {ds.format}; "
                       "use data.sequences=pack or data.sequences=pad")
        if self.mix == "weighted" and self.datasets:
            _check(sum(ds.weight for ds in self.datasets) > 0,
                   f"data.datasets weights sum to {sum(ds.weight for ds in self.datasets)}; give at least one "
                   "dataset a positive weight")

    @property
    def has_test(self) -> bool:
        """Whether the data has a test split."""
        return bool(self.test_datasets) or self.test_fraction > 0
