"""`astrai preprocess`: JSONL records -> token shards, streaming, with bad-record reporting.

The first step of training data flow: JSONL -> preprocess -> shards -> dataset -> sampler ->
trainer. Records are read one line at a time and written as they are encoded, so memory does
not grow with the number of records (text records are encoded in batches by the Rust
tokenizer for speed). `--pack` packs sft chats into rows of max_seq_len with document-reset
position_ids, with the same greedy packer the datasets use. Records that cannot be used are
skipped, counted and each reported with file and line; `--strict` stops at the first one
instead, and a run whose bad fraction exceeds `--max_bad_fraction` fails after reporting them
all (leaving no shards). `--input` takes files and directories (their *.jsonl files, sorted); a
UTF-8 byte-order mark at the start of a file is accepted.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.data.datasets import Packer, document_positions
from astrai.data.records import (
    RECORD_KINDS,
    TRUNCATION_MODES,
    RecordError,
    encode_record,
    finish_text,
    iter_jsonl,
    record_text,
)
from astrai.data.shards import ShardWriter
from astrai.data.tokenizer import Tokenizer, load_tokenizer
from astrai.flags import ArgumentParser

KEYS = {
    "seq": ["input_ids"],
    "sft": ["input_ids", "loss_mask"],
    "dpo": ["chosen_input_ids", "chosen_loss_mask", "rejected_input_ids", "rejected_loss_mask", "record_json"],
    "prompt": ["prompt_ids", "record_json"],
    "rollout": ["prompt_ids", "response_ids", "record_json"],
}
_TEXT_BATCH = 1024
_BOM = b"\xef\xbb\xbf"
MAX_BAD_FRACTION = 0.01  # default share of bad records a run may skip before it fails


@dataclass
class BadRecords:
    """Counts skipped records and keeps the first few reasons, with where they came from."""

    strict: bool = False
    max_reports: int = 5
    count: int = 0
    num_good: int = 0  # records encoded fine (before packing)
    reasons: list[str] = field(default_factory=list)
    on_bad: Callable[[str], None] | None = None  # told about every bad record, e.g. to print it

    def add(self, where: str, error: Exception) -> None:
        if self.strict:
            raise RecordError(f"{where}: {error} (--strict stops at the first bad record)")
        self.count += 1
        if len(self.reasons) < self.max_reports:
            self.reasons.append(f"{where}: {error}")
        if self.on_bad is not None:
            self.on_bad(f"{where}: {error}")

    @property
    def fraction(self) -> float:
        return self.count / max(1, self.count + self.num_good)


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    """Files as given; a directory stands for its *.jsonl files in name order."""
    paths: list[Path] = []
    for item in map(Path, inputs):
        if item.is_dir():
            found = sorted(p for p in item.glob("*.jsonl") if p.is_file())
            if not found:
                raise FileNotFoundError(f"--input directory '{item}' holds no .jsonl files")
            paths += found
        elif item.is_file():
            paths.append(item)
        else:
            raise FileNotFoundError(f"--input file '{item}' does not exist")
    return paths


def _read_records(paths: list[Path]) -> Iterator[tuple[str, Any]]:
    """iter_jsonl, except that a UTF-8 byte-order mark before a file's first line is accepted."""
    for path in paths:
        with path.open("rb") as f:
            bom = f.read(len(_BOM)) == _BOM
        for where, record in iter_jsonl([path]):
            if bom and isinstance(record, RecordError) and where == f"{path.name}:1":
                record = _first_line_without_bom(path)
            yield where, record


def _first_line_without_bom(path: Path) -> Any:
    with path.open("rb") as f:
        raw = f.readline()[len(_BOM):]
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return RecordError(f"line is not valid UTF-8 (byte {e.start + len(_BOM)}); re-encode the file as UTF-8")
    except json.JSONDecodeError as e:
        return RecordError(f"invalid JSON ({e.msg} at column {e.colno})")


def _encoded_records(paths: list[Path], train_type: str, tokenizer: Tokenizer, max_seq_len: int,
                     truncation: str, bad: BadRecords) -> Iterator[dict[str, list[int]]]:
    """Encoded records in input order; bad ones are reported to `bad` and skipped."""
    if train_type != "seq":
        for where, record in _read_records(paths):
            try:
                if isinstance(record, RecordError):
                    raise record
                encoded = encode_record(record, train_type, tokenizer, max_seq_len, truncation)
            except RecordError as e:
                bad.add(where, e)
                continue
            bad.num_good += 1
            yield encoded
        return
    # Text: batch the encoding (the tokenizer is much faster on batches), keep input order.
    batch: list[tuple[str, str]] = []

    def flush() -> Iterator[dict[str, list[int]]]:
        ids = tokenizer.encode_batch([text for _, text in batch], add_special_tokens=True)
        for (where, _), doc in zip(batch, ids):
            try:
                encoded = finish_text(tokenizer, doc)
            except RecordError as e:
                bad.add(where, e)
                continue
            bad.num_good += 1
            yield encoded
        batch.clear()

    for where, record in _read_records(paths):
        try:
            if isinstance(record, RecordError):
                raise record
            batch.append((where, record_text(record)))
        except RecordError as e:
            bad.add(where, e)
        if len(batch) >= _TEXT_BATCH:
            yield from flush()
    yield from flush()


