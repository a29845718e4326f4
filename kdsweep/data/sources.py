"""Rows of one data source, read offline, with one-line errors.

Kinds of source (chosen by suffix, or by the contents of a folder):

- ``.jsonl``: one JSON object per non-empty line.
- ``.json``: a JSON list of objects, ``{"data": [...]}`` (or a dict with exactly one list-valued key), or
  JSON Lines saved as ``.json`` (what ``datasets.Dataset.to_json`` writes).
- ``.parquet``: read with pyarrow; nested columns (e.g. chat ``messages``) come back as lists of dicts.
- ``.csv`` / ``.tsv``: one row per record, keyed by the header.
- ``.txt``: one document per non-empty line, as ``{"text": line}``.
- a folder saved by ``datasets.Dataset.save_to_disk``, or by ``DatasetDict.save_to_disk`` (pick ``split``,
  ``"train"`` by default);
- a hub dataset id ``org/name`` (``org/name@revision``) that names no local path: the split ``datasets`` loads
  for it, from its cache when ``HF_HUB_OFFLINE=1`` (kdsweep never asks for a download itself);
- any other folder: the rows of its data shards (all ``.jsonl``, ``.parquet``, ``.csv`` or ``.json``, recursive)
  concatenated in sorted order, so a Hub-style folder's README does not count; a folder without shards gives
  one ``{"text": ...}`` document per ``*.txt``/``*.md`` file (recursive, sorted by relative path).

Names starting with ``.`` are ignored in folders. Every error is a :class:`ConfigError` of one line that
starts with the config key the path came from and says how to fix it.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from kdsweep.config.schema import ConfigError, DataConfig, DatasetConfig
from kdsweep.hub import hub_id

SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt")
TEXT_SUFFIXES = (".txt", ".md")
SHARD_SUFFIXES = (".jsonl", ".parquet", ".csv", ".json")


def read_rows(path: str, *, split: str | None = None, key: str = "data.datasets",
              limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of the source at ``path``; at most ``limit`` rows when given (cheap peek: read only what is needed)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    p, where = Path(path), f"{key}: {path}"
    is_dict = p.is_dir() and (p / "dataset_dict.json").is_file()
    if not p.exists() and hub_id(path) is not None:
        rows = _take(hub_dataset(path, split, where, key), limit)
    elif not p.exists():
        raise ConfigError(f"{where} does not exist; point {key} to an existing file ({', '.join(SUFFIXES)}) or folder")
    elif split is not None and not is_dict:
        raise ConfigError(f"{where}: split={split!r} only applies to a DatasetDict folder or a hub dataset, which this "
                          "is not; unset split")
    elif is_dict or (p.is_dir() and (p / "state.json").is_file() and (p / "dataset_info.json").is_file()):
        rows = _saved_dataset(p, (split or "train") if is_dict else None, where, limit)
    elif p.is_dir():
        rows = _folder(p, key, limit)
    elif p.suffix.lower() in SUFFIXES:
        rows = _file(p, where, limit)
    else:
        raise ConfigError(
            f"{where} has unknown kind {p.suffix or '(no suffix)'!r}; use a {', '.join(SUFFIXES)} file, "
            "a folder saved by datasets' save_to_disk, or a folder of text files or data shards"
        )
    if not rows:
        raise ConfigError(f"{where} is empty (no rows); remove it from {key.split('[')[0]} or fill it")
    return rows


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _file(p: Path, where: str, limit: int | None) -> list[dict[str, Any]]:
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return _parquet(p, where, limit)
    try:
        with open(p, encoding="utf-8", newline="" if suffix in (".csv", ".tsv") else None) as f:
            if suffix == ".jsonl":
                return _json_lines(f, where, limit)
            if suffix == ".json":
                return _json(f.read(), where, limit)
            if suffix == ".txt":
                return _take(({"text": line.rstrip("\n")} for line in f if line.strip()), limit)
            return _csv(f, "\t" if suffix == ".tsv" else ",", where, limit)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text ({_one_line(e)}); re-encode it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({_one_line(e)}); check that it is a readable file") from None


def _take(rows: Iterable[dict[str, Any]], limit: int | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for row in rows:
        out.append(row)
        if limit is not None and len(out) >= limit:
            break
    return out


def _json_lines(lines: Iterable[str], where: str, limit: int | None) -> list[dict[str, Any]]:
    def parse() -> Iterable[dict[str, Any]]:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: line {n} is not valid JSON ({e.msg}); fix or remove that line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: line {n} is a {type(row).__name__}, not a JSON object; "
                                  "write one {...} per line")
            yield row

    return _take(parse(), limit)


def _json(text: str, where: str, limit: int | None) -> list[dict[str, Any]]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if text.lstrip().startswith("["):  # a broken JSON list, not JSON Lines: report where it broke
            raise ConfigError(f"{where} is not valid JSON (line {e.lineno}: {e.msg}); fix the file") from None
        return _json_lines(text.splitlines(), where, limit)
    if isinstance(obj, dict):
        lists = [k for k, v in obj.items() if isinstance(v, list)]
        if isinstance(obj.get("data"), list):
            obj = obj["data"]
        elif len(lists) == 1 and "\n" in text.strip():  # a one-line dict is one JSON Lines row ({"messages": [...]})
            obj = obj[lists[0]]
        else:
            obj = [obj]
    if not isinstance(obj, list):
        raise ConfigError(f"{where} holds a JSON {type(obj).__name__}; write a list of objects or one object per line")
    for i, row in enumerate(obj):
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: item {i} is a {type(row).__name__}, not a JSON object; "
                              "make every row an object")
    return obj[:limit] if limit is not None else obj


def _csv(f: Iterable[str], delimiter: str, where: str, limit: int | None) -> list[dict[str, Any]]:
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # documents are often longer than 128 KiB
    reader = csv.DictReader(f, delimiter=delimiter)

    def parse() -> Iterable[dict[str, Any]]:
        try:
            for row in reader:
                if None in row:
                    raise ConfigError(f"{where}: line {reader.line_num} has more fields than the header; "
                                      "quote or fix it")
                yield dict(row)
        except csv.Error as e:
            raise ConfigError(f"{where}: line {reader.line_num} is not valid CSV ({_one_line(e)}); "
                              "fix that line") from None

    return _take(parse(), limit)


def _parquet(p: Path, where: str, limit: int | None) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
        if limit is None:
            return pf.read().to_pylist()
        return _take((row for batch in pf.iter_batches(batch_size=limit) for row in batch.to_pylist()), limit)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ConfigError(f"{where} is not a readable Parquet file ({_one_line(e)}); "
                          "rewrite it with pyarrow or pandas") from None


def _saved_dataset(p: Path, split: str | None, where: str, limit: int | None) -> list[dict[str, Any]]:
    """Rows of a ``Dataset.save_to_disk`` folder, or of one split (a sub-folder) of a ``DatasetDict`` one."""
    try:
        if split is not None:
            splits = json.loads((p / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
            if split not in splits:
                raise ConfigError(f"{where} has no split {split!r} (splits: {', '.join(splits)}); "
                                  "set split to one of them")
            p = p / split
        if json.loads((p / "state.json").read_text(encoding="utf-8")).get("_data_files") == []:
            return []  # a saved dataset of zero rows has no shards, and datasets cannot load it
        import datasets

        ds = datasets.Dataset.load_from_disk(str(p))
    except ConfigError:
        raise
    except Exception as e:  # datasets raises many kinds; the user needs one line, not a traceback
        raise ConfigError(f"{where} cannot be loaded by datasets.load_from_disk ({_one_line(e)}); "
                          "save it again") from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.to_list()


def hub_dataset(path: str, split: str | None, where: str, key: str) -> Any:
    """The ``split`` (default train) of hub dataset ``path`` (``org/name[@revision]``) as ``datasets`` loads it:
    from its cache when ``HF_HUB_OFFLINE=1`` (what a cluster node reads), else through the hub."""
    import datasets

    repo, revision = hub_id(path)
    try:
        return datasets.load_dataset(repo, revision=revision, split=split or "train")
    except Exception as e:  # datasets raises many kinds; the user needs one line, not a traceback
        raise ConfigError(
            f"{where} is not a local path, and datasets cannot load {repo} ({_one_line(e)[:200]}); fill the datasets "
            f"cache ({datasets.config.HF_DATASETS_CACHE}) with datasets.load_dataset({repo!r}) on a machine with "
            f"network, or point {key} to a local file or folder"
        ) from None


def _visible_files(p: Path) -> list[Path]:
    """Files under folder ``p`` (recursive), no part of the name starting with '.', sorted by relative path."""
    files = [f for f in p.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)]
    return sorted(files, key=lambda f: f.relative_to(p).parts)


def _folder(p: Path, key: str, limit: int | None) -> list[dict[str, Any]]:
    where, files = f"{key}: {p}", _visible_files(p)
    kinds = sorted({f.suffix.lower() for f in files if f.suffix.lower() in SHARD_SUFFIXES})
    if len(kinds) > 1:
        raise ConfigError(f"{where} mixes shard kinds ({', '.join(kinds)}); keep one kind per folder")
    texts = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES]
    if not kinds and texts:
        def docs() -> Iterable[dict[str, Any]]:
            for f in texts:
                try:
                    text = f.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{key}: {f} is not UTF-8 text ({_one_line(e)}); re-encode it as UTF-8") from None
                except OSError as e:
                    raise ConfigError(f"{key}: {f} cannot be read ({_one_line(e)}); check its permissions") from None
                if text.strip():
                    yield {"text": text}

        return _take(docs(), limit)
    if not kinds:
        raise ConfigError(
            f"{where} has no usable files; put *.txt/*.md documents or {'/'.join(SHARD_SUFFIXES)} shards in it, "
            "or save it with datasets' save_to_disk"
        )
    rows: list[dict[str, Any]] = []
    for f in (f for f in files if f.suffix.lower() == kinds[0]):
        rows += _file(f, f"{key}: {f}", None if limit is None else limit - len(rows))
        if limit is not None and len(rows) >= limit:
            break
    return rows


def _signature(p: Path) -> list[tuple[str, int, int]]:
    out = []
    for f in _visible_files(p) if p.is_dir() else [p]:
        st = f.stat()
        out.append((str(f.resolve()), st.st_size, st.st_mtime_ns))
    return out


def _hash_files(p: Path) -> str:
    """sha256 of a file's bytes, or of a folder's sorted (relative path, size, bytes) records."""
    h, is_dir = hashlib.sha256(), p.is_dir()
    for f in _visible_files(p) if is_dir else [p]:
        if is_dir:  # the size frames the bytes, so (a, "xy") and (a + "x", "y") differ
            h.update(f"{f.relative_to(p).as_posix()}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def content_hash(path: str, memo_dir: Path | None = None) -> str:
    """sha256 hex of the source's content: a file's bytes (as ``sha256sum``); for a folder, the sorted relative paths
    and bytes of every file in it (recursive; names starting with '.' are ignored).

    With ``memo_dir``, the hash is memoized in one small JSON file per source under it, valid while the (absolute
    path, size, mtime_ns) of every file involved is unchanged, so an unchanged multi-GB dataset is hashed once. The
    memo is written to a temp file and ``os.replace``-d, so concurrent writers never leave a torn one.
    """
    p = Path(path)
    if not p.exists() and hub_id(path) is not None:  # a hub dataset counts by the Arrow files of its cache entry
        p = Path(hub_dataset(path, None, path, "data.datasets").cache_files[0]["filename"]).parent
    if not p.exists():
        raise FileNotFoundError(f"{path} does not exist; cannot hash it")
    if memo_dir is None:
        return _hash_files(p)
    signature = [list(s) for s in _signature(p)]  # taken before reading: a change during hashing forces a rehash
    memo = Path(memo_dir) / f"{hashlib.sha256(str(p.resolve()).encode()).hexdigest()[:32]}.json"
    try:
        saved = json.loads(memo.read_text())
        if saved["files"] == signature:
            return str(saved["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no memo yet, or an unreadable one: recompute
    digest, tmp = _hash_files(p), None
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=memo.parent, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "w") as fh:
            json.dump({"path": str(p.resolve()), "files": signature, "sha256": digest}, fh)
        os.replace(tmp, memo)  # atomic: concurrent writers never leave a half-written memo
    except OSError:  # a read-only memo folder only costs a rehash next time
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return digest


def train_sources(cfg: DataConfig) -> list[tuple[str, DatasetConfig]]:
    """(config key, source) of each training source; no ``data.datasets`` means the embedded corpus."""
    from kdsweep.data.text import EMBEDDED_CORPUS

    sources = cfg.datasets or (DatasetConfig(path=str(EMBEDDED_CORPUS)),)
    return [(f"data.datasets[{i}]", ds) for i, ds in enumerate(sources)]


def eval_sources(cfg: DataConfig) -> list[tuple[str, DatasetConfig]]:
    """(config key, source) of each explicit held-out source."""
    return [(f"data.eval_datasets[{i}]", ds) for i, ds in enumerate(cfg.eval_datasets)]


def test_sources(cfg: DataConfig) -> list[tuple[str, DatasetConfig]]:
    """(config key, source) of each explicit test source."""
    return [(f"data.test_datasets[{i}]", ds) for i, ds in enumerate(cfg.test_datasets)]
