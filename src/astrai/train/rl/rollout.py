"""Rollouts on the live policy: prompts -> the paged-KV engine -> scored, padded training rows.

The one bridge from training to inference (the only module of ``astrai.train`` that imports
``astrai.infer``). ``RolloutRunner`` keeps an ``LLMEngine`` over the live training module (no
copy of the weights; under FSDP over an unsharded replica instead, see ``unsharded_replica``);
per prompt it asks for ``group_size`` samples that share one prefill, with
a seed derived from (random_seed, step, prompt index) so a rollout is reproducible, and the
engine's behaviour log-probs (the sampler's, under the rollout temperature). Completions are
scored by the ``RewardSet`` and packed into a ``Rollout``: right-padded prompt + response rows,
labels on the response tokens only, the sampler's log-probs at the same positions, rewards
(B, G) and the policy version the samples came from. The loop publishes each new policy version
to the engine, whose prefix cache is keyed by version, so KV of older weights is never reused.
The engine's KV pool exists only while a rollout is drawn (``batch_kv_pool``): made for that
rollout's sequences at the longest length they can reach, and freed before the rewards and the
trainer run; ``keep_kv_pool`` keeps one pool, sized at the start, for the whole run instead.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from astrai.config import RLConfig
from astrai.config_values import default_max_prompt_len
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.infer.sizing import batch_kv_tokens
from astrai.model.matmul import current_cpu_matmul
from astrai.train import dist
from astrai.train.losses import IGNORE_INDEX
from astrai.train.rl.environments import Episode, MultiTurn, episode_stats
from astrai.train.rl.rewards import RewardSet

_TENSORS = ("input_ids", "attention_mask", "labels", "old_logps", "rewards")


@dataclass
class Rollout:
    """One rollout: N = num_prompts * group_size samples, rows right-padded to one length T."""

    input_ids: Tensor  # (N, T) prompt + response tokens, 0 after the end
    attention_mask: Tensor  # (N, T) 1 on prompt and response tokens
    labels: Tensor  # (N, T) next-token targets: the response tokens, IGNORE_INDEX elsewhere
    old_logps: Tensor  # (N, T) the sampler's log-prob of each label (0 where no label)
    rewards: Tensor  # (B, G) weighted reward per sample
    group_size: int
    policy_version: int  # the weights the samples were drawn from
    texts: list[str] = field(default_factory=list)  # N completions
    reward_terms: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, G)
    stats: dict[str, float] = field(default_factory=dict)
    pinned: dict[str, Tensor] = field(default_factory=dict)  # per-sample targets fixed once (advantages)
    pairs: Tensor | None = None  # (P, 2) chosen / rejected sample indices (online DPO)
    # (N, T) the trainer's log-probs at the rollout's weights (the ratio's old log-probs), known
    # after the first step on it (NaN before); None for objectives that do not use them
    trainer_logps: Tensor | None = None
    truncated: Tensor | None = None  # (N,) bool: the completion hit rollout_max_tokens without ending
    num_uses: int = 0  # optimizer steps taken on it so far

    @property
    def num_samples(self) -> int:
        return self.input_ids.size(0)

    def rows(self, index: Tensor | slice) -> dict[str, Any]:
        """A training batch of some samples, with their pinned targets."""
        batch = {k: getattr(self, k)[index] for k in _TENSORS if k != "rewards"}
        batch.update({k: v[index] for k, v in self.pinned.items()})
        if self.trainer_logps is not None:
            batch["trainer_logps"] = self.trainer_logps[index]
        batch["sample_index"] = torch.arange(self.num_samples)[index]  # where the loop stores a batch's pins
        return batch

    def pin(self, sample_index: Tensor, pins: dict[str, Tensor]) -> None:
        """Store per-sample values (rows of `sample_index`) computed on a step, for the steps that
        reuse this rollout."""
        for key, value in pins.items():
            stored = getattr(self, key)
            stored[sample_index.cpu()] = value.detach().cpu().to(stored.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in _TENSORS}, "group_size": self.group_size,
                "policy_version": self.policy_version, "num_uses": self.num_uses, "texts": list(self.texts),
                "stats": dict(self.stats), "pinned": dict(self.pinned), "pairs": self.pairs,
                "trainer_logps": self.trainer_logps, "truncated": self.truncated,
                "reward_terms": dict(self.reward_terms)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Rollout:
        return cls(**state)


def groups_with_signal(rollout: Rollout) -> Tensor:
    """(B,) bool: the groups whose rewards are not all equal (they give a non-zero advantage)."""
    return ~torch.isclose(rollout.rewards, rollout.rewards[:, :1]).all(dim=1)


def select_groups(rollout: Rollout, groups: Tensor) -> Rollout:
    """The rollout restricted to some of its prompt groups (group indices (K,)), samples in order."""
    G = rollout.group_size
    rows = (groups[:, None] * G + torch.arange(G)[None]).reshape(-1)  # (K * G,)
    return Rollout(rollout.input_ids[rows], rollout.attention_mask[rows], rollout.labels[rows],
                   rollout.old_logps[rows], rollout.rewards[groups], G, rollout.policy_version,
                   texts=[rollout.texts[i] for i in rows.tolist()],
                   reward_terms={k: v[groups] for k, v in rollout.reward_terms.items()},
                   stats=dict(rollout.stats),
                   truncated=rollout.truncated[rows] if rollout.truncated is not None else None)


def concat_rollouts(parts: list[Rollout]) -> Rollout:
    """One rollout of several drawn at the same policy version, rows right-padded to one length;
    counters in ``stats`` are summed, rates recomputed as means weighted by sample counts."""
    T = max(p.input_ids.size(1) for p in parts)

    def cat(name: str, pad: float) -> Tensor:
        return torch.cat([torch.nn.functional.pad(getattr(p, name), (0, T - p.input_ids.size(1)), value=pad)
                          for p in parts])

    out = Rollout(cat("input_ids", 0), cat("attention_mask", 0), cat("labels", IGNORE_INDEX), cat("old_logps", 0.0),
                  torch.cat([p.rewards for p in parts]), parts[0].group_size, parts[0].policy_version,
                  texts=[t for p in parts for t in p.texts],
                  reward_terms={k: torch.cat([p.reward_terms[k] for p in parts]) for k in parts[0].reward_terms},
                  truncated=torch.cat([p.truncated for p in parts]) if parts[0].truncated is not None else None)
    weights = [p.num_samples for p in parts]
    for key in parts[0].stats:
        values = [p.stats.get(key, 0.0) for p in parts]
        rate = key.endswith(("_fraction", "_std", "_per_s", "_per_episode"))
        out.stats[key] = sum(v * w for v, w in zip(values, weights)) / max(sum(weights), 1) if rate else sum(values)
    if "rollout_tokens_per_s" in out.stats:
        out.stats["rollout_tokens_per_s"] = out.stats["rollout_tokens"] / max(out.stats["rollout_seconds"], 1e-9)
    return out


def rollout_seed(random_seed: int, step: int, prompt_index: int, *more: int) -> int:
    """A reproducible 63-bit sampling seed per (run seed, step, prompt[, sample, turn])."""
    return hash((random_seed, step, prompt_index, *more)) & ((1 << 63) - 1)


class RolloutRunner:
    """Generates and scores rollouts with the live policy module (FSDP: with its replica)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: RLConfig, num_prompts: int, rewards: RewardSet,
                 random_seed: int = 0, bf16: bool = False):
        self.cfg, self.rewards, self.random_seed, self.tokenizer = cfg, rewards, random_seed, tokenizer
        # the Python API may hand an unresolved RLConfig: None is what build_run would fill in
        self.max_prompt_len = cfg.max_prompt_len or default_max_prompt_len(
            cfg.rollout_max_tokens, model.config.max_position_embeddings)
        max_len = self.max_prompt_len + cfg.rollout_max_tokens
        # multi-turn (an environment or tools): each turn adds at most rollout_max_tokens sampled
        # tokens and its tool / environment messages are budgeted like a prompt (max_prompt_len),
        # capped by the model's positions; the KV pool below is sized for episodes of that length
        self.multi_turn = None
        if cfg.environment or cfg.tools:
            max_len = min(model.config.max_position_embeddings,
                          self.max_prompt_len + cfg.max_turns * (cfg.rollout_max_tokens + self.max_prompt_len))
            self.multi_turn = MultiTurn(tokenizer, cfg.environment, list(cfg.tools), cfg.max_turns,
                                        cfg.rollout_max_tokens, max_len)
        num_seqs = max(1, num_prompts * cfg.group_size)
        # FSDP: every forward of the sharded module all-gathers its weights, a collective; ranks
        # whose samples end at different lengths take different numbers of engine steps and would
        # wait for each other forever. The engine runs a plain replica, refreshed per policy version
        self.policy = model
        self.replica = unsharded_replica(model) if dist.is_fsdp(model) else None
        self.replica_version: int | None = None  # the policy version the replica's weights are
        self.engine = batch_engine(self.replica or model, tokenizer, num_seqs, max_len, bf16)
        if not cfg.keep_kv_pool:
            self.engine.release_kv_cache()  # made for each rollout (batch_kv_pool)
        self.num_skipped_total = 0  # prompts over max_prompt_len, this rank, whole run (warned once)
        self.shortest_skipped: int | None = None  # the shortest of them: the max_prompt_len that keeps one

    def set_policy_version(self, version: int) -> None:
        self.engine.set_policy_version(version)  # monotonic; older prefixes are never served again

    def refresh_replica(self, policy_version: int) -> None:
        """FSDP: the replica takes the policy's full weights, once per policy version. Gathering
        them is a collective, so every rank calls this at the same point (before a fresh rollout);
        a no-op when the engine runs the live module (one rank, DDP) or the version is current."""
        if self.replica is None or self.replica_version == policy_version:
            return
        dist.copy_full_weights(self.policy, self.replica)
        self.replica_version = policy_version

    def generate(self, batch: dict[str, list[Any]], step: int, policy_version: int,
                 first_index: int = 0) -> Rollout | None:
        """Sample, score and pack a rollout for one batch of prompt records; None when every
        prompt was too long. Prompts over max_prompt_len are skipped and counted. `first_index`
        numbers this rank's prompts within the step (seeds differ across ranks)."""
        cfg, G = self.cfg, self.cfg.group_size
        if self.replica is not None and self.replica_version != policy_version:
            raise ValueError(f"the engine's replica holds the weights of policy version {self.replica_version}, "
                             f"not {policy_version}; call refresh_replica({policy_version}) on every rank first")
        keep = [i for i, ids in enumerate(batch["prompt_ids"]) if len(ids) <= self.max_prompt_len]
        skipped = len(batch["prompt_ids"]) - len(keep)
        if skipped:
            self._count_skipped(step, [len(ids) for ids in batch["prompt_ids"] if len(ids) > self.max_prompt_len])
        if not keep:
            return None
        if self.multi_turn is not None:
            return self._generate_episodes(batch, keep, skipped, step, policy_version, first_index)
        prompts = [list(batch["prompt_ids"][i]) for i in keep]
        params = [SamplingParams(temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
                                 max_tokens=cfg.rollout_max_tokens, n=G, seed=rollout_seed(self.random_seed, step, first_index + i))
                  for i in keep]
        start = time.perf_counter()
        longest = max(len(p) for p in prompts) + cfg.rollout_max_tokens
        with batch_kv_pool(self.engine, len(prompts) * G, longest, keep=cfg.keep_kv_pool):
            outputs = self.engine.run_batch(prompts, params, return_logprobs=True)
        seconds = time.perf_counter() - start
        drawn = {out.policy_version for out in outputs}
        if drawn != {policy_version}:
            raise ValueError(f"rollout for policy version {policy_version} was generated at version(s) {sorted(drawn)}; "
                             "publish each new version to the engine before generating")
        samples = [(p, c) for p, out in zip(prompts, outputs) for c in out.outputs]  # N = B * G, groups contiguous
        records = [{"messages": batch["messages"][i], "answer": batch["answer"][i],
                    **dict(batch["metadata"][i] or {})} for i in keep for _ in range(G)]
        prompt_texts = [self.tokenizer.decode(p) for p, _ in samples]
        texts = [c.text for _, c in samples]
        total, terms = self.rewards(prompt_texts, texts, records, [p + c.token_ids for p, c in samples], G,
                                    completion_ids=[list(c.token_ids) for _, c in samples])
        rollout = _pack(samples, G, policy_version)
        rollout.rewards = total.view(-1, G)
        rollout.reward_terms = {k: v.view(-1, G) for k, v in terms.items()}
        rollout.texts = texts
        rollout.truncated = torch.tensor([c.finish_reason == "length" for _, c in samples])
        num_new = int(sum(len(c.token_ids) for _, c in samples))
        rollout.stats = {"rollout_seconds": seconds, "rollout_tokens": float(num_new),
                         "rollout_tokens_per_s": num_new / max(seconds, 1e-9), "skipped_prompts": float(skipped),
                         **rollout_signal_stats(rollout.rewards, [c.finish_reason for _, c in samples])}
        return rollout

    def _generate_episodes(self, batch: dict[str, list[Any]], keep: list[int], skipped: int, step: int,
                           policy_version: int, first_index: int) -> Rollout:
        """Multi-turn rollout (``rl/environments.py``): every sample an episode of up to
        ``max_turns`` assistant turns, all episodes' turns sampled together on the engine; the
        row is the final conversation's ids, labels and behaviour log-probs on sampled tokens only.
        Seeds: the first turn's G samples share one request per prompt (as a single-turn rollout),
        later turns one per (prompt, sample, turn)."""
        cfg, G, mt = self.cfg, self.cfg.group_size, self.multi_turn
        start = time.perf_counter()
        records = [{"messages": batch["messages"][i], "answer": batch["answer"][i],
                    **dict(batch["metadata"][i] or {})} for i in keep]
        mt.stats = {"tool_seconds": 0.0, "env_seconds": 0.0}
        episodes = mt.open(records, G)
        room = self.engine.config.max_model_len - cfg.rollout_max_tokens
        if (longest := max(len(e.ids) for e in episodes)) > room:
            raise ValueError(f"an episode's opening prompt has {longest} tokens (tools and environment included), more "
                             f"than the {room} an episode's length ({self.engine.config.max_model_len}: "
                             "max_position_embeddings, or max_prompt_len + max_turns * (rollout_max_tokens + "
                             f"max_prompt_len)) leaves beside rollout_max_tokens={cfg.rollout_max_tokens}; shorten the "
                             "prompts or tool descriptions, or raise --max_prompt_len")
        self.generation_seconds = 0.0
        # a turn continues its conversation's cached KV, so one pool serves every turn; an
        # episode's row can reach the engine's max_model_len (tool messages have no other bound)
        with batch_kv_pool(self.engine, len(episodes), self.engine.max_model_len, keep=cfg.keep_kv_pool):
            mt.run(episodes, lambda active, turn: self._sample_turn(active, turn, step, policy_version, first_index))
        rollout = _pack_episodes(episodes, G, policy_version)
        total, terms = self._score_episodes(episodes, records)
        rollout.rewards, rollout.reward_terms = total.view(-1, G), {k: v.view(-1, G) for k, v in terms.items()}
        rollout.texts = [e.final_text for e in episodes]
        rollout.truncated = torch.tensor([e.truncated or e.finish_reason == "length" for e in episodes])
        seconds = time.perf_counter() - start
        num_new = sum(lp is not None for e in episodes for lp in e.logps)
        rollout.stats = {"rollout_seconds": seconds, "rollout_tokens": float(num_new),
                         "rollout_tokens_per_s": num_new / max(seconds, 1e-9), "skipped_prompts": float(skipped),
                         "generation_seconds": self.generation_seconds,
                         **rollout_signal_stats(rollout.rewards, ["length" if t else "stop" for t in rollout.truncated]),
                         **episode_stats(episodes, mt.stats["tool_seconds"], mt.stats["env_seconds"])}
        return rollout

    def _sample_turn(self, active: list[Episode], turn: int, step: int, policy_version: int,
                     first_index: int) -> list[tuple[Any, int]]:
        """One turn of the unfinished episodes on the engine: (completion, prefill tokens) each.
        The first turn's samples of one prompt share a request (n = G, one prefill); later turns
        are one request per (prompt, sample, turn), seeded by all three."""
        cfg = self.cfg
        requests: dict[tuple, list[int]] = {}  # (prompt, ids) or (prompt, sample) -> indices into active
        for j, e in enumerate(active):
            key = (e.prompt_index, tuple(e.ids)) if turn == 0 else (e.prompt_index, e.sample)
            requests.setdefault(key, []).append(j)
        keys = list(requests)
        params = [SamplingParams(temperature=cfg.rollout_temperature, top_p=cfg.rollout_top_p, top_k=cfg.rollout_top_k,
                                 max_tokens=cfg.rollout_max_tokens, n=len(requests[k]),
                                 seed=rollout_seed(self.random_seed, step, first_index + k[0]) if turn == 0 else
                                 rollout_seed(self.random_seed, step, first_index + k[0], k[1], turn))
                  for k in keys]
        start = time.perf_counter()
        outputs = self.engine.run_batch([list(active[requests[k][0]].ids) for k in keys], params, return_logprobs=True)
        self.generation_seconds += time.perf_counter() - start
        if {out.policy_version for out in outputs} != {policy_version}:
            raise ValueError(f"a turn of a rollout for policy version {policy_version} was generated at another "
                             "version; publish each new version to the engine before generating")
        results: list[Any] = [None] * len(active)
        for k, out in zip(keys, outputs):
            for j, completion in zip(requests[k], out.outputs):
                results[j] = (completion, len(out.prompt_token_ids) - out.num_cached_tokens)
        return results

    def _score_episodes(self, episodes: list[Episode], records: list[dict[str, Any]]) -> tuple[Tensor, dict[str, Tensor]]:
        """Episode reward: the environment's (summed over its steps) plus the configured rewards
        on the final assistant turn."""
        G = self.cfg.group_size
        env = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
        terms: dict[str, Tensor] = {}
        total = torch.zeros(len(episodes))
        if self.rewards.names:
            total, terms = self.rewards([self.tokenizer.decode(e.ids[:e.num_prompt_ids]) for e in episodes],
                                        [e.final_text for e in episodes], [records[e.prompt_index] for e in episodes],
                                        [list(e.ids) for e in episodes], G,
                                        completion_ids=[list(e.final_ids) for e in episodes])
        if self.multi_turn.env_cls is not None:
            terms["environment"] = env
        return total + env, terms

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


