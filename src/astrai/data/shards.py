"""Token shards on disk: a streaming writer and a memory-mapped record store.

`astrai preprocess` writes `DIR/shard_NNNNN/{meta.json, <key>.bin, <key>.offsets.bin}` plus
`DIR/dataset.json` (written last, so an interrupted run is never mistaken for a finished one).
Each key (`input_ids`, `loss_mask`, `chosen_input_ids`, `prompt_ids`, `record_json`, ...) is a
flat array of all records back to back and an int64 offsets array with num_records + 1
entries, so record i of key k is `data[k][off[k][i]:off[k][i + 1]]`. Token streams (seq) are
the same thing read whole. Datasets read a `RecordStore`, which is either these memory-mapped
shards or the same layout built in memory from a JSONL file, so both paths give one result.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import numpy as np

SHARD_FORMAT = "astrai-shards"
SHARD_VERSION = 1
_FLUSH_ITEMS = 1 << 20


def key_dtype(key: str, vocab_size: int) -> np.dtype:
    """Storage dtype of a key: masks and JSON bytes in uint8, positions in int32, ids in uint16/32."""
    if key.endswith("loss_mask") or key == "record_json":
        return np.dtype(np.uint8)
    if key.endswith("position_ids"):
        return np.dtype(np.int32)
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _KeyWriter:
    """Appends records of one key to `<key>.bin` and their boundaries to `<key>.offsets.bin`."""

    def __init__(self, shard_dir: Path, key: str, dtype: np.dtype):
        self.dtype = dtype
        self.data = (shard_dir / f"{key}.bin").open("wb")
        self.offsets = (shard_dir / f"{key}.offsets.bin").open("wb")
        self.num_items = 0
        self.pending: list[list[int]] = []
        self.pending_offsets: list[int] = [0]
        self.num_pending = 0

    def add(self, values: list[int]) -> None:
        self.pending.append(values)
        self.num_items += len(values)
        self.pending_offsets.append(self.num_items)
        self.num_pending += len(values) + 1
        if self.num_pending >= _FLUSH_ITEMS:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            flat = np.fromiter((v for rec in self.pending for v in rec), dtype=np.int64)
            self.data.write(flat.astype(self.dtype).tobytes())
        self.offsets.write(np.asarray(self.pending_offsets, dtype=np.int64).tobytes())
        self.pending, self.pending_offsets, self.num_pending = [], [], 0

    def close(self) -> None:
        self.flush()
        self.data.close()
        self.offsets.close()


class ShardWriter:
    """Streams encoded records into shards of at most ~max_shard_tokens tokens each."""

    def __init__(self, out_dir: str | Path, keys: list[str], vocab_size: int, meta: dict[str, Any],
                 max_shard_tokens: int = 1 << 28):
        self.out_dir = Path(out_dir)
        if (self.out_dir / "dataset.json").exists() or any(self.out_dir.glob("shard_*")):
            raise FileExistsError(f"output directory '{self.out_dir}' already holds shards; "
                                  "choose a new --out or delete it first")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.dtypes = {k: key_dtype(k, vocab_size) for k in keys}
        self.meta = meta
        self.max_shard_tokens = max_shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._writers: dict[str, _KeyWriter] | None = None
        self._records = 0

    def _open_shard(self) -> None:
        shard_dir = self.out_dir / f"shard_{len(self.shards):05d}"
        shard_dir.mkdir()
        self._writers = {k: _KeyWriter(shard_dir, k, dt) for k, dt in self.dtypes.items()}
        self._records = 0
        self.shards.append({"name": shard_dir.name})

    def _close_shard(self) -> None:
        if self._writers is None:
            return
        keys = {}
        for key, w in self._writers.items():
            w.close()
            keys[key] = {"dtype": w.dtype.name, "num_items": w.num_items}
        shard_meta = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "num_records": self._records,
                      "keys": keys, **self.meta}
        (self.out_dir / self.shards[-1]["name"] / "meta.json").write_text(json.dumps(shard_meta, indent=2) + "\n")
        self.shards[-1].update(num_records=self._records)
        self._writers = None

    def add(self, record: dict[str, list[int]]) -> None:
        if self._writers is None:
            self._open_shard()
        for key, writer in self._writers.items():
            writer.add(record[key])
        self._records += 1
        first = next(iter(self._writers.values()))
        if first.num_items >= self.max_shard_tokens:
            self._close_shard()

    def close(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Finish the last shard and write dataset.json (the completion marker)."""
        self._close_shard()
        info = {"format": SHARD_FORMAT, "version": SHARD_VERSION, **self.meta, **summary, "shards": self.shards}
        (self.out_dir / "dataset.json").write_text(json.dumps(info, indent=2) + "\n")
        return info


