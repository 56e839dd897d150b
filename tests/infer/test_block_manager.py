"""The paged KV pool: ref counts, prefix hashing keyed by version, LRU eviction, copy-on-write."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from astrai.infer.block_manager import BlockManager, kv_bytes_per_token


@dataclass
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)


def prefill(bm: BlockManager, seq: Seq) -> list[int]:
    """Claim prefix hits, allocate the rest, 'compute' all tokens and index the full blocks."""
    hits = bm.match_prefix(seq)
    seq.num_computed_tokens = len(hits) * bm.block_size
    assert bm.can_allocate(seq, len(seq.token_ids), hits)
    bm.allocate(seq, len(seq.token_ids), hits)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.commit(seq)
    return hits


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, block_size=4)
    a, b = Seq(list(range(10))), Seq(list(range(100, 105)))
    prefill(bm, a)
    prefill(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 3
    assert not bm.can_allocate(Seq(list(range(200, 217))), 17)  # needs 5 blocks
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_prefix_hits_share_full_blocks_but_never_the_last_token():
    bm = BlockManager(16, block_size=4)
    a = Seq(list(range(12)))
    assert prefill(bm, a) == []
    b = Seq(list(range(10)) + [99, 98])  # shares two full blocks with a
    hits = prefill(bm, b)
    assert hits == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in hits] == [2, 2]
    c = Seq(list(range(12)))  # identical prompt: the last block holds the last token, recomputed
    assert prefill(bm, c) == a.block_table[:2]
    bm.record_prefix_lookup(12, 8)
    assert bm.prefix_cache_hit_rate == pytest.approx(8 / 12)


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    bm = BlockManager(4, block_size=2)
    a, b = Seq([1, 2, 3]), Seq([5, 6, 7])
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)  # a's hashed block [1, 2] is freed first, so it is the first to go
    bm.free(b)
    prefill(bm, Seq([9, 9, 9, 9, 9]))  # 3 blocks: 2 uncached free ones, then evicts a's block
    assert bm.match_prefix(Seq([1, 2, 3])) == []
    assert len(bm.match_prefix(Seq([5, 6, 7]))) == 1


def test_policy_version_bump_forgets_cached_prefixes():
    bm = BlockManager(8, block_size=2)
    a = Seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.free(a)
    assert len(bm.match_prefix(Seq([1, 2, 3, 4, 5]))) == 2
    bm.set_policy_version(1)
    assert bm.match_prefix(Seq([1, 2, 3, 4, 5])) == []
    assert bm.num_free_blocks == 8
    b = Seq([1, 2, 3, 4, 5])
    prefill(bm, b)  # indexed again, now under version 1
    assert len(bm.match_prefix(Seq([1, 2, 3, 4, 5]))) == 2


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    bm = BlockManager(8, block_size=4)
    parent = Seq([1, 2, 3, 4, 5, 6])  # one full block, one partial
    prefill(bm, parent)
    child = Seq(list(parent.token_ids))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    child.token_ids.append(7)  # the child writes position 6, inside the shared partial block
    assert bm.can_allocate(child, 7)
    bm.allocate(child, 7)
    assert child.block_table[0] == parent.block_table[0]
    assert child.block_table[1] != parent.block_table[1]
    assert bm.pending_copies == [(parent.block_table[1], child.block_table[1])]
    parent.token_ids.append(8)  # the last owner writes in place: no copy
    bm.allocate(parent, 7)
    assert len(bm.pending_copies) == 1
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_kv_bytes_per_token():
    import torch

    assert kv_bytes_per_token(2, 2, 16, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
