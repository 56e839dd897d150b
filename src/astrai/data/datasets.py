"""Datasets and collate functions: records in a RecordStore -> training batches.

Sits between preprocessing (shards) or a small JSONL file (tokenised on the fly by the same
`encode_record`) and the trainer, which draws indices from the ResumableSampler. Batches are
dicts of tensors whose `labels` are already shifted: labels[b, t] is the target of position t,
-100 where no loss is taken. seq: windows over the token stream; sft: one chat per row, or
several packed into a row with position_ids restarting at 0 at each document; dpo: chosen and
rejected rows padded to one length; prompt: prompt ids plus messages, answer and metadata for
reward functions.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from astrai.data.hf_datasets import iter_dataset, parse_dataset_path, rename_columns
from astrai.data.records import (
    RECORD_KINDS,
    RecordError,
    RecordKindError,
    encode_record,
    iter_jsonl,
    record_form,
)
from astrai.data.shards import RecordStore
from astrai.data.tokenizer import Tokenizer


class Packer:
    """Greedy in-order packing of documents into rows of at most max_seq_len tokens.

    `add(length)` returns the finished row (a list of document indices) when the new document
    does not fit, and `flush()` the last row. preprocess --pack and sft datasets with pack=True
    both use it, so packed shards and packing on the fly give the same rows.
    """

    def __init__(self, max_seq_len: int):
        self.max_seq_len = max_seq_len
        self.row: list[int] = []
        self.used = 0
        self.count = 0

    def add(self, length: int) -> list[int] | None:
        index, self.count = self.count, self.count + 1
        done = None
        if self.row and self.used + length > self.max_seq_len:
            done, self.row, self.used = self.row, [], 0
        self.row.append(index)
        self.used += length
        return done

    def flush(self) -> list[int] | None:
        done, self.row, self.used = self.row or None, [], 0
        return done


def pack_rows(lengths: Iterable[int], max_seq_len: int) -> list[list[int]]:
    packer, rows = Packer(max_seq_len), []
    for length in lengths:
        if (row := packer.add(int(length))) is not None:
            rows.append(row)
    if (row := packer.flush()) is not None:
        rows.append(row)
    return rows


def document_positions(lengths: Iterable[int]) -> np.ndarray:
    """position_ids for documents back to back: 0..len-1 per document (resets mark starts)."""
    return np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])


def shifted_labels(ids: np.ndarray, mask: np.ndarray | None, position_ids: np.ndarray) -> np.ndarray:
    """labels[t] = ids[t+1] where mask[t+1] is set and t+1 does not start a new document."""
    ids = np.asarray(ids, dtype=np.int64)  # stored ids may be uint16, where -100 would wrap
    labels = np.full(len(ids), -100, dtype=np.int64)
    keep = position_ids[1:] != 0
    if mask is not None:
        keep &= mask[1:].astype(bool)
    labels[:-1] = np.where(keep, ids[1:], -100)
    return labels


def _row(ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.as_tensor(ids.astype(np.int64)), "labels": torch.as_tensor(labels),
            "position_ids": torch.as_tensor(position_ids.astype(np.int64))}


def pad_rows(rows: list[dict[str, torch.Tensor]], pad_id: int, length: int | None = None,
             prefix: str = "") -> dict[str, torch.Tensor]:
    """Right-pad rows to one length: pad ids, -100 labels, attention_mask 0, positions counting on."""
    length = length or max(len(r["input_ids"]) for r in rows)
    B = len(rows)
    input_ids = torch.full((B, length), pad_id, dtype=torch.long)  # (B, T)
    labels = torch.full((B, length), -100, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((B, length), dtype=torch.long)  # (B, T)
    # Padding continues the last position instead of restarting at 0, which would read as a
    # new document start.
    position_ids = torch.arange(length).repeat(B, 1)  # (B, T)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[b, :n], labels[b, :n], attention_mask[b, :n] = r["input_ids"], r["labels"], 1
        position_ids[b, :n] = r["position_ids"]
        position_ids[b, n:] = torch.arange(1, length - n + 1) + (r["position_ids"][-1] if n else -1)
    return {f"{prefix}input_ids": input_ids, f"{prefix}labels": labels,
            f"{prefix}position_ids": position_ids, f"{prefix}attention_mask": attention_mask}


class SeqDataset(Dataset):
    """Windows of max_seq_len + 1 tokens over each shard's token stream, every `stride` tokens.

    With pack=True positions restart after each eos, so documents do not attend to each other
    and the token after an eos (the next document's start) is not a target.
    """

    def __init__(self, store: RecordStore, max_seq_len: int, stride: int | None = None, pack: bool = False,
                 eos_token_id: int | None = None, pad_token_id: int = 0):
        self.streams = store.streams("input_ids")
        self.max_seq_len, self.stride = max_seq_len, stride or max_seq_len
        if self.stride <= 0:
            raise ValueError(f"stride must be positive, got {self.stride}")
        self.pack, self.eos_token_id, self.pad_token_id = pack, eos_token_id, pad_token_id
        counts = [max(0, (len(s) - max_seq_len - 1) // self.stride + 1) for s in self.streams]
        self._starts = np.cumsum([0] + counts)
        if self._starts[-1] == 0:
            total = sum(len(s) for s in self.streams)
            raise ValueError(f"seq data has {total} tokens, fewer than max_seq_len + 1 = {max_seq_len + 1} "
                             "needed for one window; add data or lower max_seq_len")

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard = int(np.searchsorted(self._starts, i, side="right") - 1)
        start = (i - int(self._starts[shard])) * self.stride
        window = np.asarray(self.streams[shard][start:start + self.max_seq_len + 1]).astype(np.int64)
        ids = window[:-1]
        if self.pack and self.eos_token_id is not None:
            # Position counts restart after every eos: cumulative count of tokens since the last one.
            starts = np.zeros(len(window), dtype=bool)
            starts[0] = True
            starts[1:] = window[:-1] == self.eos_token_id
            doc = np.cumsum(starts) - 1
            first = np.flatnonzero(starts)
            position_ids = np.arange(len(window)) - first[doc]
            labels = np.where(position_ids[1:] != 0, window[1:], -100)
            position_ids = position_ids[:-1]
        else:
            position_ids = np.arange(len(ids))
            labels = window[1:]
        return _row(ids, labels, position_ids)

    def collate(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_rows(samples, self.pad_token_id)

    def lengths(self) -> np.ndarray:
        """Tokens of every sample (all windows are max_seq_len long)."""
        return np.full(len(self), self.max_seq_len, dtype=np.int64)


class SFTDataset(Dataset):
    """Chats with loss masks, one per row (padded in collate) or packed into rows of max_seq_len."""

    def __init__(self, store: RecordStore, max_seq_len: int, pack: bool = False, pad_token_id: int = 0):
        self.store, self.max_seq_len, self.pad_token_id = store, max_seq_len, pad_token_id
        self.prepacked = "position_ids" in store.keys()
        lengths = store.lengths("input_ids")
        if len(lengths) and lengths.max() > max_seq_len:
            raise ValueError(f"sft data has rows of {int(lengths.max())} tokens but max_seq_len is {max_seq_len}; "
                             "preprocess again with this --max_seq_len or raise max_seq_len")
        self.rows = None if self.prepacked or not pack else pack_rows(lengths, max_seq_len)

    def __len__(self) -> int:
        return self.store.num_records if self.rows is None else len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.rows is None:
            ids, mask = self.store.get("input_ids", i), self.store.get("loss_mask", i)
            positions = self.store.get("position_ids", i) if self.prepacked else np.arange(len(ids))
        else:
            docs = self.rows[i]
            ids = np.concatenate([self.store.get("input_ids", d) for d in docs])
            mask = np.concatenate([self.store.get("loss_mask", d) for d in docs])
            positions = document_positions(len(self.store.get("input_ids", d)) for d in docs)
        return _row(ids, shifted_labels(ids, mask, positions), positions)

    def collate(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_rows(samples, self.pad_token_id)

    def lengths(self) -> np.ndarray:
        """Tokens of every sample (a packed row: the sum of its documents)."""
        lengths = self.store.lengths("input_ids")
        return lengths if self.rows is None else np.array([int(lengths[r].sum()) for r in self.rows], dtype=np.int64)


class DPODataset(Dataset):
    """Chosen and rejected chats of one prompt; loss masks cover the replies only."""

    def __init__(self, store: RecordStore, max_seq_len: int, pad_token_id: int = 0):
        self.store, self.max_seq_len, self.pad_token_id = store, max_seq_len, pad_token_id

    def __len__(self) -> int:
        return self.store.num_records

    def __getitem__(self, i: int) -> dict[str, Any]:
        out = {}
        for side in ("chosen", "rejected"):
            ids = self.store.get(f"{side}_input_ids", i)
            positions = np.arange(len(ids))
            out[side] = _row(ids, shifted_labels(ids, self.store.get(f"{side}_loss_mask", i), positions),
                             positions)
        if "record_json" in self.store.keys():  # shards written before margins were stored have none
            side = json.loads(self.store.get("record_json", i).tobytes().decode("utf-8"))
            out["margin"] = torch.tensor(float(side["margin"]))
        return out

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        # One length for both sides, so the trainer can run them as one concatenated batch.
        length = max(len(s[side]["input_ids"]) for s in samples for side in ("chosen", "rejected"))
        batch = pad_rows([s["chosen"] for s in samples], self.pad_token_id, length, "chosen_")
        batch.update(pad_rows([s["rejected"] for s in samples], self.pad_token_id, length, "rejected_"))
        if all("margin" in s for s in samples):
            batch["margin"] = torch.stack([s["margin"] for s in samples])  # (B,)
        return batch

    def lengths(self) -> np.ndarray:
        """Padded length of every pair: the longer of its two sides."""
        return np.maximum(self.store.lengths("chosen_input_ids"), self.store.lengths("rejected_input_ids"))


class PromptDataset(Dataset):
    """Prompts for online RL: prompt ids plus messages, reference answer and metadata."""

    def __init__(self, store: RecordStore):
        self.store = store

    def __len__(self) -> int:
        return self.store.num_records

    def __getitem__(self, i: int) -> dict[str, Any]:
        side = json.loads(self.store.get("record_json", i).tobytes().decode("utf-8"))
        return {"prompt_ids": [int(t) for t in self.store.get("prompt_ids", i)], **side}

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
        return {key: [s[key] for s in samples] for key in ("prompt_ids", "messages", "answer", "metadata")}


class RolloutDataset(Dataset):
    """Scored samples for offline GRPO: one item per prompt, all its responses and rewards."""

    def __init__(self, store: RecordStore, pad_token_id: int = 0):
        self.store, self.pad_token_id = store, pad_token_id

    def __len__(self) -> int:
        return self.store.num_records

    def __getitem__(self, i: int) -> dict[str, Any]:
        side = json.loads(self.store.get("record_json", i).tobytes().decode("utf-8"))
        prompt = np.asarray(self.store.get("prompt_ids", i), dtype=np.int64)
        flat = np.asarray(self.store.get("response_ids", i), dtype=np.int64)
        cuts = np.cumsum([0, *side["lengths"]])
        return {"prompt_ids": prompt, "responses": [flat[a:b] for a, b in zip(cuts[:-1], cuts[1:])],
                "rewards": side["rewards"], "logprobs": side["logprobs"]}

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Every response a row (prompt + response, right-padded); labels only on response tokens;
        old_logps aligned with the labels (NaN where a record gave none); rewards and group ids per row."""
        rows, logps, rewards, groups = [], [], [], []
        for g, s in enumerate(samples):
            P = len(s["prompt_ids"])
            for j, response in enumerate(s["responses"]):
                ids = np.concatenate([s["prompt_ids"], response])
                mask = np.concatenate([np.zeros(P, dtype=np.int64), np.ones(len(response), dtype=np.int64)])
                rows.append(_row(ids, shifted_labels(ids, mask, np.arange(len(ids))), np.arange(len(ids))))
                lp = np.full(len(ids), np.nan, dtype=np.float32)
                if s["logprobs"] is not None:
                    lp[P - 1:P - 1 + len(response)] = s["logprobs"][j]
                logps.append(torch.as_tensor(lp))
                rewards.append(s["rewards"][j])
                groups.append(g)
        batch = pad_rows(rows, self.pad_token_id)
        T = batch["input_ids"].size(1)
        batch["old_logps"] = torch.stack([torch.nn.functional.pad(x, (0, T - len(x)), value=float("nan"))
                                          for x in logps])
        batch["rewards"] = torch.tensor(rewards, dtype=torch.float32)
        batch["group_ids"] = torch.tensor(groups, dtype=torch.long)
        return batch


KIND_CHECK_RECORDS = 20  # failed records in a row, none usable, after which a file of another kind is named


def encode_jsonl(paths: list[Path], kind: str, tokenizer: Tokenizer, max_seq_len: int,
                 truncation: str = "keep_start", strict: bool = False,
                 columns: dict[str, str] | None = None) -> RecordStore:
    """Tokenise small JSONL files in memory; bad records are skipped with a warning (or raise)."""
    return encode_rows(iter_jsonl(paths), ", ".join(str(p) for p in paths), kind, tokenizer, max_seq_len,
                       truncation, strict, columns)


def encode_rows(rows: Iterable[tuple[str, Any]], names: str, kind: str, tokenizer: Tokenizer, max_seq_len: int,
                truncation: str = "keep_start", strict: bool = False,
                columns: dict[str, str] | None = None) -> RecordStore:
    """("where", record) rows (JSONL lines, dataset rows) -> an in-memory store; each record's
    columns renamed by `columns` first (record field -> column), bad ones skipped and counted."""
    records, bad, forms = [], [], []
    for where, record in rows:
        try:
            if isinstance(record, RecordError):
                raise record
            record = rename_columns(record, columns)
            records.append(encode_record(record, kind, tokenizer, max_seq_len, truncation))
        except RecordError as e:
            if strict:
                raise RecordError(f"{where}: {e}") from e
            bad.append(f"{where}: {e}")
            if not records:  # only failures so far: records of another kind? Said after a few, not thousands
                forms.append(record_form(record))
                if len(forms) == KIND_CHECK_RECORDS:
                    _check_kind(forms, kind, names)
    if not records:
        _check_kind(forms, kind, names)
    if bad:
        print(f"warning: skipped {len(bad)} bad record(s); first: {'; '.join(bad[:3])}", file=sys.stderr)
    if not records:
        raise ValueError(f"no usable {kind} records in {names}" + (f" ({len(bad)} bad)" if bad else
                                                                         " (empty input)"))
    return RecordStore.from_records(records, tokenizer.vocab_size, {"train_type": kind})


def _check_kind(forms: list[str | None], kind: str, names: str) -> None:
    """Raise RecordKindError when every one of the (failed) records has the fields of one other kind."""
    if forms and len(set(forms)) == 1 and forms[0] not in (None, kind):
        raise RecordKindError(forms[0], kind, names, len(forms))


def _open_store(kind: str, data_path: str | Path | list, tokenizer: Tokenizer | None, max_seq_len: int,
                truncation: str, columns: dict[str, str] | None = None) -> RecordStore:
    source = parse_dataset_path(data_path)
    if source is not None:  # a `datasets` dataset: rows -> the same record checks as JSONL
        if tokenizer is None:
            raise ValueError(f"reading dataset '{source.text}' needs a tokenizer; set tokenizer_path")
        return encode_rows(iter_dataset(source, columns), source.text, kind, tokenizer, max_seq_len, truncation)
    paths = [Path(p) for p in (data_path if isinstance(data_path, list | tuple) else [data_path])]
    if len(paths) == 1 and paths[0].is_dir():
        if columns:
            raise ValueError(f"data_columns is set but '{paths[0]}' is a preprocessed shard dir (already "
                             "tokenised); data_columns applies to JSONL files and datasets: drop it")
        store = RecordStore.open(paths[0])
        found = store.meta.get("train_type")
        if found != kind:
            raise ValueError(f"'{paths[0]}' was preprocessed for train_type '{found}', not '{kind}'; "
                             f"re-run `astrai preprocess --train_type {kind}`")
        if tokenizer is not None and store.meta.get("vocab_size", tokenizer.vocab_size) != tokenizer.vocab_size:
            raise ValueError(f"'{paths[0]}' was tokenised with vocab_size {store.meta['vocab_size']} but the "
                             f"tokenizer has {tokenizer.vocab_size}; preprocess again with this tokenizer")
        return store
    if tokenizer is None:
        raise ValueError(f"reading '{paths[0]}' needs a tokenizer; set tokenizer_path")
    return encode_jsonl(paths, kind, tokenizer, max_seq_len, truncation, columns=columns)


def build_dataset(kind: str, data_path: str | Path | list, tokenizer: Tokenizer | None, max_seq_len: int,
                  pack: bool = False, stride: int | None = None, truncation: str = "keep_start",
                  columns: dict[str, str] | None = None) -> Dataset:
    """A dataset of one record kind (seq | sft | dpo | prompt | rollout) from JSONL, shards or a
    `datasets` dataset (hf_datasets.py); `columns` renames record fields (field -> column)."""
    if kind not in RECORD_KINDS:
        raise ValueError(f"unknown record kind '{kind}'; expected one of {', '.join(RECORD_KINDS)}")
    store = _open_store(kind, data_path, tokenizer, max_seq_len, truncation, columns)
    pad_id = _pad_id(tokenizer, store)
    if kind == "seq":
        eos = tokenizer.eos_token_id if tokenizer is not None else store.meta.get("eos_token_id")
        return SeqDataset(store, max_seq_len, stride, pack, eos, pad_id)
    if kind == "sft":
        return SFTDataset(store, max_seq_len, pack, pad_id)
    if kind == "dpo":
        return DPODataset(store, max_seq_len, pad_id)
    if kind == "rollout":
        return RolloutDataset(store, pad_id)
    return PromptDataset(store)


def _pad_id(tokenizer: Tokenizer | None, store: RecordStore) -> int:
    if tokenizer is not None:
        for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if candidate is not None:
                return candidate
        return 0
    return int(store.meta.get("pad_token_id") or 0)
