"""The in-process sampler: rollout turns drawn by the paged-KV engine over the live policy module.

The one bridge from training to inference (the only module of ``astrai.train`` that imports
``astrai.infer``), and the first implementation of the sampler interface (``rl/sampler.py``).
``EngineSampler`` keeps an ``LLMEngine`` over the live training module (no copy of the weights;
under FSDP over an unsharded replica instead, see ``unsharded_replica``, refreshed by
``sync_weights`` once per policy version). A request's n samples share one prefill; the engine
returns the sampler's behaviour log-probs (under the rollout's temperature and truncation) and the
policy version each output came from. The loop publishes every new policy version to the engine,
whose prefix cache is keyed by version, so KV of older weights is never reused. The engine's KV
pool exists only inside ``batch`` (``batch_kv_pool``): made for that batch's sequences at the
longest length they can reach, and freed before the rewards and the trainer run; ``keep_kv_pool``
keeps one pool, sized at the start, for the whole run instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from astrai.config import RLConfig
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.infer.sizing import batch_kv_tokens
from astrai.model.matmul import current_cpu_matmul
from astrai.train import dist
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import EpisodeRunner, episode_max_len, resolve_max_prompt_len
from astrai.train.rl.sampler import SampledTurn, TurnRequest, TurnResult


class EngineSampler:
    """Draws turns on an engine over the live policy module (FSDP: over its replica)."""

    def __init__(self, model: nn.Module, tokenizer: Any, num_seqs: int, max_len: int, bf16: bool = False,
                 keep_kv_pool: bool = False, record_routing: bool = False):
        # FSDP: every forward of the sharded module all-gathers its weights, a collective; ranks
        # whose samples end at different lengths take different numbers of engine steps and would
        # wait for each other forever. The engine runs a plain replica, refreshed per policy version
        self.policy = model
        self.replica = unsharded_replica(model) if dist.is_fsdp(model) else None
        self.replica_version: int | None = None  # the policy version the replica's weights are
        self.keep_kv_pool = keep_kv_pool
        self.engine = batch_engine(self.replica or model, tokenizer, num_seqs, max_len, bf16, record_routing)
        if not keep_kv_pool:
            self.engine.release_kv_cache()  # made for each batch (batch_kv_pool)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def set_policy_version(self, version: int) -> None:
        self.engine.set_policy_version(version)  # monotonic; older prefixes are never served again

    def sync_weights(self, version: int) -> None:
        """FSDP: the replica takes the policy's full weights, once per policy version. Gathering
        them is a collective, so every rank calls this at the same point (before a fresh rollout);
        a no-op when the engine runs the live module (one rank, DDP) or the version is current."""
        if self.replica is None or self.replica_version == version:
            return
        dist.copy_full_weights(self.policy, self.replica)
        self.replica_version = version

    def batch(self, num_seqs: int, longest: int) -> contextlib.AbstractContextManager[None]:
        return batch_kv_pool(self.engine, num_seqs, longest, keep=self.keep_kv_pool)

    def sample(self, requests: list[TurnRequest], return_logprobs: bool = True) -> list[TurnResult]:
        if self.replica is not None and self.replica_version != self.engine.policy_version:
            raise ValueError(f"the engine's replica holds the weights of policy version {self.replica_version}, "
                             f"not {self.engine.policy_version}; call sync_weights({self.engine.policy_version}) on "
                             "every rank first")
        params = [sampling_params(r) for r in requests]
        outputs = self.engine.run_batch([list(r.prompt_ids) for r in requests], params,
                                        return_logprobs=return_logprobs)
        return [TurnResult([SampledTurn(list(c.token_ids), [float(lp) for lp in c.logprobs or []], c.finish_reason,
                                        c.text, c.routing) for c in out.outputs],
                           out.policy_version, len(out.prompt_token_ids) - out.num_cached_tokens)
                for out in outputs]


def engine_runner(model: nn.Module, tokenizer: Any, rl: RLConfig, num_seqs: int, rewards: RewardSet,
                  random_seed: int = 0, bf16: bool = False) -> EpisodeRunner:
    """An episode runner drawing from an in-process engine over `model`, with room for `num_seqs`
    episodes at the longest row the run's episodes can reach (online RL's rollouts, an offline
    loop's evaluation, the tools demo's held-out episodes)."""
    max_prompt_len, max_len = engine_limits(model, rl)
    sampler = EngineSampler(model, tokenizer, num_seqs, max_len, bf16=bf16, keep_kv_pool=rl.keep_kv_pool,
                            record_routing=rl.routing_replay)
    return EpisodeRunner(sampler, tokenizer, rl, rewards, max_prompt_len, random_seed)


def engine_limits(model: nn.Module, rl: RLConfig) -> tuple[int, int]:
    """A rollout engine's (max_prompt_len, longest row) over `model` for the run's episodes (here and
    in the rollout process, ``rl/process_sampler.py``)."""
    positions = model.config.max_position_embeddings
    max_prompt_len = resolve_max_prompt_len(rl, positions)
    if rl.routing_replay and not getattr(model.config, "num_experts", 0):
        raise ValueError("routing_replay=true replays the experts a mixture-of-experts policy routed each token to, "
                         "but this policy has no MoE layer (num_experts is 0); set --routing_replay false")
    return max_prompt_len, episode_max_len(rl, max_prompt_len, positions)


def sampling_params(request: TurnRequest) -> SamplingParams:
    """The engine's parameters for a turn request."""
    s = request.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
                          repetition_penalty=s.repetition_penalty, max_tokens=s.max_tokens, n=request.n,
                          seed=request.seed)


