"""Reading one local data source (every kind, limit, errors) and hashing its content, on real files."""

import csv
import hashlib
import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kdsweep.config.schema import ConfigError
from kdsweep.data import sources
from kdsweep.data.sources import SUFFIXES, content_hash, read_rows

KEY = "data.datasets[1].path"
CHATS = [
    {"id": 0, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"id": 1, "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"id": 2, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "bye"}]},
]
ROWS = [{"text": "alpha", "n": 1}, {"text": "beta", "n": 2}, {"text": "gamma", "n": 3}]


def error(path, match, **kw):
    """The one-line ConfigError that reading ``path`` raises."""
    with pytest.raises(ConfigError, match=match) as e:
        read_rows(str(path), key=KEY, **kw)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{KEY}: {path}")
    return message


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- files ----------------------------------------------------------------------------------------------------


def test_jsonl_rows_skip_blank_lines_and_honour_limit(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(CHATS[0]) + "\n\n  \n" + json.dumps(CHATS[1]) + "\n" + json.dumps(CHATS[2]))
    assert read_rows(str(p)) == CHATS
    assert read_rows(str(p), limit=2) == CHATS[:2]


def test_jsonl_limit_stops_reading_before_a_broken_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n{broken\n")
    assert read_rows(str(p), limit=1) == ROWS[:1]
    error(p, r"line 2 is not valid JSON")


def test_json_list_wrapped_dict_and_json_lines(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps(CHATS, indent=2))
    (tmp_path / "data.json").write_text(json.dumps({"version": "1", "data": ROWS}))
    (tmp_path / "one_key.json").write_text(json.dumps({"version": "1", "rows": ROWS}, indent=1))
    datasets.Dataset.from_list(CHATS).to_json(tmp_path / "lines.json")  # JSON Lines, saved as .json
    for name, rows in [("list", CHATS), ("data", ROWS), ("one_key", ROWS), ("lines", CHATS)]:
        assert read_rows(str(tmp_path / f"{name}.json")) == rows, name
    assert read_rows(str(tmp_path / "lines.json"), limit=1) == CHATS[:1]


def test_json_single_line_object_is_one_row_not_unwrapped(tmp_path):
    p = tmp_path / "one.json"
    datasets.Dataset.from_list(CHATS[:1]).to_json(p)  # {"id":0,"messages":[...]} on one line
    assert read_rows(str(p)) == CHATS[:1]


def test_parquet_nested_messages_and_limit(tmp_path):
    p = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(CHATS), p, row_group_size=1)
    assert read_rows(str(p)) == CHATS
    assert read_rows(str(p), limit=2) == CHATS[:2]
    assert isinstance(read_rows(str(p))[0]["messages"][0], dict)


def test_csv_and_tsv(tmp_path):
    for name, delimiter in [("a.csv", ","), ("a.tsv", "\t")]:
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, delimiter=delimiter)
            w.writerow(["text", "label"])
            w.writerows([["one, with comma", "x"], ["two\ttab \"quoted\"\nnewline", "y"], ["drei ü", "z"]])
        want = [{"text": "one, with comma", "label": "x"}, {"text": "two\ttab \"quoted\"\nnewline", "label": "y"},
                {"text": "drei ü", "label": "z"}]
        assert read_rows(str(tmp_path / name)) == want, name
        assert read_rows(str(tmp_path / name), limit=1) == want[:1], name


def test_csv_row_longer_than_header_is_an_error(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("text\nok\nbad,extra\n")
    error(p, r"line 3 has more fields than the header")


def test_txt_is_one_document_per_non_empty_line(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("first doc\n\n   \nsecond doc\nthird doc")
    assert read_rows(str(p)) == [{"text": "first doc"}, {"text": "second doc"}, {"text": "third doc"}]
    assert read_rows(str(p), limit=2) == [{"text": "first doc"}, {"text": "second doc"}]


# ---- saved datasets ---------------------------------------------------------------------------------------------


def test_save_to_disk_dataset_with_nested_messages(tmp_path):
    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "ds"))
    assert read_rows(str(tmp_path / "ds")) == CHATS
    assert read_rows(str(tmp_path / "ds"), limit=2) == CHATS[:2]
    assert read_rows(str(tmp_path / "ds"), limit=10) == CHATS
    error(tmp_path / "ds", r"split='train' only applies to .*DatasetDict", split="train")


def test_dataset_dict_split_selection_and_missing_split(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(CHATS), "test": datasets.Dataset.from_list(ROWS)})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert read_rows(str(tmp_path / "dd")) == CHATS
    assert read_rows(str(tmp_path / "dd"), split="test") == ROWS
    assert read_rows(str(tmp_path / "dd"), split="test", limit=1) == ROWS[:1]
    message = error(tmp_path / "dd", r"has no split 'validation'", split="validation")
    assert "train" in message and "test" in message and "set split" in message


