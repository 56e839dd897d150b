"""The paged KV pool: which physical cache blocks each sequence owns, and which it can share.

The KV cache is `num_blocks` blocks of `block_size` token slots (allocated by the runner).
The scheduler asks this module for room before it schedules tokens; the runner reads each
sequence's `block_table`. Blocks are reference counted: the n samples of one prompt share the
prompt's blocks after its single prefill, and a shared block is copied before anyone writes into
it (copy-on-write; the copies are queued in `pending_copies` for the runner). Full blocks are
also indexed by a chained hash of their tokens rooted in the policy version, so a later prompt
with the same prefix under the same weights reuses their KV (prefix caching). Freed blocks that
carry a hash stay cached and are evicted least recently used first. Each block is also counted
once per request holding it (`num_request_blocks`: the distinct blocks a request's sequences
hold, shared prompt blocks once), which the scheduler reads to keep one request within its
share of the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

import torch


class BlockSequence(Protocol):
    """What the block manager reads and writes on a sequence (the engine's Sequence)."""

    token_ids: list[int]  # prompt + output
    num_computed_tokens: int  # tokens whose KV is in the cache
    block_table: list[int]  # physical block ids, in token order
    block_hashes: list[int]  # chained hashes of its computed full blocks, as committed
    # a `request_id` attribute, when present, groups sequences for num_request_blocks


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to rule out hash collisions


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Theoretical KV size of one cached token: keys and values of every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))  # stack, block 0 on top
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._hash_to_block: dict[int, int] = {}
        self.policy_version = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write, for the runner
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found cached
        self._request_blocks: dict[Hashable, dict[int, int]] = {}  # request -> {block: its sequences holding it}

    # -- accounting -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_prefix_hits / self.num_prefix_queries if self.num_prefix_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_request_blocks(self, request_id: Hashable) -> int:
        """Distinct blocks the sequences of one request hold (a block its n samples share counts once)."""
        return len(self._request_blocks.get(request_id, ()))

    def num_new_request_blocks(self, seq: BlockSequence, num_tokens: int, prefix_hits: list[int] = ()) -> int:
        """How many blocks `allocate(seq, num_tokens, prefix_hits)` would add to its request's count."""
        held = self._request_blocks.get(getattr(seq, "request_id", None), {})
        table = seq.block_table or prefix_hits
        needed = max(0, self.num_blocks_for(num_tokens) - len(table))
        needed += len(self._shared_blocks_to_write(seq, num_tokens))
        return needed + sum(1 for b in prefix_hits if b not in held)

    def _own(self, seq: BlockSequence, block_id: int) -> None:
        owner = getattr(seq, "request_id", None)
        if owner is not None:
            held = self._request_blocks.setdefault(owner, {})
            held[block_id] = held.get(block_id, 0) + 1

    def _disown(self, seq: BlockSequence, block_id: int) -> None:
        held = self._request_blocks.get(getattr(seq, "request_id", None))
        if held is None:
            return
        count = held.pop(block_id, 0) - 1
        if count > 0:
            held[block_id] = count
        elif not held:
            del self._request_blocks[seq.request_id]

    # -- prefix cache ---------------------------------------------------------------------------
    def _root_hash(self) -> int:
        return hash(("astrai-kv", self.policy_version))

    def _extend_hashes(self, hashes: list[int], token_ids: list[int], num_tokens: int) -> None:
        """Chain hashes onto `hashes` for every full block among the first num_tokens tokens."""
        bs = self.block_size
        prev = hashes[-1] if hashes else self._root_hash()
        for i in range(len(hashes), num_tokens // bs):
            prev = hash((prev, tuple(token_ids[i * bs : (i + 1) * bs])))
            hashes.append(prev)

    def match_prefix(self, seq: BlockSequence) -> list[int]:
        """Cached blocks holding a prefix of seq's tokens. The last token is never matched, since
        its logits must be computed; nothing is claimed until `allocate` takes the blocks."""
        if not self.enable_prefix_caching:
            return []
        hashes: list[int] = []
        self._extend_hashes(hashes, seq.token_ids, len(seq.token_ids) - 1)
        bs = self.block_size
        hits: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self._hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    def commit(self, seq: BlockSequence) -> None:
        """Index the blocks that the last step filled, so later prompts can reuse them."""
        if not self.enable_prefix_caching or seq.num_computed_tokens < (len(seq.block_hashes) + 1) * self.block_size:
            return  # no block filled since the last commit (most decode steps)
        start = len(seq.block_hashes)
        self._extend_hashes(seq.block_hashes, seq.token_ids, seq.num_computed_tokens)
        bs = self.block_size
        for i in range(start, len(seq.block_hashes)):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hashes[i]
            if block.hash is None and h not in self._hash_to_block:
                block.hash = h
                block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                self._hash_to_block[h] = block.block_id

    def set_policy_version(self, version: int) -> None:
        """New weights: forget every cached block so no KV of the old weights is reused."""
        self.policy_version = version
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Drop every hash; free cached blocks become plain free blocks."""
        for block_id in self._hash_to_block.values():
            self.blocks[block_id].hash = self.blocks[block_id].token_ids = None
        self._hash_to_block.clear()
        self._free_uncached.extend(reversed(self._free_cached))
        self._free_cached.clear()

    # -- allocation -----------------------------------------------------------------------------
    def num_new_blocks_needed(self, seq: BlockSequence, num_tokens: int, prefix_hits: list[int] = ()) -> int:
        """Free blocks that `allocate(seq, num_tokens, prefix_hits)` would consume."""
        table = seq.block_table or prefix_hits
        needed = max(0, self.num_blocks_for(num_tokens) - len(table))
        needed += len(self._shared_blocks_to_write(seq, num_tokens))
        # hits sitting in the free cache leave the free pool when claimed
        needed += sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)
        return needed

    def needs_allocation(self, seq: BlockSequence, num_tokens: int) -> bool:
        """False when seq's blocks already hold num_tokens and it alone owns those it writes
        (the common decode step, checked without building lists)."""
        table, bs = seq.block_table, self.block_size
        if num_tokens > len(table) * bs:
            return True
        first = seq.num_computed_tokens // bs
        if first == len(table) - 1:  # a decode writes into the last block only
            return self.blocks[table[first]].ref_count > 1
        return any(self.blocks[table[i]].ref_count > 1 for i in range(seq.num_computed_tokens // bs, len(table)))

    def can_allocate(self, seq: BlockSequence, num_tokens: int, prefix_hits: list[int] = ()) -> bool:
        return self.num_new_blocks_needed(seq, num_tokens, prefix_hits) <= self.num_free_blocks

    def allocate(self, seq: BlockSequence, num_tokens: int, prefix_hits: list[int] = ()) -> None:
        """Make seq's block table cover num_tokens tokens, claiming `prefix_hits` first (only for
        a sequence without blocks) and copying any shared block its new tokens will write to.
        The caller checked `can_allocate`."""
        if prefix_hits:
            assert not seq.block_table, "prefix hits are only claimed by a sequence without blocks"
            for block_id in prefix_hits:
                self._claim(block_id)
                self._own(seq, block_id)
            seq.block_table = list(prefix_hits)
        for index in self._shared_blocks_to_write(seq, num_tokens):
            src = seq.block_table[index]
            dst = self._take_free_block()
            self.blocks[src].ref_count -= 1  # still held by its other owners
            self._disown(seq, src)
            self._own(seq, dst)
            seq.block_table[index] = dst
            self.pending_copies.append((src, dst))
        while len(seq.block_table) < self.num_blocks_for(num_tokens):
            block_id = self._take_free_block()
            self._own(seq, block_id)
            seq.block_table.append(block_id)

    def _shared_blocks_to_write(self, seq: BlockSequence, num_tokens: int) -> list[int]:
        """Indexes of table blocks with other owners that tokens num_computed..num_tokens write."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        last = min(len(seq.block_table), self.num_blocks_for(num_tokens))
        return [i for i in range(first, last) if self.blocks[seq.block_table[i]].ref_count > 1]

    def _claim(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.pop()
        elif self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            block = self.blocks[block_id]
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash = block.token_ids = None
        else:
            raise RuntimeError("KV block pool exhausted; the scheduler must check can_allocate first")
        self.blocks[block_id].ref_count = 1
        return block_id

    def fork(self, parent: BlockSequence, child: BlockSequence) -> None:
        """Let child share all of parent's blocks (the n samples of one prompt)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
            self._own(child, block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: BlockSequence) -> None:
        """Release seq's blocks. Tail blocks are freed first so they are also evicted first,
        keeping the more widely shared prefix blocks cached longer."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            self._disown(seq, block_id)
            if block.ref_count == 0:
                if block.hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached.append(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