def batch_engine(model: nn.Module, tokenizer: Any, num_seqs: int, max_len: int, bf16: bool,
                 record_routing: bool = False) -> LLMEngine:
    """An engine over a live module for whole batches (rollouts, held-out evaluation): room for
    `num_seqs` sequences at `max_len` (no preemption inside a batch, so no request needs a cap on
    its share of the pool), throughput first (nobody streams a rollout: no per-step prefill cap).
    `bf16` (the run's train.bf16): samples in the trainer's precision, the same autocast over a
    bf16 KV pool. `record_routing` (routing_replay): completions carry each token's experts."""
    return LLMEngine(model, tokenizer, max_num_seqs=num_seqs, max_model_len=max_len, record_routing=record_routing,
                     kv_cache_tokens=num_seqs * (max_len + 16), max_num_batched_tokens=max(2048, max_len),
                     long_prefill_token_threshold=0, max_request_kv_share=1.0,
                     autocast_dtype="bfloat16" if bf16 else None,
                     cpu_matmul=current_cpu_matmul())  # the run's own choice (train.cpu_matmul), kept


@contextlib.contextmanager
def batch_kv_pool(engine: LLMEngine, num_seqs: int, longest: int, keep: bool = False) -> Iterator[None]:
    """The engine's KV pool for one batch: made with room for `num_seqs` sequences (at most the
    engine's seats) of up to `longest` tokens (at most its max_model_len), so none is preempted,
    and freed when the batch is done, so the trainer's forward and backward passes have its
    memory. `keep` (rl.keep_kv_pool): the engine's pool is used as it is and kept."""
    if keep:
        yield
        return
    num_seqs = min(num_seqs, engine.config.max_num_seqs)
    engine.reserve_kv_cache(batch_kv_tokens(num_seqs, min(longest, engine.max_model_len), engine.config.block_size))
    try:
        yield
    finally:
        engine.release_kv_cache()


def unsharded_replica(policy: nn.Module) -> nn.Module:
    """A plain module of an FSDP-sharded policy's architecture for the engine to run: a ``CausalLM``
    of the policy's config with the same LoRA adapters (so its forward is the trainer's), on the
    policy's device, in eval mode, without gradients. Built on the meta device (no init, no RNG
    drawn); ``EngineSampler.sync_weights`` fills its weights. A tied head stays tied. Costs one full copy of the
    weights per rank (4 bytes a parameter in fp32)."""
    from astrai.model.lora import LoraLinear, apply_lora
    from astrai.model.transformer import CausalLM

    if not isinstance(policy, CausalLM):
        raise TypeError(f"online RL under FSDP generates on an unsharded CausalLM replica of the policy, but the "
                        f"policy is a {type(policy).__name__}; use --parallel_mode ddp for this model")
    replica = CausalLM(policy.config, seed=None, device="meta")
    adapters = {name: m for name, m in policy.named_modules() if isinstance(m, LoraLinear)}
    if adapters:
        first = next(iter(adapters.values()))
        apply_lora(replica, first.r, first.alpha, 0.0, sorted({n.rsplit(".", 1)[-1] for n in adapters}))
    device = next(policy.parameters()).device
    replica = replica.to_empty(device=device)
    # to_empty gives each module its own new tensor, so a tied head comes back as a second
    # parameter that the policy does not have (and copy_full_weights refuses); tie it again
    replica.tie_weights()
    return replica.eval().requires_grad_(False)
