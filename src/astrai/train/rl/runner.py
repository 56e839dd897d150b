"""The episode runner: prompt records -> episodes drawn turn by turn through a sampler -> a scored rollout.

Every rollout is a batch of episodes; a single-turn rollout is the case of one turn (no tools, no
environment). ``EpisodeRunner.run`` owns the one turn loop: per turn it sends every unfinished
episode's row to the sampler (``rl/sampler.py``: the in-process engine, or any other
implementation), appends the sampled tokens with their behaviour log-probs, then runs the turn's
tool calls and environment steps concurrently (``rl/episode.py``) and extends the rows to the next
prompt. Seeds come from (random_seed, step, prompt index[, sample, turn]) so a rollout is
reproducible: the first turn's G samples of a prompt share one request (one prefill), later turns
are one request per (prompt, sample, turn). ``rollout`` scores the episodes (the configured
rewards on the final assistant turn, plus the environment's) and packs them into a ``Rollout``
(``rl/data.py``); held-out evaluation (``train/evaluation.py``) runs the same loop, greedy and
sampled episodes in one batch. Prompts over ``max_prompt_len`` are skipped and counted.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from astrai.config import RLConfig
from astrai.config_values import default_max_prompt_len
from astrai.train.rl.data import Rollout, pack_episodes, rollout_signal_stats, routing_rows, turn_reward_rows
from astrai.train.rl.episode import Conversation, Episode, episode_stats
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.sampler import RolloutSampling, Sampler, TurnRequest, rollout_sampling
from astrai.train.traces import trace_views


def rollout_seed(random_seed: int, step: int, prompt_index: int, *more: int) -> int:
    """A reproducible 63-bit sampling seed per (run seed, step, prompt[, sample, turn])."""
    return hash((random_seed, step, prompt_index, *more)) & ((1 << 63) - 1)


def resolve_max_prompt_len(rl: RLConfig, max_positions: int) -> int:
    """``max_prompt_len``, or what build_run would fill in (the Python API may hand an unresolved RLConfig)."""
    return rl.max_prompt_len or default_max_prompt_len(rl.rollout_max_tokens, max_positions)


def episode_max_len(rl: RLConfig, max_prompt_len: int, max_positions: int) -> int:
    """The longest row a run's episodes can reach: a prompt and one turn; multi-turn (an
    environment or tools), every turn adds at most rollout_max_tokens sampled tokens and its tool /
    environment messages are budgeted like a prompt, capped by the model's positions."""
    if not (rl.environment or rl.tools):
        return max_prompt_len + rl.rollout_max_tokens
    return min(max_positions, max_prompt_len + rl.max_turns * (rl.rollout_max_tokens + max_prompt_len))


@dataclass
class Draw:
    """Episodes drawn together with one sampling: `group_size` per prompt, seeded by
    `seed(prompt_index)` on the first turn and `seed(prompt_index, sample, turn)` after it."""

    sampling: RolloutSampling
    group_size: int
    seed: Callable[..., int | None]