def test_dataset_dict_without_train_needs_a_split(tmp_path):
    datasets.DatasetDict({"eval": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    error(tmp_path / "dd", r"has no split 'train' \(splits: eval\); set split")
    assert read_rows(str(tmp_path / "dd"), split="eval") == ROWS


def test_empty_saved_dataset_is_an_error(tmp_path):
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "ds"))
    error(tmp_path / "ds", r"is empty \(no rows\)")
    error(tmp_path / "ds", r"is empty \(no rows\)", limit=3)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_dict({"text": []})})
    dd.save_to_disk(str(tmp_path / "dd"))
    error(tmp_path / "dd", r"is empty \(no rows\)", split="test")


# ---- folders ----------------------------------------------------------------------------------------------------


def test_folder_of_text_files_is_one_document_per_file_sorted_recursive(tmp_path):
    d = tmp_path / "docs"
    (d / "b" / "c").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "b.md").write_text("# B\nbody of b\n")
    (d / "a.txt").write_text("line one\nline two\n")
    (d / "b" / "c" / "z.txt").write_text("deep")
    (d / "b" / "c" / "blank.txt").write_text("  \n")
    (d / ".hidden.txt").write_text("hidden")
    (d / ".git" / "HEAD.txt").write_text("hidden too")
    want = [{"text": "line one\nline two\n"}, {"text": "deep"}, {"text": "# B\nbody of b\n"}]
    assert read_rows(str(d)) == want  # sorted by relative path: a.txt, b/c/z.txt, b.md
    assert read_rows(str(d), limit=2) == want[:2]
    # a Hub-style folder (README.md beside data shards) is its shards
    (d / "data").mkdir()
    (d / "data" / "train.jsonl").write_text(json.dumps({"text": "a shard row"}) + "\n")
    assert read_rows(str(d)) == [{"text": "a shard row"}]


def test_folder_of_jsonl_shards_is_their_rows_in_name_order(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    write_jsonl(d / "part-1.jsonl", ROWS[2:])
    write_jsonl(d / "part-0.jsonl", ROWS[:2])
    (d / "empty.jsonl").write_text("")
    assert read_rows(str(d)) == ROWS
    assert read_rows(str(d), limit=1) == ROWS[:1]
    assert read_rows(str(d), limit=3) == ROWS


def test_folder_of_parquet_shards(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist(CHATS[:1]), d / "0.parquet")
    pq.write_table(pa.Table.from_pylist(CHATS[1:]), d / "1.parquet")
    assert read_rows(str(d)) == CHATS


def test_folder_errors(tmp_path):
    mixed, junk, empty = tmp_path / "mixed", tmp_path / "junk", tmp_path / "empty"
    for d in (mixed, junk, empty):
        d.mkdir()
    write_jsonl(mixed / "a.jsonl", ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), mixed / "b.parquet")
    (junk / "weights.bin").write_bytes(b"\0")
    error(mixed, r"mixes shard kinds \(\.jsonl, \.parquet\)")
    error(junk, r"has no usable files")
    error(empty, r"has no usable files")


