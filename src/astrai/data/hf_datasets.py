"""`datasets` datasets as a source of records, beside JSONL files and token shards.

Sits at the very start of the data flow, where `iter_jsonl` reads JSONL: a `data_path` (or
`val_data_path`) that names a dataset yields its rows as records, renamed by `data_columns`
(record field -> dataset column), and they go through the same `encode_record` validation as
JSONL lines. Two forms name a dataset:

- `hf:NAME[:SUBSET][@SPLIT]`: `datasets.load_dataset(NAME, SUBSET, split=SPLIT)` (split default
  `train`). NAME is a Hub dataset (read from the `datasets` cache; `HF_HUB_OFFLINE` /
  `HF_DATASETS_OFFLINE` forbid downloads) or a local directory of data files (parquet, JSON
  lines, CSV) that `load_dataset` reads without a loading script.
- `DIR[@SPLIT]`: a directory written by `Dataset.save_to_disk` (`dataset_info.json` and
  `state.json`) or `DatasetDict.save_to_disk` (`dataset_dict.json`; SPLIT picks one, default
  `train`), read with `datasets.load_from_disk`.

`datasets` is not a dependency of astrai: it is imported only when a dataset is named.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai.data.records import RecordError

HF_PREFIX = "hf:"
DEFAULT_SPLIT = "train"


@dataclass(frozen=True)
class DatasetSource:
    """Where a dataset's rows come from: `location` is a Hub name, a data directory or a
    save_to_disk directory (`saved`)."""

    text: str  # the data_path as the user wrote it, for messages
    location: str
    subset: str | None
    split: str | None  # None: a save_to_disk Dataset (no splits) or a DatasetDict's default
    saved: bool


def is_saved_dataset(path: str | Path) -> bool:
    """True for a directory written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    p = Path(path)
    return (p / "dataset_dict.json").is_file() or ((p / "dataset_info.json").is_file() and (p / "state.json").is_file())


def parse_dataset_path(data_path: Any) -> DatasetSource | None:
    """The dataset a data_path names, or None for a JSONL file or shard directory (or a list)."""
    if not isinstance(data_path, str | Path):
        return None
    text = str(data_path)
    if text.startswith(HF_PREFIX):
        rest = text[len(HF_PREFIX):]
        name, at, split = rest.rpartition("@") if "@" in rest else (rest, "", "")
        if is_saved_dataset(name):
            return DatasetSource(text, name, None, split or None, saved=True)
        name, _, subset = name.partition(":")
        if not name or (at and not split):
            raise ValueError(f"data_path {text!r} names no dataset; write hf:NAME, hf:NAME@SPLIT or "
                             "hf:NAME:SUBSET@SPLIT (e.g. hf:openai/gsm8k:main@train)")
        return DatasetSource(text, name, subset or None, split or DEFAULT_SPLIT, saved=False)
    if is_saved_dataset(text):
        return DatasetSource(text, text, None, None, saved=True)
    base, at, split = text.rpartition("@")
    if at and split and is_saved_dataset(base):
        return DatasetSource(text, base, None, split, saved=True)
    return None


def _datasets_module() -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError("reading a data_path that names a dataset (hf:NAME or a save_to_disk directory) needs "
                         "the datasets package: pip install datasets (or give a JSONL file)") from None
    return datasets


def load_dataset_rows(source: DatasetSource) -> Any:
    """The `datasets.Dataset` a source names (one split); errors name the data_path and the fix."""
    datasets = _datasets_module()
    if source.saved:
        ds = datasets.load_from_disk(source.location)
        if isinstance(ds, datasets.DatasetDict):
            split = source.split or DEFAULT_SPLIT
            if split not in ds:
                raise ValueError(f"data_path {source.text!r} holds the splits {sorted(ds)}, not {split!r}; "
                                 f"name one as {source.location}@SPLIT")
            return ds[split]
        if source.split is not None:
            raise ValueError(f"data_path {source.text!r}: {source.location} holds one Dataset without splits; "
                             f"drop '@{source.split}'")
        return ds
    try:
        ds = datasets.load_dataset(source.location, source.subset, split=source.split)
    except Exception as e:  # DatasetNotFoundError, ConnectionError, an unknown split: keep the cause, add the fix
        raise ValueError(f"data_path {source.text!r}: datasets.load_dataset({source.location!r}, "
                         f"{source.subset!r}, split={source.split!r}) failed ({type(e).__name__}: {e}); check the "
                         "name, subset and split, or download it while online (HF_HUB_OFFLINE=1 allows only "
                         "cached datasets)") from None
    if not isinstance(ds, datasets.Dataset):  # an IterableDataset or a dict: not what split= returns
        raise ValueError(f"data_path {source.text!r} did not load as one Dataset (got {type(ds).__name__}); "
                         "name a split with @SPLIT")
    return ds


def check_columns(columns: dict[str, str] | None, available: list[str], where: str) -> None:
    """Every column that `data_columns` names must be one of the dataset's columns."""
    for record_field, column in (columns or {}).items():
        if column not in available:
            close = difflib.get_close_matches(column, available, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"data_columns maps {record_field!r} to column {column!r}, but {where} has the columns "
                             f"{available}{hint}; fix data_columns")


def rename_columns(record: Any, columns: dict[str, str] | None) -> Any:
    """A row with its columns renamed to record fields (`data_columns`: record field -> column).
    Unmapped columns stay as they are (a prompt record keeps them as reward metadata)."""
    if not columns or not isinstance(record, dict):
        return record
    missing = [c for c in columns.values() if c not in record]
    if missing:
        raise RecordError(f"data_columns names column(s) {missing} that this record lacks; its fields are "
                          f"{sorted(record)}")
    renamed = {field: record[column] for field, column in columns.items()}
    return {**{k: v for k, v in record.items() if k not in columns.values()}, **renamed}


def iter_dataset(source: DatasetSource, columns: dict[str, str] | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ("data_path[row]", record) per row, columns already renamed to record fields."""
    ds = load_dataset_rows(source)
    check_columns(columns, list(ds.column_names), f"dataset {source.text!r}")
    for i, row in enumerate(ds):
        yield f"{source.text}[{i}]", rename_columns(dict(row), columns)