def _packed_rows(records: Iterator[dict[str, list[int]]], max_seq_len: int) -> Iterator[dict[str, list[int]]]:
    """Greedily pack sft records into rows; only the current row is held in memory."""
    packer, pending = Packer(max_seq_len), []

    def row(docs: list[dict[str, list[int]]]) -> dict[str, list[int]]:
        lengths = [len(d["input_ids"]) for d in docs]
        return {"input_ids": [t for d in docs for t in d["input_ids"]],
                "loss_mask": [t for d in docs for t in d["loss_mask"]],
                "position_ids": document_positions(lengths).tolist()}

    for record in records:
        done = packer.add(len(record["input_ids"]))
        if done is not None:
            yield row(pending[: len(done)])
            pending = pending[len(done):]
        pending.append(record)
    if pending:
        yield row(pending)


def preprocess(inputs: list[str | Path], out_dir: str | Path, tokenizer: Tokenizer | str | Path, train_type: str,
               max_seq_len: int, pack: bool = False, truncation: str = "keep_start", strict: bool = False,
               max_shard_tokens: int = 1 << 28, max_reports: int = 5, max_bad_fraction: float = MAX_BAD_FRACTION,
               on_bad: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write shards for `inputs` (JSONL files or directories of them) to `out_dir`; returns the
    dataset.json summary. More than `max_bad_fraction` bad records is a ValueError, raised after
    every record was read (each bad one told to `on_bad`), and leaves no shards behind."""
    if train_type not in RECORD_KINDS:
        raise ValueError(f"unknown --train_type '{train_type}'; expected one of {', '.join(RECORD_KINDS)}")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"unknown --truncation '{truncation}'; expected one of {', '.join(TRUNCATION_MODES)}")
    if max_seq_len <= 0:
        raise ValueError(f"--max_seq_len must be positive, got {max_seq_len}")
    if pack and train_type != "sft":
        raise ValueError(f"--pack applies to sft records, not '{train_type}' (seq data is a token stream "
                         "already; use pack=True in the dataset for document-reset positions)")
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise ValueError(f"--max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
    paths = expand_inputs(inputs)
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer)
    keys = KEYS[train_type] + (["position_ids"] if pack else [])
    meta = {"train_type": train_type, "max_seq_len": max_seq_len, "packed": pack, "truncation": truncation,
            "vocab_size": tokenizer.vocab_size, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    bad = BadRecords(strict=strict, max_reports=max_reports, on_bad=on_bad)
    records = _encoded_records(paths, train_type, tokenizer, max_seq_len, truncation, bad)
    rows = _packed_rows(records, max_seq_len) if pack else records
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out '{out}' exists and is not empty; choose a new directory or delete it")
    # Write into a hidden sibling and rename at the end, so a failed run leaves nothing behind
    # that could be mistaken for finished shards.
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        info = _write(rows, ShardWriter(staging, keys, tokenizer.vocab_size, meta, max_shard_tokens), bad, paths)
        if bad.fraction > max_bad_fraction:
            total = bad.count + bad.num_good
            raise ValueError(f"{bad.count} of {total} records ({bad.fraction:.1%}) were bad, more than "
                             f"--max_bad_fraction {max_bad_fraction:g}; fix them or raise --max_bad_fraction "
                             "(no shards were written)")
        if out.exists():
            out.rmdir()
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return info


def _write(rows: Iterator[dict[str, list[int]]], writer: ShardWriter, bad: BadRecords,
           paths: list[Path]) -> dict[str, Any]:
    num_rows = num_tokens = 0
    first_key = next(iter(writer.dtypes))
    for row in rows:
        writer.add(row)
        num_rows += 1
        num_tokens += len(row[first_key])
    if num_rows == 0:
        names = ", ".join(str(p) for p in paths)
        detail = f"all {bad.count} records were bad: " + "; ".join(bad.reasons) if bad.count else "empty input"
        raise ValueError(f"no usable records in {names} ({detail})")
    return writer.close({"num_records": num_rows, "num_tokens": num_tokens, "num_bad_records": bad.count,
                         "bad_record_reasons": bad.reasons, "inputs": [p.name for p in paths]})


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai preprocess", description="JSONL records -> token shards")
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files, or directories of .jsonl files")
    parser.add_argument("--out", required=True, help="output shard directory (must not hold shards yet)")
    parser.add_argument("--tokenizer", required=True, help="directory with tokenizer.json")
    parser.add_argument("--train_type", required=True, choices=RECORD_KINDS)
    parser.add_argument("--max_seq_len", type=int, required=True)
    parser.add_argument("--pack", action="store_true", help="pack sft chats into rows of max_seq_len")
    parser.add_argument("--truncation", default="keep_start", choices=TRUNCATION_MODES,
                        help="over-long sft/dpo records: keep the start, keep the end, or count as bad")
    parser.add_argument("--strict", action="store_true", help="stop at the first bad record")
    parser.add_argument("--max_bad_fraction", type=float, default=MAX_BAD_FRACTION,
                        help="fail (exit 1, no shards) when more than this fraction of records is bad")
    parser.add_argument("--max_shard_tokens", type=int, default=1 << 28)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        info = preprocess(args.input, args.out, args.tokenizer, args.train_type, args.max_seq_len, args.pack,
                          args.truncation, args.strict, args.max_shard_tokens,
                          max_bad_fraction=args.max_bad_fraction,
                          on_bad=lambda line: print(f"bad record {line}", file=sys.stderr))
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - start
    print(f"wrote {info['num_records']} {args.train_type} rows ({info['num_tokens']} tokens) in "
          f"{len(info['shards'])} shard(s) to {args.out} in {seconds:.1f}s "
          f"({info['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s)")
    if info["num_bad_records"]:
        print(f"skipped {info['num_bad_records']} bad record(s), each listed above", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

