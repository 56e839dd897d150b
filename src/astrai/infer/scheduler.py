"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

The engine adds sequences to `waiting`; every step `schedule()` fills a token budget
(`max_num_batched_tokens`), first with the running sequences in arrival order (a decode costs
one token, an unfinished chunked prefill what is left of it), then with waiting sequences in
arrival order (FCFS: a sequence that does not fit blocks the ones behind it). Prefills longer
than the remaining budget are split into chunks over several steps, mixed with the decodes of
other sequences. A step that decodes carries at most `long_prefill_token_threshold` prefill
tokens in all (0: no such cap), so a running decode never waits behind more than one prefill
chunk of bounded cost; a step without decodes fills the whole budget with prefill. When the KV
pool runs out, the most recently arrived running sequence is preempted: its blocks are freed
and it waits at the head of the queue to be recomputed later (cheaply, when its blocks are
still in the prefix cache). A sequence is never dropped here: it runs, waits, or the engine
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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_manager = block_manager
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
        budget, prefill_budget = self._schedule_running(out, budget, prefill_budget)
        if not out.preempted:  # memory is tight: admit nobody new this step
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
                while not bm.can_allocate(seq, end):
                    victim = self.running[-1]  # the latest arrival gives way
                    self.preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    break  # seq preempted itself: everything behind it is gone too
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
        while self.waiting and budget > 0:
            seq = self.waiting[0]
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
            if not bm.can_allocate(seq, num_cached + num_new, hits):
                seq.num_computed_tokens = 0
                break
            bm.allocate(seq, num_cached + num_new, hits)
            if seq.num_cached_tokens is None:  # first admission: count its prompt for the hit rate
                seq.num_cached_tokens = num_cached
                bm.record_prefix_lookup(seq.num_prompt_tokens, num_cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            seats -= 1 + seq.num_pending_forks

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
