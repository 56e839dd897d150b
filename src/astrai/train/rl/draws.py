"""Prompt draws: the seeded prompt order -> batches of prompts -> one rollout per call, redrawn
while no prompt fits or (``dynamic_sampling``) while too few groups carry signal.

The online loop (``rl/loop.py``) calls ``RolloutDraws.rollout`` on its own thread for a synchronous
run; the asynchronous pipeline (``rl/pipeline.py``) calls the same code on its rollout thread,
with its own runner (an engine over its own copy of the weights), its own stop check and its own
group for the cross-rank agreements, so both draw exactly the same prompts in the same order. The
sampler position (``epoch``, ``consumed_samples``) lives on a ``position`` object: the loop's
``TrainContext`` when synchronous, the pipeline's own when not.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from astrai.data.sampler import ResumableSampler
from astrai.train.rl.data import Rollout, concat_rollouts, groups_with_signal, select_groups
from astrai.train.rl.guard import UserCodeInterrupted
from astrai.train.rl.runner import EpisodeRunner

MAX_EMPTY_DRAWS = 10  # prompt batches passed over in a row (no prompt within max_prompt_len), then an error


class RolloutDraws:
    """Draws prompt batches from `prompts` in `sampler`'s order at `position` and generates their
    rollouts through `runner`; `should_stop()` ends the draws (None), `any_rank(flag)` agrees a
    flag across ranks, `heap()` is the context a generation runs in (the loop's heap trimming)."""

    def __init__(self, runner: EpisodeRunner, prompts: Any, sampler: ResumableSampler, num_prompts: int, rl: Any,
                 rank: int, world_size: int, should_stop: Callable[[], bool], any_rank: Callable[[bool], bool],
                 heap: Callable[[], Any] = contextlib.nullcontext):
        self.runner, self.prompts, self.sampler, self.num_prompts, self.rl = runner, prompts, sampler, num_prompts, rl
        self.rank, self.world_size = rank, world_size
        self.should_stop, self.any_rank, self.heap = should_stop, any_rank, heap

    def rollout(self, position: Any, step: int, policy_version: int) -> Rollout | None:
        """The rollout of the next prompts at `position` (moved past them) for optimizer step `step`
        (its seeds), drawn at `policy_version`; None when a stop request came first."""
        before = self.runner.num_skipped_total
        draw = self._with_signal if self.rl.dynamic_sampling else self._fitting
        rollout = draw(position, step, policy_version)
        if rollout is not None:
            rollout.stats["skipped_prompts"] = float(self.runner.num_skipped_total - before)  # every draw's
        return rollout

    def _generate(self, batch: dict[str, list[Any]], draw: int, step: int, policy_version: int) -> Rollout | None:
        """This rank's rollout of `batch`; None when no prompt fits max_prompt_len, or a stop
        request interrupted user code (a reward, a tool, an environment: the stop check after each
        draw then ends the draws)."""
        first = (self.rank + draw * self.world_size) * self.num_prompts  # seeds differ per draw
        try:
            with self.heap():
                return self.runner.rollout(batch, step, policy_version, first_index=first)
        except UserCodeInterrupted as e:
            print(f"note: {e}; the rollout is dropped and the run stops after step {step}", file=sys.stderr)
            return None

    def _fitting(self, position: Any, step: int, policy_version: int) -> Rollout | None:
        """The rollout of the next batch with a prompt within max_prompt_len: a batch of only
        longer prompts is passed over for the next one, at most MAX_EMPTY_DRAWS times in a row,
        then the run stops with an error. Ranks redraw together, so their sampler positions stay
        in step: while any rank has no rollout, a rank that has one passes over its next batch."""
        rollout = None
        for draw in range(MAX_EMPTY_DRAWS + 1):
            batch = self.next_prompts(position)
            if rollout is None:
                rollout = self._generate(batch, draw, step, policy_version)
            if self.should_stop():
                return None
            if not self.any_rank(rollout is None):
                return rollout
        raise self._no_fitting_prompts(MAX_EMPTY_DRAWS + 1)

    def _no_fitting_prompts(self, draws: int) -> ValueError:
        shortest = self.runner.shortest_skipped
        fix = f"raise --max_prompt_len to at least {shortest}" if shortest else "raise --max_prompt_len"
        return ValueError(f"{draws} prompt batches drawn in a row held no prompt within max_prompt_len="
                          f"{self.runner.max_prompt_len} tokens (on some rank); {fix} or drop the long prompts from "
                          "the data")

    def _with_signal(self, position: Any, step: int, policy_version: int) -> Rollout | None:
        """``dynamic_sampling`` (DAPO): groups whose rewards are all equal are dropped and further
        prompt batches drawn until ``batch_per_device`` groups with signal are collected, at most
        ``max_resample_batches`` extra draws (up to MAX_EMPTY_DRAWS while no prompt fitted); every
        rank draws as many batches as the rank that needs most, so the sampler positions stay in
        step. ``filtered_groups`` counts the drops. None: a stop request came first."""
        parts: list[Rollout] = []
        dropped: list[Rollout] = []  # dropped groups that hold traced samples (train/traces.py)
        num_groups = filtered = draws = 0
        last = None
        while True:
            rollout = self._generate(self.next_prompts(position), draws, step, policy_version)
            draws += 1
            if self.should_stop():
                return None
            if rollout is not None:
                last = rollout
                signal = groups_with_signal(rollout)
                filtered += int((~signal).sum())
                parts.append(select_groups(rollout, signal.nonzero().squeeze(1)))
                if not signal.all() and any(v is not None for v in rollout.samples):
                    dropped.append(select_groups(rollout, (~signal).nonzero().squeeze(1)))
                num_groups += int(signal.sum())
            short = num_groups < self.num_prompts and draws <= self.rl.max_resample_batches
            if self.any_rank(short or (last is None and draws <= MAX_EMPTY_DRAWS)):
                continue
            if self.any_rank(last is None):  # every rank raises: none waits in a collective alone
                raise self._no_fitting_prompts(draws)
            collected = self._collected(parts, filtered)
            if collected is not None:
                collected.filtered = dropped
                return collected
            last.stats["filtered_groups"] = float(filtered)  # no group with signal: as it is (no update)
            return last

    def _collected(self, parts: list[Rollout], filtered: int) -> Rollout | None:
        """Dynamic sampling's rollout: the first ``batch_per_device`` groups with signal of all
        draws (fewer when the draws ran out; None when none had any: then draw again)."""
        parts = [p for p in parts if p.num_samples]
        if not parts:
            return None
        rollout = concat_rollouts(parts)
        rollout = select_groups(rollout, torch.arange(min(rollout.rewards.size(0), self.num_prompts)))
        rollout.stats["filtered_groups"] = float(filtered)
        return rollout

    def next_prompts(self, position: Any) -> dict[str, list[Any]]:
        """The next `num_prompts` prompts of the seeded order at `position`; epochs roll over."""
        if position.consumed_samples >= self.sampler.total_size:
            position.epoch, position.consumed_samples = position.epoch + 1, 0
        self.sampler.set_epoch(position.epoch)
        self.sampler.set_consumed(position.consumed_samples)
        indices = []
        for idx in self.sampler:
            indices.append(idx)
            if len(indices) == self.num_prompts:
                break
        position.consumed_samples = self.sampler.consumed_samples if len(indices) == self.num_prompts else \
            self.sampler.total_size
        return self.prompts.collate([self.prompts[i] for i in indices])