class EpisodeRunner:
    """Runs episodes through a sampler and scores them (module docstring)."""

    def __init__(self, sampler: Sampler, tokenizer: Any, rl: RLConfig, rewards: RewardSet, max_prompt_len: int,
                 random_seed: int = 0):
        self.sampler, self.tokenizer, self.rl, self.rewards = sampler, tokenizer, rl, rewards
        self.max_prompt_len, self.random_seed = max_prompt_len, random_seed
        # tools and environments: bounded per call, and interrupted by the stop request the rewards poll
        self.conversation = Conversation(tokenizer, rl.environment, list(rl.tools), rl.rollout_max_tokens,
                                         sampler.max_model_len, rl.tool_timeout, rl.env_timeout, rewards.should_stop)
        self.multi_turn = self.conversation.multi_turn
        self.max_turns = rl.max_turns if self.multi_turn else 1
        self.sampling = rollout_sampling(rl)
        self.generation_seconds = 0.0  # time inside the sampler, this run() call
        self.num_skipped_total = 0  # prompts over max_prompt_len, this rank, whole run (warned once)
        self.shortest_skipped: int | None = None  # the shortest of them: the max_prompt_len that keeps one
        self.trace_samples = 0  # episodes per rollout whose views the Rollout keeps (set by train/traces.py)

    # ---------------------------------------------------------------------------- the turn loop

    def run(self, records: list[dict[str, Any]], prompt_ids: list[list[int]], draws: list[Draw],
            policy_version: int, logprobs: bool = True) -> list[list[Episode]]:
        """Every draw's episodes to their end, all sampled together turn by turn: per turn the
        unfinished ones are sampled, then their tools and environment steps run concurrently,
        then their rows extend to the next prompt. One list of episodes per draw."""
        conv = self.conversation
        conv.stats = {"tool_seconds": 0.0, "env_seconds": 0.0}
        per_draw = [conv.open(records, prompt_ids, d.group_size, draw=k) for k, d in enumerate(draws)]
        episodes = [e for eps in per_draw for e in eps]
        if self.multi_turn:
            if (longest := max(len(e.ids) for e in episodes)) > self.sampler.max_model_len - self.rl.rollout_max_tokens:
                raise self._opening_too_long(longest)
            # a turn continues its conversation's cached KV, so one pool serves every turn; an
            # episode's row can reach the sampler's max_model_len (tool messages have no other bound)
            longest = self.sampler.max_model_len
        else:
            longest = max(len(p) for p in prompt_ids) + max(d.sampling.max_tokens for d in draws)
        self.generation_seconds = 0.0
        with self.sampler.batch(len(episodes), longest):
            for turn in range(self.max_turns):
                active = [e for e in episodes if not e.finished]
                if not active:
                    break
                for e, (sample, num_prefill) in zip(active, self._sample_turn(active, turn, draws, policy_version,
                                                                               logprobs)):
                    conv.add_turn(e, sample, num_prefill, logprobs)
                conv.after_turns(active)
                for e in active:
                    if not e.done and turn + 1 == self.max_turns:
                        e.truncated = True  # it would go on: running past max_turns
                    elif not e.done:
                        conv.extend_to_next_prompt(e)
        return per_draw

    def _opening_too_long(self, longest: int) -> ValueError:
        """An opening prompt (tool schemas and the environment's reset included) with no room for a
        turn: the fix names what bounds the episode, the model's positions or max_prompt_len."""
        rl, max_len = self.rl, self.sampler.max_model_len
        budget = self.max_prompt_len + rl.max_turns * (rl.rollout_max_tokens + self.max_prompt_len)
        if max_len < budget:  # the model's positions bound it: a larger max_prompt_len cannot help
            fix = (f"the model's max_position_embeddings ({max_len}) bound an episode; shorten the prompts or the "
                   f"tools' docstrings, or lower --rollout_max_tokens (now {rl.rollout_max_tokens})")
        else:
            fix = f"raise --max_prompt_len to at least {longest}, or shorten the prompts or the tools' docstrings"
        return ValueError(f"an episode's opening prompt has {longest} tokens (tool schemas and environment included), "
                          f"more than the {max_len - rl.rollout_max_tokens} an episode of {max_len} tokens leaves "
                          f"beside rollout_max_tokens={rl.rollout_max_tokens}; {fix}")

    def _sample_turn(self, active: list[Episode], turn: int, draws: list[Draw], policy_version: int,
                     logprobs: bool) -> list[tuple[Any, int]]:
        """One turn of the unfinished episodes: (sample, prefill tokens) each. The first turn's
        samples of one prompt share a request (n = G, one prefill); later turns are one request
        per (prompt, sample, turn), seeded by all three."""
        requests: dict[tuple, list[int]] = {}  # (draw, prompt, ids) or (draw, prompt, sample) -> indices into active
        for j, e in enumerate(active):
            key = (e.draw, e.prompt_index, tuple(e.ids)) if turn == 0 else (e.draw, e.prompt_index, e.sample)
            requests.setdefault(key, []).append(j)
        keys = list(requests)
        batch = [TurnRequest(list(active[requests[k][0]].ids), draws[k[0]].sampling, n=len(requests[k]),
                             seed=draws[k[0]].seed(k[1]) if turn == 0 else draws[k[0]].seed(k[1], k[2], turn))
                 for k in keys]
        start = time.perf_counter()
        outputs = self.sampler.sample(batch, return_logprobs=logprobs)
        self.generation_seconds += time.perf_counter() - start
        if {out.policy_version for out in outputs} != {policy_version}:
            raise ValueError(f"a turn of a rollout for policy version {policy_version} was generated at version(s) "
                             f"{sorted({out.policy_version for out in outputs})}; publish each new version to the "
                             "sampler before generating")
        results: list[Any] = [None] * len(active)
        for k, out in zip(keys, outputs):
            for j, sample in zip(requests[k], out.samples):
                results[j] = (sample, out.num_prefill_tokens)
        return results

    def score(self, episodes: list[Episode], group_size: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Episode rewards (N,): the configured rewards on the final assistant turn plus the
        environment's (summed over its steps); the terms by name."""
        env = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        terms: dict[str, Tensor] = {}
        total = torch.zeros(len(episodes))
        if self.rewards.names:
            total, terms = self.rewards([self.tokenizer.decode(e.ids[:e.num_prompt_ids]) for e in episodes],
                                        [e.final_text for e in episodes], [e.record for e in episodes],
                                        [list(e.ids) for e in episodes], group_size,
                                        completion_ids=[list(e.final_ids) for e in episodes])
        if self.conversation.env_cls is not None:
            terms["environment"] = env
        return total + env, terms

    # ---------------------------------------------------------------------------- a training rollout

    def rollout(self, batch: dict[str, list[Any]], step: int, policy_version: int, first_index: int = 0) -> Rollout | None:
        """Sample, score and pack a rollout for one batch of prompt records; None when every
        prompt was too long. `first_index` numbers this rank's prompts within the step (seeds
        differ across ranks)."""
        G = self.rl.group_size
        keep = [i for i, ids in enumerate(batch["prompt_ids"]) if len(ids) <= self.max_prompt_len]
        skipped = len(batch["prompt_ids"]) - len(keep)
        if skipped:
            self._count_skipped(step, [len(ids) for ids in batch["prompt_ids"] if len(ids) > self.max_prompt_len])
        if not keep:
            return None
        start = time.perf_counter()
        records = [prompt_record(batch, i) for i in keep]
        seed = self.random_seed
        draw = Draw(self.sampling, G, lambda i, *more: rollout_seed(seed, step, first_index + i, *more))
        [episodes] = self.run(records, [list(batch["prompt_ids"][i]) for i in keep], [draw], policy_version)
        rollout = pack_episodes([(e.ids, e.logps) for e in episodes], G, policy_version)
        if self.rl.routing_replay:  # the sampler's experts of every token, aligned with the rows
            rollout.routing = routing_rows([e.routing for e in episodes], rollout.input_ids.size(1))
        scored = time.perf_counter()
        total, terms = self.score(episodes, G)
        reward_seconds = time.perf_counter() - scored
        rollout.rewards, rollout.reward_terms = total.view(-1, G), {k: v.view(-1, G) for k, v in terms.items()}
        rollout.texts = [e.final_text for e in episodes]
        rollout.samples = trace_views(episodes, self.trace_samples, self.tokenizer)
        if self.rl.turn_rewards:  # each environment step's reward on its turn's last sampled token
            rollout.turn_rewards = turn_reward_rows([e.turn_rewards for e in episodes], rollout.labels.shape)
        rollout.truncated = torch.tensor([e.truncated or e.finish_reason == "length" for e in episodes])
        seconds = time.perf_counter() - start
        num_new = sum(lp is not None for e in episodes for lp in e.logps)
        rollout.stats = {"rollout_seconds": seconds, "rollout_tokens": float(num_new),
                         "rollout_tokens_per_s": num_new / max(seconds, 1e-9), "skipped_prompts": float(skipped),
                         "generation_seconds": self.generation_seconds, "reward_seconds": reward_seconds,
                         **rollout_signal_stats(rollout.rewards, ["length" if t else "stop" for t in rollout.truncated])}
        if self.multi_turn:
            stats = self.conversation.stats
            rollout.stats.update(episode_stats(episodes, stats["tool_seconds"], stats["env_seconds"]))
        return rollout

    def _count_skipped(self, step: int, lengths: list[int]) -> None:
        """Prompts over max_prompt_len: counted (``skipped_prompts``); the first time, one warning
        (a data set of long prompts would otherwise print a line per batch)."""
        if not self.num_skipped_total:
            print(f"warning: step {step}: skipped {len(lengths)} prompt(s) longer than max_prompt_len="
                  f"{self.max_prompt_len} (longest {max(lengths)} tokens); raise --max_prompt_len to keep them "
                  "(said once: the metric skipped_prompts counts them, the run's end gives the total)",
                  file=sys.stderr)
        self.num_skipped_total += len(lengths)
        self.shortest_skipped = min(lengths + ([self.shortest_skipped] if self.shortest_skipped else []))


def prompt_record(batch: dict[str, list[Any]], i: int) -> dict[str, Any]:
    """The record a reward sees for prompt `i` of a collated batch: messages, answer, metadata columns."""
    return {"messages": batch["messages"][i], "answer": batch["answer"][i], **dict(batch["metadata"][i] or {})}
