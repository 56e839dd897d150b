"""Samplers without a model, for tests of the episode runner (``astrai.train.rl.sampler.Sampler``):
each turn's samples come from a script; `scripted_episodes` runs episodes through one."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from astrai.config import RLConfig
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import Draw, EpisodeRunner
from astrai.train.rl.sampler import SampledTurn, TurnRequest, TurnResult


def fake_turn(tokenizer, text: str, stop: bool = True) -> SampledTurn:
    """A sample of `text` (ending with the template's stop token unless cut off), log-prob -0.5 a token."""
    token_ids = tokenizer.encode(text) + (tokenizer.stop_token_ids[-1:] if stop else [])
    return SampledTurn(token_ids, [-0.5] * len(token_ids), "stop" if stop else "length", text)


class ScriptedSampler:
    """Every request's samples at turn t are `reply(t, prompt_ids)`; a request's prefill is its
    whole prompt; the policy version is `policy_version`. Records the requests and the turns' ids."""

    def __init__(self, reply: Callable[[int, list[int]], SampledTurn], max_model_len: int = 4096,
                 policy_version: int = 0):
        self.reply, self.max_model_len, self.policy_version = reply, max_model_len, policy_version
        self.turn = 0
        self.requests: list[TurnRequest] = []
        self.sampled: list[list[int]] = []

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version

    def sync_weights(self, version: int) -> None:
        pass

    def batch(self, num_seqs: int, longest: int):
        return contextlib.nullcontext()

    def sample(self, requests: list[TurnRequest], return_logprobs: bool = True) -> list[TurnResult]:
        self.requests += requests
        out = []
        for r in requests:
            turn = self.reply(self.turn, list(r.prompt_ids))
            self.sampled.append(turn.token_ids)
            out.append(TurnResult([turn] * r.n, self.policy_version, len(r.prompt_ids)))
        self.turn += 1
        return out


def scripted_episodes(tok, script, records, max_model_len: int, max_tokens: int, environment=None, tools=(),
                      group_size: int = 1, should_stop=None, **rl):
    """`group_size` episodes per record, their turns from `script(turn)`, through the episode
    runner's turn loop (`rl`: more RLConfig fields; `should_stop`: the run's stop flag)."""
    cfg = RLConfig(group_size=group_size, rollout_max_tokens=max_tokens, max_turns=4, environment=environment,
                   tools=list(tools), rewards=["exact_match"], **rl)
    sampler = ScriptedSampler(lambda turn, ids: script(turn), max_model_len)
    runner = EpisodeRunner(sampler, tok, cfg, RewardSet(cfg, tokenizer=tok, should_stop=should_stop),
                           max_prompt_len=max_model_len)
    [episodes] = runner.run(records, [], [Draw(runner.sampling, group_size, lambda *a: 0)], policy_version=0)
    return episodes, sampler
