"""astrai preprocess: shard layout, streaming writes, bad-record reporting and clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astrai.data.datasets import build_dataset
from astrai.data.preprocess import main, preprocess
from astrai.data.records import RecordError
from astrai.data.shards import RecordStore

CHAT = {"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_cli_writes_shards(tok_dir, tmp_path, capsys):
    src = _write(tmp_path / "a.jsonl", [{"text": f"doc {i} 12+{i}={12 + i}"} for i in range(30)])
    out = tmp_path / "out"
    assert main(["--input", str(src), "--out", str(out), "--tokenizer", str(tok_dir), "--train_type", "seq",
                 "--max_seq_len", "16", "--max_shard_tokens", "100"]) == 0
    info = json.loads((out / "dataset.json").read_text())
    assert info["num_records"] == 30 and len(info["shards"]) > 1 and info["num_bad_records"] == 0
    meta = json.loads((out / "shard_00000" / "meta.json").read_text())
    assert meta["keys"]["input_ids"]["dtype"] == "uint16"
    ids = np.memmap(out / "shard_00000" / "input_ids.bin", dtype=np.uint16, mode="r")
    offsets = np.memmap(out / "shard_00000" / "input_ids.offsets.bin", dtype=np.int64, mode="r")
    assert len(ids) == meta["keys"]["input_ids"]["num_items"] == offsets[-1]
    assert len(offsets) == meta["num_records"] + 1
    store = RecordStore.open(out)
    assert store.num_records == 30 and store.get("input_ids", 29)[-1] == info["eos_token_id"]
    assert "tokens/s" in capsys.readouterr().out
    assert not (tmp_path / ".out.partial").exists()


def test_bad_records_are_counted_with_lines(tok_dir, tmp_path, capsys):
    src = _write(tmp_path / "b.jsonl", [CHAT, "{not json", {"messages": "hello"}, CHAT, [1, 2],
                                        {"messages": [{"role": "user", "content": "no answer"}]},
                                        {"text": "wrong form"}, CHAT])
    out = tmp_path / "out"
    assert main(["--input", str(src), "--out", str(out), "--tokenizer", str(tok_dir), "--train_type", "sft",
                 "--max_seq_len", "64", "--max_bad_fraction", "1"]) == 0
    err = capsys.readouterr().err
    assert "skipped 5 bad record(s)" in err
    assert "b.jsonl:2: invalid JSON" in err
    info = json.loads((out / "dataset.json").read_text())
    assert info["num_records"] == 3 and info["num_bad_records"] == 5
    reasons = info["bad_record_reasons"]
    assert reasons[0].startswith("b.jsonl:2: invalid JSON")
    assert reasons[1] == "b.jsonl:3: field 'messages' must be a non-empty list of messages, got str"
    assert reasons[2] == "b.jsonl:5: record must be a JSON object, got list"
    assert reasons[3].startswith("b.jsonl:6: chat has no assistant tokens")
    assert reasons[4].startswith("b.jsonl:7: sft record needs 'messages'")


def test_strict_stops_at_first_bad_record(tok_dir, tmp_path, capsys):
    src = _write(tmp_path / "c.jsonl", [{"text": "fine"}, {"text": 7}])
    with pytest.raises(RecordError, match="c.jsonl:2: seq record needs a string field 'text', got int"):
        preprocess([src], tmp_path / "out", tok_dir, "seq", 16, strict=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    assert main(["--input", str(src), "--out", str(tmp_path / "o2"), "--tokenizer", str(tok_dir),
                 "--train_type", "seq", "--max_seq_len", "16", "--strict"]) == 1
    assert "--strict" in capsys.readouterr().err


def test_over_long_records(tok_dir, tok, tmp_path):
    long_chat = {"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}
    src = _write(tmp_path / "d.jsonl", [long_chat, CHAT])
    with pytest.raises(RecordError, match=r"d.jsonl:1: record has \d+ tokens but max_seq_len is 20; raise "
                                          "--max_seq_len or use --truncation"):
        preprocess([src], tmp_path / "o1", tok_dir, "sft", 20, truncation="error", strict=True)
    with pytest.raises(RecordError, match="no assistant token remains after truncation"):
        preprocess([src], tmp_path / "o2", tok_dir, "sft", 20, truncation="keep_start", strict=True)
    info = preprocess([src], tmp_path / "o3", tok_dir, "sft", 20, truncation="keep_end")
    assert info["num_records"] == 2
    row = build_dataset("sft", tmp_path / "o3", tok, 20)[0]
    assert len(row["input_ids"]) == 20
    assert tok.decode(row["labels"][row["labels"] != -100].tolist()) == "ok"
    prompts = _write(tmp_path / "p.jsonl", [{"prompt": "word " * 40}])
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens but max_seq_len is 20; shorten it"):
        preprocess([prompts], tmp_path / "o4", tok_dir, "prompt", 20)


def test_input_errors(tok_dir, tmp_path, capsys):
    empty = _write(tmp_path / "e.jsonl", [])
    with pytest.raises(ValueError, match="no usable records in .*e.jsonl \\(empty input\\)"):
        preprocess([empty], tmp_path / "o", tok_dir, "seq", 16)
    allbad = _write(tmp_path / "f.jsonl", [{"txt": "typo"}])
    with pytest.raises(ValueError, match="all 1 records were bad: f.jsonl:1: seq record needs a string field 'text', "
                                         "got no 'text' field; keys are \\['txt'\\]"):
        preprocess([allbad], tmp_path / "o", tok_dir, "seq", 16)
    with pytest.raises(FileNotFoundError, match="--input file '.*missing.jsonl' does not exist"):
        preprocess([tmp_path / "missing.jsonl"], tmp_path / "o", tok_dir, "seq", 16)
    good = _write(tmp_path / "g.jsonl", [{"text": "hello"}])
    assert main(["--input", str(good), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path),
                 "--train_type", "seq", "--max_seq_len", "16"]) == 1
    assert "has no tokenizer.json" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--pack applies to sft records, not 'dpo'"):
        preprocess([good], tmp_path / "o", tok_dir, "dpo", 16, pack=True)
    preprocess([good], tmp_path / "done", tok_dir, "seq", 16)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        preprocess([good], tmp_path / "done", tok_dir, "seq", 16)
    with pytest.raises(SystemExit):
        main(["--input", str(good), "--out", "x", "--tokenizer", str(tok_dir), "--train_type", "rlhf",
              "--max_seq_len", "16"])


def test_dataset_errors(tok, tok_dir, tmp_path):
    src = _write(tmp_path / "s.jsonl", [CHAT] * 3)
    preprocess([src], tmp_path / "sft", tok_dir, "sft", 64)
    with pytest.raises(ValueError, match="preprocessed for train_type 'sft', not 'dpo'"):
        build_dataset("dpo", tmp_path / "sft", tok, 64)
    with pytest.raises(ValueError, match="unknown record kind 'rl'"):
        build_dataset("rl", src, tok, 64)
    with pytest.raises(FileNotFoundError, match="not a finished shard directory"):
        build_dataset("sft", tmp_path, tok, 64)
    short = _write(tmp_path / "t.jsonl", [{"text": "hi"}])
    with pytest.raises(ValueError, match="fewer than max_seq_len \\+ 1 = 65"):
        build_dataset("seq", short, tok, 64)
    with pytest.raises(ValueError, match="rows of \\d+ tokens but max_seq_len is 4"):
        build_dataset("sft", tmp_path / "sft", tok, 4)


def test_chunked_writes_and_many_shards_read_back(tok, tok_dir, tmp_path, monkeypatch):
    # Small flush and shard sizes exercise the buffered-write path that large inputs take.
    from astrai.data import shards

    monkeypatch.setattr(shards, "_FLUSH_ITEMS", 7)
    chats = [{"messages": [{"role": "user", "content": f"{i}+{i}"}, {"role": "assistant", "content": str(2 * i)}]}
             for i in range(40)]
    src = _write(tmp_path / "m.jsonl", chats)
    info = preprocess([src], tmp_path / "out", tok_dir, "sft", 64, max_shard_tokens=90)
    assert len(info["shards"]) > 2
    from_shards = build_dataset("sft", tmp_path / "out", tok, 64)
    from_jsonl = build_dataset("sft", src, tok, 64)
    assert len(from_shards) == len(from_jsonl) == 40
    for i in range(40):
        for key in ("input_ids", "labels", "position_ids"):
            assert from_shards[i][key].tolist() == from_jsonl[i][key].tolist()


def test_non_utf8_line_is_a_bad_record(tok_dir, tmp_path):
    src = tmp_path / "u.jsonl"
    src.write_bytes(b'{"text": "fine"}\n{"text": "\xff\xfe"}\n')
    info = preprocess([src], tmp_path / "out", tok_dir, "seq", 16, max_bad_fraction=0.5)
    assert info["num_bad_records"] == 1 and "u.jsonl:2: line is not valid UTF-8" in info["bad_record_reasons"][0]


def test_utf8_bom_at_the_start_of_a_file_is_accepted(tok_dir, tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    info = preprocess([src], tmp_path / "out", tok_dir, "seq", 16)
    assert info["num_records"] == 2 and info["num_bad_records"] == 0
    mid = tmp_path / "mid.jsonl"  # a BOM anywhere else is still a bad line
    mid.write_bytes(b'{"text": "first"}\n\xef\xbb\xbf{"text": "second"}\n')
    info = preprocess([mid], tmp_path / "out2", tok_dir, "seq", 16, max_bad_fraction=1.0)
    assert info["num_bad_records"] == 1 and info["bad_record_reasons"][0].startswith("mid.jsonl:2: invalid JSON")


def test_input_may_be_a_directory_of_jsonl_files(tok_dir, tmp_path, capsys):
    d = tmp_path / "parts"
    d.mkdir()
    _write(d / "b.jsonl", [{"text": "two"}, {"text": "three"}])
    _write(d / "a.jsonl", [{"text": "one"}])
    (d / "notes.txt").write_text("not data")
    single = _write(tmp_path / "c.jsonl", [{"text": "four"}])
    assert main(["--input", str(d), str(single), "--out", str(tmp_path / "out"), "--tokenizer", str(tok_dir),
                 "--train_type", "seq", "--max_seq_len", "16"]) == 0
    info = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert info["inputs"] == ["a.jsonl", "b.jsonl", "c.jsonl"] and info["num_records"] == 4
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no .jsonl files"):
        preprocess([empty], tmp_path / "o2", tok_dir, "seq", 16)


def test_too_many_bad_records_fail_after_reporting_every_one(tok_dir, tmp_path, capsys):
    lines = [{"text": f"good {i}"} for i in range(97)] + [{"text": 1}, "{oops", {"txt": "x"}]  # 3 of 100 bad
    src = _write(tmp_path / "d.jsonl", lines)
    args = ["--input", str(src), "--tokenizer", str(tok_dir), "--train_type", "seq", "--max_seq_len", "16"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 1  # default --max_bad_fraction 0.01
    err = capsys.readouterr().err
    for where in ("d.jsonl:98:", "d.jsonl:99:", "d.jsonl:100:"):
        assert f"bad record {where}" in err
    assert "3 of 100 records (3.0%) were bad, more than --max_bad_fraction 0.01" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()
    assert main([*args, "--out", str(tmp_path / "out"), "--max_bad_fraction", "0.05"]) == 0
    assert "skipped 3 bad record(s)" in capsys.readouterr().err
