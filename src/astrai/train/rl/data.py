"""Rollout data: the scored samples one rollout hands the trainer, and the operations on them.

Sits between the episode runner (``rl/runner.py``, which packs finished episodes with
``pack_episodes``) and the objectives (``train/objectives``, which pin their targets on a
``Rollout`` and cut it into micro-batches with ``Rollout.rows``). A row is one episode's whole
conversation, right-padded: a sampled token at position p is the label of position p - 1 with the
sampler's log-prob there; prompt, tool, environment and template tokens carry no label. A
single-turn sample is the case of one turn (prompt + completion). ``select_groups`` and
``concat_rollouts`` serve dynamic sampling (DAPO); the loop saves a rollout in checkpoints
through ``state_dict``. With ``routing_replay`` a rollout also carries the experts the sampler
routed each token to, aligned with ``input_ids`` (-1 where none was recorded: padding and each
row's last token), which ``rows`` hands the trainer's forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from astrai.train.losses import IGNORE_INDEX

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
    # (N, T) turn_rewards: each environment step's reward at the label position of its turn's last
    # sampled token (they sum to reward_terms["environment"]); None when per-turn rewards are off
    turn_rewards: Tensor | None = None
    # traced samples' views (train/traces.py), None for the others; not saved in checkpoints
    samples: list[dict[str, Any] | None] = field(default_factory=list)
    # dynamic sampling: the groups it dropped from the draws of this rollout, kept (when they hold
    # traced views) for the traces only, never trained on; not saved in checkpoints
    filtered: list[Rollout] = field(default_factory=list)
    # (N, T, MoE layers, k) int16 routing_replay: each token's experts in the sampler, -1 where unknown
    routing: Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.input_ids.size(0)

    def rows(self, index: Tensor | slice) -> dict[str, Any]:
        """A training batch of some samples, with their pinned targets."""
        batch = {k: getattr(self, k)[index] for k in _TENSORS if k != "rewards"}
        batch.update({k: v[index] for k, v in self.pinned.items()})
        if self.trainer_logps is not None:
            batch["trainer_logps"] = self.trainer_logps[index]
        if self.routing is not None:
            batch["routing"] = self.routing[index]
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
                "trainer_logps": self.trainer_logps, "truncated": self.truncated, "turn_rewards": self.turn_rewards,
                "reward_terms": dict(self.reward_terms), "routing": self.routing}

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
                   truncated=rollout.truncated[rows] if rollout.truncated is not None else None,
                   turn_rewards=rollout.turn_rewards[rows] if rollout.turn_rewards is not None else None,
                   samples=[rollout.samples[i] for i in rows.tolist()] if rollout.samples else [],
                   routing=rollout.routing[rows] if rollout.routing is not None else None)


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
                  truncated=torch.cat([p.truncated for p in parts]) if parts[0].truncated is not None else None,
                  turn_rewards=cat("turn_rewards", 0.0) if parts[0].turn_rewards is not None else None,
                  samples=[v for p in parts for v in (p.samples or [None] * p.num_samples)])
    if parts[0].routing is not None:  # (N, T, L, k): padded along T like the rows
        out.routing = torch.cat([torch.nn.functional.pad(p.routing, (0, 0, 0, 0, 0, T - p.input_ids.size(1)), value=-1)
                                 for p in parts])
    weights = [p.num_samples for p in parts]
    for key in parts[0].stats:
        values = [p.stats.get(key, 0.0) for p in parts]
        rate = key.endswith(("_fraction", "_std", "_per_s", "_per_episode"))
        out.stats[key] = sum(v * w for v, w in zip(values, weights)) / max(sum(weights), 1) if rate else sum(values)
    if "rollout_tokens_per_s" in out.stats:
        out.stats["rollout_tokens_per_s"] = out.stats["rollout_tokens"] / max(out.stats["rollout_seconds"], 1e-9)
    return out


def rollout_signal_stats(rewards: Tensor, finish_reasons: list[str | None]) -> dict[str, float]:
    """What says whether a rollout can teach anything: the share of completions cut off at
    ``rollout_max_tokens`` (finish reason "length"; TRL's completions/clipped_ratio) and the
    share of groups whose rewards are all equal (no advantage; TRL's frac_reward_zero_std)."""
    flat = torch.isclose(rewards, rewards[:, :1]).all(dim=1)  # (B,)
    return {"truncated_fraction": sum(r == "length" for r in finish_reasons) / max(len(finish_reasons), 1),
            "frac_reward_zero_std": flat.float().mean().item()}


def turn_reward_rows(turns: list[list[tuple[int, float]]], shape: torch.Size) -> Tensor:
    """(N, T) per-turn rewards: a reward of the turn whose last sampled token sits at row position p
    goes on label position p - 1 (the position that predicts that token)."""
    out = torch.zeros(shape)
    for i, row in enumerate(turns):
        for position, reward in row:
            out[i, position - 1] += reward
    return out


def pack_episodes(rows: list[tuple[list[int], list[float | None]]], group_size: int, policy_version: int) -> Rollout:
    """Right-padded rows of whole conversations, one per (ids, behaviour log-probs) pair, where a
    log-prob is None on every token the sampler did not draw: a sampled token at position p is
    the label of position p - 1 with its log-prob; prompt, tool, environment and template tokens
    carry none. Rewards are filled in by the caller."""
    T = max(len(ids) for ids, _ in rows)
    N = len(rows)
    input_ids = torch.zeros(N, T, dtype=torch.long)
    attention_mask = torch.zeros(N, T, dtype=torch.long)
    labels = torch.full((N, T), IGNORE_INDEX, dtype=torch.long)
    old_logps = torch.zeros(N, T, dtype=torch.float32)
    for i, (row_ids, row_logps) in enumerate(rows):
        ids = torch.tensor(row_ids)  # (L,)
        lps = torch.tensor([float("nan") if lp is None else lp for lp in row_logps], dtype=torch.float32)  # (L,)
        sampled = ~torch.isnan(lps[1:])  # (L - 1,) whether position p + 1 was sampled
        input_ids[i, :len(ids)], attention_mask[i, :len(ids)] = ids, 1
        labels[i, :len(ids) - 1] = torch.where(sampled, ids[1:], IGNORE_INDEX)
        old_logps[i, :len(ids) - 1] = torch.where(sampled, lps[1:], 0.0)
    return Rollout(input_ids, attention_mask, labels, old_logps, torch.zeros(0), group_size, policy_version)


def routing_rows(routing: list[Tensor | None], width: int) -> Tensor:
    """A rollout's ``routing`` (routing_replay) from each row's recorded experts (tokens, MoE layers,
    k): (N, width, MoE layers, k) int16, -1 after a row's recorded tokens (and for a row without
    any: the trainer's forward routes those tokens itself)."""
    shape = next((r.shape[1:] for r in routing if r is not None), None)
    if shape is None:
        raise ValueError("routing_replay: the sampler recorded no routing for any sample; it needs the in-process "
                         "engine over a mixture-of-experts policy")
    out = torch.full((len(routing), width, *shape), -1, dtype=torch.int16)
    for i, r in enumerate(routing):
        if r is not None:
            out[i, :len(r)] = r[:width]
    return out
