"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

The engine adds sequences to `waiting`; every step `schedule()` fills a token budget
(`max_num_batched_tokens`), first with the running sequences in arrival order (a decode costs
one token, an unfinished chunked prefill what is left of it), then with waiting sequences in
arrival order (FCFS: a sequence that does not fit blocks the ones behind it). Prefills longer
than the remaining budget are split into chunks over several steps, mixed with the decodes of
other sequences. A step that decodes carries at most `long_prefill_token_threshold` prefill
tokens in all (0: no such cap), so a running decode never waits behind more than one prefill
chunk of bounded cost; a step without decodes fills the whole budget with prefill. When the KV
pool runs out, a running sequence is preempted: its blocks are freed and it waits at the head
of the queue to be recomputed later (cheaply, when its blocks are still in the prefix cache).

One request may not crowd out the others (`max_request_kv_share`): while other requests run or
wait, the sequences of one request (its n samples) may together hold at most that share of the
pool's blocks (`BlockManager.num_request_blocks`, shared prompt blocks counted once). A request
at its share that needs another block preempts its own latest sequence instead of growing; its
waiting sequences are passed over, not blocking later requests; and when the pool runs out, the
victim is the latest sequence of a request over its share, else the latest arrival. Preemptions
of a request by its own share leave room, so they do not stop admissions. The cap is work
conserving: a request alone in the engine may use the whole pool, and a request's first
sequence always runs, so a single long sequence is never starved by it. With n = 64 and
max_tokens = 1000 on an 8,192-token pool, a later small request is admitted at the first
block boundary of the big request's sequences (at most `block_size` steps) and finishes while
the big one is still running. A sequence is never dropped here: it runs, waits, or the engine
finishes it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from astrai.infer.block_manager import BlockManager
from astrai.infer.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One token stream: a prompt and the output of one of its n samples."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        generator: torch.Generator | None = None,
        min_tokens_stop_ids: list[int] | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.params = params
        self.arrival_time = arrival_time
        self.generator = generator
        self.uniform_block: list[float] = []  # the seeded stream's numbers drawn ahead (the sampler's)
        self.min_tokens_stop_ids = min_tokens_stop_ids or []
        self.guide_state = params.guide.new_state() if params.guide is not None else None  # own matcher
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.token_ids = list(prompt_token_ids)  # prompt + output, what the model reads
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens: int | None = None  # prefix-cache hits when first scheduled
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_pending_forks = params.n - 1 if index == 0 else 0  # siblings made after prefill
        # outputs, filled by the engine
        self.logprobs: list = []
        self.raw_logprobs: list = []
        self.cumulative_logprob = 0.0
        self.routing: torch.Tensor | None = None  # record_routing: the experts of its computed tokens, at its end
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # prompt log-probs (index 0 only): None for the first token, then one dict per prompt token
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None and index == 0 else None
        self.prefix_offset = max(0, self.num_prompt_tokens - 5)  # incremental detokenisation
        self.read_offset = self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probs asked for and not all computed yet (its prefill must run in full)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # moved from waiting to running this step
    pool_full: bool = False  # a preemption for lack of free blocks (not for a request's share) happened


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        max_request_kv_share: float = 1.0,
    ) -> None:
        if not 0.0 < max_request_kv_share <= 1.0:
            raise ValueError(f"max_request_kv_share is {max_request_kv_share} but must be in (0, 1]: the share "
                             f"of the KV pool one request may hold while others wait (1.0 = no cap)")
        self.block_manager = block_manager
        # blocks one request may hold while others are present; at least one block
        self.max_request_blocks = max(1, int(max_request_kv_share * block_manager.num_blocks))
        self._has_rivals: dict[str, bool] = {}  # request id -> others present, per schedule() call
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        # without chunking a prompt runs whole, so a cap below its length would starve it
        self.long_prefill_token_threshold = long_prefill_token_threshold if enable_chunked_prefill else 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_running_seats(self) -> int:
        """Running sequences, counting the siblings a prefilling n > 1 request will fork into."""
        return sum(1 + s.num_pending_forks for s in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_budget = budget
        if self.long_prefill_token_threshold > 0:
            for seq in self.running:  # a loop, not any(generator): this runs every step
                if seq.num_tokens - seq.num_computed_tokens == 1:  # someone decodes: one bounded chunk
                    prefill_budget = min(budget, self.long_prefill_token_threshold)
                    break
        self._has_rivals.clear()
        budget, prefill_budget = self._schedule_running(out, budget, prefill_budget)
        if not out.pool_full:  # memory is tight: admit nobody new this step
            self._schedule_waiting(out, budget, prefill_budget)
        out.num_batched_tokens = sum(n for _, n in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill_budget: int) -> tuple[int, int]:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = seq.num_tokens - seq.num_computed_tokens
            num_new = min(remaining, budget) if remaining == 1 else min(remaining, budget, prefill_budget)
            if num_new == 0:  # a prefill whose chunk must wait for a step with room; decodes behind it still run
                i += 1
                continue
            end = seq.num_computed_tokens + num_new
            if bm.needs_allocation(seq, end):
                if self._over_share(seq, end):  # its request gives way to the others, not they to it
                    self._preempt_into(out, self._latest_of(seq.request_id, i))
                    continue  # seq again, or (if it gave way itself) the sequence now at i
                while not bm.can_allocate(seq, end):
                    victim = self._pool_victim(i)
                    self._preempt_into(out, victim)
                    out.pool_full = True
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue  # seq gave way: the sequence now at i is next
                bm.allocate(seq, end)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            if remaining > 1:
                prefill_budget -= num_new
            i += 1
        return budget, prefill_budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, prefill_budget: int) -> None:
        bm = self.block_manager
        seats = self.max_num_seqs - self.num_running_seats
        budget = min(budget, prefill_budget)  # everything admitted here is a prefill
        j = 0  # waiting[:j] are sequences of requests at their share, passed over this step
        while j < len(self.waiting) and budget > 0:
            seq = self.waiting[j]
            if 1 + seq.num_pending_forks > seats:
                break
            # logits of every prompt position are wanted: a prefix-cache hit would skip them
            hits = [] if seq.needs_prompt_logprobs else bm.match_prefix(seq)
            num_cached = len(hits) * bm.block_size
            remaining = seq.num_tokens - num_cached
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            seq.num_computed_tokens = num_cached
            if self._over_share(seq, num_cached + num_new, hits):  # later requests go first
                seq.num_computed_tokens = 0
                j += 1
                continue
            if not bm.can_allocate(seq, num_cached + num_new, hits):
                seq.num_computed_tokens = 0
                break
            bm.allocate(seq, num_cached + num_new, hits)
            if seq.num_cached_tokens is None:  # first admission: count its prompt for the hit rate
                seq.num_cached_tokens = num_cached
                bm.record_prefix_lookup(seq.num_prompt_tokens, num_cached)
            del self.waiting[j]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            seats -= 1 + seq.num_pending_forks

    # -- one request's share of the pool ----------------------------------------------------------
    def _over_share(self, seq: Sequence, num_tokens: int, hits: list[int] = ()) -> bool:
        """Would giving seq room for num_tokens take its request past its share while other
        requests are present? Never for a request's only running sequence."""
        bm, rid = self.block_manager, seq.request_id
        if self.max_request_blocks >= bm.num_blocks:
            return False  # no cap (max_request_kv_share 1.0)
        if bm.num_request_blocks(rid) + bm.num_new_request_blocks(seq, num_tokens, hits) <= self.max_request_blocks:
            return False  # the common case: one dict lookup and a little arithmetic
        if not any(s.request_id == rid and s is not seq for s in self.running):
            return False
        rivals = self._has_rivals.get(rid)
        if rivals is None:
            rivals = self._has_rivals[rid] = any(s.request_id != rid for s in self.running) or any(
                s.request_id != rid for s in self.waiting)
        return rivals

    def _latest_of(self, request_id: str, start: int) -> Sequence:
        """The last of the request's sequences not yet scheduled this step (running[start:])."""
        return next(s for s in reversed(self.running[start:]) if s.request_id == request_id)

    def _pool_victim(self, start: int) -> Sequence:
        """Who gives way when the pool is out of blocks: the latest unscheduled sequence of a
        request over its share with another sequence running, else the latest arrival."""
        bm = self.block_manager
        counts: dict[str, int] = {}
        for s in self.running:
            counts[s.request_id] = counts.get(s.request_id, 0) + 1
        for s in reversed(self.running[start:]):
            if counts[s.request_id] > 1 and bm.num_request_blocks(s.request_id) > self.max_request_blocks:
                return s
        return self.running[-1]

    def _preempt_into(self, out: SchedulerOutput, seq: Sequence) -> None:
        self.preempt(seq)
        out.preempted.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free seq's KV and queue it first in line, to be recomputed from its tokens."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        for seq in reversed(list(self.running)):
            self.preempt(seq)

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run children right after parent, sharing its blocks (copy-on-write)."""
        at = self.running.index(parent) + 1
        for child in children:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
        self.running[at:at] = children
        parent.num_pending_forks = 0

    def finish(self, seq: Sequence) -> None:
        """Remove seq (running or waiting) and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