class RecordStore:
    """Records of several keys, each a flat array + offsets per shard (memory-mapped or in memory)."""

    def __init__(self, shards: list[dict[str, tuple[np.ndarray, np.ndarray]]], meta: dict[str, Any]):
        self.shards = shards
        self.meta = meta
        counts = [len(next(iter(s.values()))[1]) - 1 for s in shards]
        self._starts = np.cumsum([0] + counts).tolist()
        self.num_records = self._starts[-1]

    @classmethod
    def open(cls, path: str | Path) -> RecordStore:
        path = Path(path)
        info_path = path / "dataset.json"
        if not info_path.is_file():
            hint = "preprocess was interrupted; re-run it" if any(path.glob("shard_*")) else \
                "run `astrai preprocess` first or pass a .jsonl file"
            raise FileNotFoundError(f"'{path}' is not a finished shard directory (no dataset.json); {hint}")
        info = json.loads(info_path.read_text())
        if info.get("format") != SHARD_FORMAT:
            raise ValueError(f"'{info_path}' has format {info.get('format')!r}, expected '{SHARD_FORMAT}'")
        shards = []
        for shard in info["shards"]:
            shard_dir = path / shard["name"]
            meta = json.loads((shard_dir / "meta.json").read_text())
            arrays = {}
            for key, spec in meta["keys"].items():
                data = np.memmap(shard_dir / f"{key}.bin", dtype=spec["dtype"], mode="r") \
                    if spec["num_items"] else np.zeros(0, dtype=spec["dtype"])
                offsets = np.memmap(shard_dir / f"{key}.offsets.bin", dtype=np.int64, mode="r")
                arrays[key] = (data, offsets)
            shards.append(arrays)
        return cls(shards, info)

    @classmethod
    def from_records(cls, records: list[dict[str, list[int]]], vocab_size: int,
                     meta: dict[str, Any]) -> RecordStore:
        """The same layout in memory (one shard), for JSONL files read without preprocessing."""
        if not records:
            return cls([], meta)
        arrays = {}
        for key in records[0]:
            lengths = [len(r[key]) for r in records]
            offsets = np.cumsum([0] + lengths, dtype=np.int64)
            flat = np.fromiter((v for r in records for v in r[key]), dtype=np.int64, count=int(offsets[-1]))
            arrays[key] = (flat.astype(key_dtype(key, vocab_size)), offsets)
        return cls([arrays], meta)

    def keys(self) -> list[str]:
        return list(self.shards[0]) if self.shards else []

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} is out of range for {self.num_records} records")
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def get(self, key: str, i: int) -> np.ndarray:
        shard, local = self._locate(i)
        data, offsets = self.shards[shard][key]
        return np.asarray(data[offsets[local]:offsets[local + 1]])

    def lengths(self, key: str) -> np.ndarray:
        """Length of every record of `key`, in record order."""
        if not self.shards:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.diff(np.asarray(s[key][1])) for s in self.shards])

    def streams(self, key: str) -> list[np.ndarray]:
        """Each shard's records of `key` back to back (the token stream of seq data)."""
        return [s[key][0] for s in self.shards]
