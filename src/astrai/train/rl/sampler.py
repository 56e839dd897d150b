"""The sampler interface: how the episode runner draws every turn, wherever the policy runs.

The runner (``rl/runner.py``) asks a ``Sampler`` for turns only in token ids: per request a prompt,
the rollout's sampling (``RolloutSampling``), a number of samples and a seed, from which the
sampler derives each sample's stream; it gets back per request the sampled token ids, their
behaviour log-probs (under the distribution they were drawn from), finish reasons, the text, and
the policy version of the weights that drew them. The in-process engine is one implementation
(``rl/engine_sampler.py``); a sampler over HTTP rollout servers or one running ahead of training
fits the same methods, so the runner never changes with where the samples come from.

``rollout_sampling`` is the one reading of the config's ``rollout_*`` sampling fields: rollouts,
evaluation and the trainer's log-prob path (``objectives/logps.py``, which must score tokens under
the distribution they were drawn from) all take it from here.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from astrai.config import RLConfig

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class RolloutSampling:
    """The distribution a rollout draws from: temperature 0 is greedy; top_k 0 and top_p 1 are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; on prompt and output tokens (vLLM's)

    def greedy(self) -> RolloutSampling:
        """The same turn length, decoded greedily (evaluation's greedy answers)."""
        return replace(self, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0)


def rollout_sampling(rl: RLConfig) -> RolloutSampling:
    """The run's rollout sampling, from ``rollout_temperature``, ``rollout_top_p``,
    ``rollout_top_k``, ``rollout_max_tokens``, ``rollout_min_p`` and ``rollout_repetition_penalty``."""
    return RolloutSampling(rl.rollout_temperature, rl.rollout_top_p, rl.rollout_top_k, rl.rollout_max_tokens,
                           rl.rollout_min_p, rl.rollout_repetition_penalty)


@dataclass
class TurnRequest:
    """``n`` samples of one prompt; ``seed`` (None: unseeded) fixes all n of them."""

    prompt_ids: list[int]
    sampling: RolloutSampling
    n: int = 1
    seed: int | None = None


@dataclass
class SampledTurn:
    """One sample: its tokens, the sampler's log-prob of each (empty when not asked for), why it
    ended ("stop" or "length") and its text (stop strings and special tokens as the sampler shows them).
    ``routing`` (``routing_replay``, MoE policies): the experts (tokens, MoE layers, k) the sampler
    routed each token of the prompt and of this sample to, but its last (never run through the model)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str
    routing: Tensor | None = None


@dataclass
class TurnResult:
    """A request's samples, the policy version that drew them, and the prompt tokens the sampler
    computed for it (not served from its prefix cache)."""

    samples: list[SampledTurn]
    policy_version: int
    num_prefill_tokens: int = 0


class Sampler(Protocol):
    """What the runner draws turns from (module docstring)."""

    @property
    def max_model_len(self) -> int:
        """The longest row (prompt and every sampled token) the sampler can hold."""
        ...

    def set_policy_version(self, version: int) -> None:
        """The training side's weights moved to `version` (monotonic): later turns are drawn from
        them, and nothing computed under older weights (cached prefixes) is reused."""
        ...

    def sync_weights(self, version: int) -> None:
        """Bring the sampler's copy of the weights to `version` before a fresh rollout; every rank
        calls it at the same point (it may be a collective). A no-op where the sampler runs the
        live module."""
        ...

    def batch(self, num_seqs: int, longest: int) -> AbstractContextManager[None]:
        """A batch of up to `num_seqs` sequences of up to `longest` tokens drawn turn after turn:
        the sampler holds what they need (KV memory) only inside it."""
        ...

    def sample(self, requests: list[TurnRequest], return_logprobs: bool = True) -> list[TurnResult]:
        """Every request's samples, in request order."""
        ...