def batch_engine(model: nn.Module, tokenizer: Any, num_seqs: int, max_len: int, bf16: bool) -> LLMEngine:
    """An engine over a live module for whole batches (rollouts, held-out evaluation): room for
    `num_seqs` sequences at `max_len` (no preemption inside a batch, so no request needs a cap on
    its share of the pool), throughput first (nobody streams a rollout: no per-step prefill cap).
    `bf16` (the run's train.bf16): samples in the trainer's precision, the same autocast over a
    bf16 KV pool."""
    return LLMEngine(model, tokenizer, max_num_seqs=num_seqs, max_model_len=max_len,
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
    drawn); ``RolloutRunner.refresh_replica`` fills its weights. Costs one full copy of the
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
    return replica.to_empty(device=device).eval().requires_grad_(False)


def rollout_signal_stats(rewards: Tensor, finish_reasons: list[str | None]) -> dict[str, float]:
    """What says whether a rollout can teach anything: the share of completions cut off at
    ``rollout_max_tokens`` (finish reason "length"; TRL's completions/clipped_ratio) and the
    share of groups whose rewards are all equal (no advantage; TRL's frac_reward_zero_std)."""
    flat = torch.isclose(rewards, rewards[:, :1]).all(dim=1)  # (B,)
    return {"truncated_fraction": sum(r == "length" for r in finish_reasons) / max(len(finish_reasons), 1),
            "frac_reward_zero_std": flat.float().mean().item()}


