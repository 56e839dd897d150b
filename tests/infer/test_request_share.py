"""One request may not hold the KV pool from the others (scheduler.py's `max_request_kv_share`).

A request with many long samples fills the pool; a small request that arrives later must still
be admitted within a bounded number of engine steps and finish while the big one runs. Driven
by `engine.step()` calls, never by time; the same scenario without the cap starves the small
request, which shows the test can fail."""

from __future__ import annotations

import pytest

from astrai.infer.block_manager import BlockManager
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.infer.scheduler import Scheduler, Sequence
from tests.infer.conftest import random_prompts, tiny_model

BLOCK_SIZE = 16
BIG = SamplingParams(n=8, max_tokens=200, ignore_eos=True, temperature=1.0, seed=0)  # 8 x 204 tokens
SMALL = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
# the small request waits for one block boundary of the big one's sequences, then decodes
STEP_BOUND = 2 * BLOCK_SIZE + SMALL.max_tokens


def make_engine(share: float) -> LLMEngine:
    # fixed budgets (no timing probe) so every run schedules the same way
    return LLMEngine(tiny_model(), None, kv_cache_tokens=512, block_size=BLOCK_SIZE, max_model_len=256,
                     max_num_seqs=16, max_num_batched_tokens=256, long_prefill_token_threshold=0,
                     max_request_kv_share=share)


def fill_pool_with_big(engine: LLMEngine) -> None:
    """Step the big request alone until it holds every block (it may: nobody else is there)."""
    prompt_big, = random_prompts([4], seed=1)
    engine.add_request("big", prompt_big, BIG)
    for _ in range(1000):  # guard against a hang only
        engine.step()
        if engine.block_manager.num_free_blocks == 0:
            return
    raise AssertionError("the big request never filled the pool")


def steps_until_small_finishes(engine: LLMEngine, limit: int) -> int | None:
    prompt_small, = random_prompts([4], seed=2)
    engine.add_request("small", prompt_small, SMALL)
    for num_steps in range(1, limit + 1):
        outputs = {out.request_id: out for out in engine.step()}
        if "small" in outputs and outputs["small"].finished:
            assert outputs["small"].outputs[0].finish_reason == "length"
            assert len(outputs["small"].outputs[0].token_ids) == SMALL.max_tokens
            return num_steps
    return None


def test_a_later_small_request_finishes_while_a_huge_one_runs():
    engine = make_engine(share=0.5)
    fill_pool_with_big(engine)  # work conserving: alone, a request may use the whole pool
    num_steps = steps_until_small_finishes(engine, STEP_BOUND)
    assert num_steps is not None, f"the small request did not finish within {STEP_BOUND} steps"
    assert engine.has_unfinished_requests() and "big" in engine._requests  # still running
    bm = engine.block_manager
    assert bm.num_request_blocks("big") <= engine.scheduler.max_request_blocks  # it gave way to its share
    # the big request still finishes, every sample in full
    big = {}
    for _ in range(5000):  # guard only
        for out in engine.step():
            big[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert [len(c.token_ids) for c in big["big"].outputs] == [BIG.max_tokens] * BIG.n
    assert bm.num_free_blocks == bm.num_blocks and bm.num_request_blocks("big") == 0


def test_without_the_cap_the_small_request_starves():
    engine = make_engine(share=1.0)
    fill_pool_with_big(engine)
    assert steps_until_small_finishes(engine, STEP_BOUND) is None


def test_request_blocks_count_shared_prompt_blocks_once():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, 8, 64)
    parent = Sequence(0, "r", 0, list(range(10)), SamplingParams(n=3))
    sched.add(parent)
    out = sched.schedule()
    assert out.scheduled == [(parent, 10)] and bm.num_request_blocks("r") == 3
    parent.num_computed_tokens = 10
    children = [Sequence(i, "r", i, list(range(10)), SamplingParams(n=3)) for i in (1, 2)]
    sched.add_forks(parent, children)
    assert bm.num_request_blocks("r") == 3  # the 3 prompt blocks, shared by 3 samples
    for s in (parent, *children):
        s.append_token(7)
    sched.schedule()  # the shared last block is copied for the first two writers; the third keeps it
    assert bm.num_request_blocks("r") == 5 and len(bm.pending_copies) == 2
    for s in (parent, *children):
        sched.finish(s)
    assert bm.num_request_blocks("r") == 0 and bm.num_free_blocks == bm.num_blocks


def test_share_must_be_a_fraction():
    with pytest.raises(ValueError, match="max_request_kv_share is 0"):
        Scheduler(BlockManager(8, 4), 8, 64, max_request_kv_share=0)
