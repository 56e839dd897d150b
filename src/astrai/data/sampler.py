"""Deterministic, resumable, rank-sharded sampler: the order in which the trainer reads samples.

The global order of an epoch is a permutation drawn from (seed, epoch), padded by wrapping
around so that every rank gets the same number of samples (so DDP ranks step in lockstep).
Rank r reads global positions r, r + world_size, ... A run that stopped after `consumed`
global samples resumes at exactly the next position, so an interrupted run sees the same
samples in the same order as an uninterrupted one. The trainer owns the consumed count and
passes it in with `set_consumed`; iterating also advances it for single-process use.

With `lengths` the order is grouped by length: the permutation is cut into mega-batches of
`GROUP_BATCHES` global batches (`group_size` samples each, all ranks), and each mega-batch is
sorted longest first, so that a batch holds samples of similar length and pads little. The
grouped order is still a pure function of (seed, epoch), hence resumable.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

GROUP_BATCHES = 64  # global batches per length-sorted mega-batch


class ResumableSampler:
    """Yields this rank's dataset indices for one epoch, from `consumed_samples` onwards."""

    def __init__(self, num_samples: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, drop_last: bool = False, lengths: Sequence[int] | None = None,
                 group_size: int = 1):
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}; the dataset is empty")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if drop_last and num_samples < world_size:
            raise ValueError(f"drop_last with {num_samples} samples and world_size {world_size} leaves no data")
        self.num_samples = num_samples
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        if lengths is not None and len(lengths) != num_samples:
            raise ValueError(f"lengths has {len(lengths)} entries for {num_samples} samples")
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.group_size = max(1, group_size)
        self.epoch = 0
        self.consumed_samples = 0

    @property
    def total_size(self) -> int:
        """Global samples per epoch (all ranks), after padding or dropping to a multiple of world_size."""
        if self.drop_last:
            return self.num_samples // self.world_size * self.world_size
        return math.ceil(self.num_samples / self.world_size) * self.world_size

    def __len__(self) -> int:
        """This rank's samples per epoch (not counting what was already consumed)."""
        return self.total_size // self.world_size

    def set_epoch(self, epoch: int) -> None:
        # Re-setting the current epoch (e.g. right after load_state_dict) keeps the position.
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed_samples = 0

    def set_consumed(self, consumed_samples: int) -> None:
        if not 0 <= consumed_samples <= self.total_size:
            raise ValueError(f"consumed_samples {consumed_samples} is outside this epoch's 0..{self.total_size}")
        self.consumed_samples = consumed_samples

    def global_order(self) -> list[int]:
        """The epoch's global order of dataset indices, padded or cut to total_size."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        total = self.total_size
        while len(order) < total:  # wrap around: a few samples repeat so all ranks get the same count
            order += order[: total - len(order)]
        order = order[:total]
        if self.lengths is not None:
            mega = self.group_size * GROUP_BATCHES
            lengths = self.lengths
            order = [i for start in range(0, total, mega)
                     for i in sorted(order[start:start + mega], key=lambda i: -lengths[i])]
        return order

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        # First position at or after `consumed` that belongs to this rank.
        start = self.consumed_samples + (self.rank - self.consumed_samples) % self.world_size
        for position in range(start, self.total_size, self.world_size):
            # Assumes ranks advance in lockstep: one sample here means world_size globally.
            self.consumed_samples = position - self.rank + self.world_size
            yield order[position]

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "seed": self.seed, "epoch": self.epoch,
                "consumed_samples": self.consumed_samples, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "world_size": self.world_size,
                "group_by_length": self.lengths is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "resume with the same data and seed, or start a fresh run")
        if state.get("group_by_length", False) != (self.lengths is not None):
            raise ValueError(
                f"sampler state has group_by_length={state.get('group_by_length', False)} but this run has "
                f"{self.lengths is not None}; resume with the same group_by_length setting, or start a fresh run")
        self.epoch = int(state["epoch"])
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        self.set_consumed(int(state["consumed_samples"]))
