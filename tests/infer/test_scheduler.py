"""Continuous batching: token budget, chunked prefill, max_num_seqs, FCFS and preemption."""

from __future__ import annotations

import random

from astrai.infer.block_manager import BlockManager
from astrai.infer.sampling import SamplingParams
from astrai.infer.scheduler import Scheduler, Sequence


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=16, chunked=True):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs, budget, chunked), bm


def seq(i: int, length: int, **params) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(range(100 * i, 100 * i + length)), SamplingParams(**params))


def run(sched: Scheduler):
    """One step: schedule, pretend to compute, and append a token to finished prefills."""
    out = sched.schedule()
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(1)
    return out


def test_chunked_prefill_is_mixed_with_decodes_under_the_token_budget():
    sched, _ = make(budget=16)
    a, b = seq(1, 6), seq(2, 30)
    sched.add(a)
    sched.add(b)
    out = run(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 6), (2, 10)]
    out = run(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 1), (2, 15)]
    out = run(sched)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 1), (2, 5)]
    assert b.output_token_ids == [1]


def test_without_chunking_a_long_prompt_waits_for_a_whole_step():
    sched, _ = make(budget=16, chunked=False)
    a, b = seq(1, 6), seq(2, 12)
    sched.add(a)
    sched.add(b)
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 6)]  # 6 + 12 > 16
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 1), (2, 12)]


def test_max_num_seqs_counts_pending_samples_and_admission_is_fcfs():
    sched, _ = make(max_num_seqs=3)
    sched.add(seq(1, 4, n=2))
    sched.add(seq(2, 4, n=2))  # does not fit next to the first (2 + 2 > 3) ...
    sched.add(seq(3, 4))  # ... and blocks the later, smaller request (FCFS)
    assert [s.seq_id for s, _ in run(sched).scheduled] == [1]
    assert len(sched.waiting) == 2


def test_preemption_frees_the_latest_arrival_and_requeues_it_first():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(1, 7), seq(2, 7)  # 2 blocks each: the pool is full after both prefill
    sched.add(a)
    sched.add(b)
    run(sched)
    assert bm.num_free_blocks == 0
    run(sched)  # a's decode writes position 7 (block 2 still fits), b likewise
    out = run(sched)  # a needs a third block: b is preempted
    assert out.preempted == [b] and sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_table == []
    assert sched.num_preemptions == 1
    sched.finish(a)
    out = run(sched)  # b recomputes prompt + output in one go
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(2, 9)]
    sched.finish(b)
    assert bm.num_free_blocks == 4


def test_a_step_that_decodes_carries_at_most_one_long_prefill_chunk():
    bm = BlockManager(256, 4)
    sched = Scheduler(bm, 8, 64, long_prefill_token_threshold=10)
    a = seq(1, 5)
    sched.add(a)
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 5)]  # nothing decodes: whole budget
    b, c = seq(2, 25), seq(3, 7)
    sched.add(b)
    sched.add(c)
    # a decodes, so prefill gets 10 tokens in all: b's first chunk, c waits (FCFS)
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 1), (2, 10)]
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 1), (2, 10)]
    # b's last 5 tokens and c's first 5 share one chunk's worth
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 1), (2, 5), (3, 5)]
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 1), (2, 1), (3, 2)]


def test_without_decodes_prefill_fills_the_whole_budget():
    sched = Scheduler(BlockManager(256, 4), 8, 40, long_prefill_token_threshold=10)
    for i in (1, 2):
        sched.add(seq(i, 30))
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 30), (2, 10)]


def test_without_chunking_the_threshold_never_splits_a_prompt():
    sched = Scheduler(BlockManager(256, 4), 8, 64, enable_chunked_prefill=False, long_prefill_token_threshold=4)
    sched.add(seq(1, 5))
    run(sched)
    sched.add(seq(2, 20))
    assert [(s.seq_id, n) for s, n in run(sched).scheduled] == [(1, 1), (2, 20)]


def test_budget_and_chunk_bounds_hold_in_every_step_and_no_decode_is_skipped():
    # requests of random lengths arrive over time; every step stays within the token budget, a
    # step with decodes carries at most one chunk of prefill, and every decode runs every step
    gen = random.Random(0)
    budget, threshold, seats = 48, 12, 6
    sched = Scheduler(BlockManager(1024, 4), seats, budget, long_prefill_token_threshold=threshold)
    next_id, steps = 1, 0
    while steps < 300 and (next_id <= 40 or sched.running or sched.waiting):
        if next_id <= 40 and gen.random() < 0.3:
            sched.add(seq(next_id, gen.randint(1, 60)))
            next_id += 1
        decoding = {s.seq_id for s in sched.running if s.num_tokens - s.num_computed_tokens == 1}
        out = run(sched)
        steps += 1
        assert out.num_batched_tokens <= budget
        decodes = [s for s, n in out.scheduled if s.seq_id in decoding]
        prefill = sum(n for s, n in out.scheduled if s.seq_id not in decoding)
        assert {s.seq_id for s in decodes} == decoding  # budget >= seats + threshold: nobody waits
        if decoding:
            assert prefill <= threshold
        for s in list(sched.running):  # finish after 3 output tokens
            if len(s.output_token_ids) >= 3:
                sched.finish(s)
    assert next_id > 40 and not sched.running and not sched.waiting