def _pack_episodes(episodes: list[Episode], group_size: int, policy_version: int) -> Rollout:
    """Right-padded rows of whole conversations: a sampled token at position p is the label of
    position p - 1 with its behaviour log-prob; prompt, tool, environment and template tokens
    carry none."""
    T = max(len(e.ids) for e in episodes)
    N = len(episodes)
    input_ids = torch.zeros(N, T, dtype=torch.long)
    attention_mask = torch.zeros(N, T, dtype=torch.long)
    labels = torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
    old_logps = torch.zeros(N, T, dtype=torch.float32)
    for i, e in enumerate(episodes):
        ids = torch.tensor(e.ids)  # (L,)
        lps = torch.tensor([float("nan") if lp is None else lp for lp in e.logps], dtype=torch.float32)  # (L,)
        sampled = ~torch.isnan(lps[1:])  # (L - 1,) whether position p + 1 was sampled
        input_ids[i, :len(ids)], attention_mask[i, :len(ids)] = ids, 1
        labels[i, :len(ids) - 1] = torch.where(sampled, ids[1:], IGNORE_INDEX)
        old_logps[i, :len(ids) - 1] = torch.where(sampled, lps[1:], 0.0)
    return Rollout(input_ids, attention_mask, labels, old_logps, torch.zeros(0), group_size, policy_version)


def _pack(samples: list[tuple[list[int], Any]], group_size: int, policy_version: int) -> Rollout:
    """Right-padded rows: response token j (at position P + j) is the label of position P + j - 1."""
    T = max(len(p) + len(c.token_ids) for p, c in samples)
    N = len(samples)
    input_ids = torch.zeros(N, T, dtype=torch.long)
    attention_mask = torch.zeros(N, T, dtype=torch.long)
    labels = torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
    old_logps = torch.zeros(N, T, dtype=torch.float32)
    for i, (prompt, completion) in enumerate(samples):
        P, R = len(prompt), len(completion.token_ids)
        if R and len(completion.logprobs or []) != R:
            raise ValueError(f"sample {i} has {R} tokens but {len(completion.logprobs or [])} behaviour log-probs")
        input_ids[i, :P + R] = torch.tensor(prompt + list(completion.token_ids))
        attention_mask[i, :P + R] = 1
        if R:
            labels[i, P - 1:P + R - 1] = torch.tensor(completion.token_ids)
            old_logps[i, P - 1:P + R - 1] = torch.tensor(completion.logprobs, dtype=torch.float32)
    return Rollout(input_ids, attention_mask, labels, old_logps, torch.zeros(0), group_size, policy_version)