def test_error_inside_a_shard_names_the_shard(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    (d / "a.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match=r"a\.jsonl: line 1 is a list, not a JSON object") as e:
        read_rows(str(d), key=KEY)
    assert str(e.value).startswith(f"{KEY}: {d / 'a.jsonl'}")


# ---- errors -----------------------------------------------------------------------------------------------------


def test_missing_path_and_unknown_suffix(tmp_path):
    assert "does not exist; point" in error(tmp_path / "nope.jsonl", r"does not exist")
    (tmp_path / "a.xlsx").write_bytes(b"PK")
    message = error(tmp_path / "a.xlsx", r"unknown kind '\.xlsx'")
    assert all(s in message for s in SUFFIXES) and "folder" in message


@pytest.mark.parametrize("name,content", [("a.jsonl", ""), ("b.jsonl", "\n  \n"), ("c.txt", "\n \n"), ("d.csv", "text,label\n"),
                                          ("e.json", "[]"), ("f.csv", "")])
def test_empty_files_are_errors(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    assert "remove it from data.datasets or fill it" in error(tmp_path / name, r"is empty \(no rows\)")
    error(tmp_path / name, r"is empty \(no rows\)", limit=5)


def test_empty_parquet_is_an_error(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), p)
    error(p, r"is empty \(no rows\)")
    error(p, r"is empty \(no rows\)", limit=2)


def test_invalid_json_line_names_the_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"text": "unterminated\n')
    error(p, r"line 3 is not valid JSON \(.+\); fix or remove that line")
    q = tmp_path / "a.json"  # JSON Lines saved as .json: same report
    q.write_text(json.dumps(ROWS[0]) + "\n" + "nope\n")
    error(q, r"line 2 is not valid JSON")
    r = tmp_path / "broken.json"
    r.write_text('[\n  {"a": 1},\n  {"a": \n]')
    error(r, r"is not valid JSON \(line 4: ")


def test_non_object_lines_and_items(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + '\n"just a string"\n')
    error(p, r"line 2 is a str, not a JSON object")
    q = tmp_path / "a.json"
    q.write_text(json.dumps([ROWS[0], 7]))
    error(q, r"item 1 is a int, not a JSON object")


def test_split_on_a_plain_file_is_an_error(tmp_path):
    p = write_jsonl(tmp_path / "a.jsonl", ROWS)
    error(p, r"split='test' only applies to .*DatasetDict.*; unset split", split="test")


def test_unreadable_parquet_and_non_utf8_are_one_line_errors(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"not parquet at all")
    error(tmp_path / "a.parquet", r"is not a readable Parquet file")
    (tmp_path / "b.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    error(tmp_path / "b.txt", r"is not UTF-8 text")


# ---- content_hash -----------------------------------------------------------------------------------------------


def test_file_hash_is_sha256_of_bytes_and_independent_of_path(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "sub" / "b.jsonl"
    b.parent.mkdir()
    a.write_bytes(b'{"text": "x"}\n')
    b.write_bytes(b'{"text": "x"}\n')
    assert content_hash(str(a)) == content_hash(str(b)) == hashlib.sha256(b'{"text": "x"}\n').hexdigest()
    b.write_bytes(b'{"text": "y"}\n')
    assert content_hash(str(a)) != content_hash(str(b))


def test_folder_hash_tracks_content_names_and_new_files_but_not_hidden_ones(tmp_path):
    def make(d):
        (d / "sub").mkdir(parents=True)
        (d / "a.txt").write_text("one")
        (d / "sub" / "b.txt").write_text("two")
        return d

    d, twin = make(tmp_path / "d"), make(tmp_path / "twin")
    h = content_hash(str(d))
    assert h == content_hash(str(twin))
    (d / ".cache").write_text("ignored")
    assert content_hash(str(d)) == h
    (d / "c.txt").write_text("")
    assert content_hash(str(d)) != h
    (d / "c.txt").unlink()
    assert content_hash(str(d)) == h
    (d / "a.txt").rename(d / "a2.txt")
    assert content_hash(str(d)) != h
    (d / "a2.txt").rename(d / "a.txt")
    (d / "sub" / "b.txt").write_text("twO")
    assert content_hash(str(d)) != h
    # byte boundaries between files are part of the hash
    (d / "a.txt").write_text("onet")
    (d / "sub" / "b.txt").write_text("wo")
    assert content_hash(str(d)) != h


def test_memo_skips_rereading_an_unchanged_file(tmp_path, monkeypatch):
    p, memo = tmp_path / "big.jsonl", tmp_path / "memo"
    p.write_text('{"text": "aaaa"}\n')
    first = content_hash(str(p), memo_dir=memo)
    assert first == content_hash(str(p)) and len(list(memo.iterdir())) == 1

    calls = []
    real = sources._hash_files
    monkeypatch.setattr(sources, "_hash_files", lambda path: calls.append(path) or real(path))
    assert content_hash(str(p), memo_dir=memo) == first and calls == []

    # same size and mtime, other bytes: the memo is trusted (proof that nothing was re-read)
    st = p.stat()
    p.write_text('{"text": "bbbb"}\n')
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert content_hash(str(p), memo_dir=memo) == first and calls == []
    # a new mtime invalidates the memo and stores the new hash
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = content_hash(str(p), memo_dir=memo)
    assert second != first and second == hashlib.sha256(p.read_bytes()).hexdigest() and len(calls) == 1
    assert content_hash(str(p), memo_dir=memo) == second and len(calls) == 1
    assert [f.name for f in memo.iterdir() if f.name.startswith(".")] == []  # no temp files left behind


def test_memo_of_a_folder_tracks_added_files_and_survives_a_corrupt_memo(tmp_path):
    d, memo = tmp_path / "d", tmp_path / "memo"
    d.mkdir()
    (d / "a.txt").write_text("one")
    h = content_hash(str(d), memo_dir=memo)
    (d / "b.txt").write_text("two")
    h2 = content_hash(str(d), memo_dir=memo)
    assert h2 != h and h2 == content_hash(str(d))
    (memo_file,) = memo.iterdir()
    memo_file.write_text("{not json")
    assert content_hash(str(d), memo_dir=memo) == h2
    assert json.loads(memo_file.read_text())["sha256"] == h2
