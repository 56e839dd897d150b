"""Pure tensor functions for every loss, advantage and estimator that training uses.

Objectives (`train/objectives/`) turn a batch into model outputs and then call these
functions; nothing else in astrai re-derives this arithmetic. Each function takes tensors and
plain numbers, returns tensors, and has a test against numbers worked out by hand. Per-token
functions return per-token values; reducing them over tokens (sum, then divide by the number
of loss tokens in the whole accumulation window) is the caller's choice, made with
`masked_sum` / `masked_mean` from here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.config_values import CHOICES
from astrai.model.logprobs import selective_log_softmax

IGNORE_INDEX = -100
DPO_LOSS_TYPES = CHOICES["loss_type"]  # the config's closed choices; each is implemented here
KL_ESTIMATORS = CHOICES["kl_estimator"]


# ---------------------------------------------------------------------------------------------
# Masked reductions


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is true (or 1); masked positions never contribute NaN."""
    mask = mask.to(values.dtype)
    # where() rather than multiply, so an inf/NaN in a padded position cannot leak in
    kept = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` over the positions where `mask` is set; 0 where nothing is set."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise `values` to unit variance over the masked positions (PPO advantage whitening).

    Uses the unbiased variance of the masked values; with `shift_mean=False` the mean is added
    back, so only the scale changes.
    """
    mean = masked_mean(values, mask)
    centred = values - mean
    count = mask.to(values.dtype).sum()
    var = masked_sum(centred**2, mask) / (count - 1).clamp(min=1)
    whitened = centred * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


# ---------------------------------------------------------------------------------------------
# Supervised losses


def token_cross_entropy(
    logits: Tensor, labels: Tensor, label_smoothing: float = 0.0, ignore_index: int = IGNORE_INDEX
) -> tuple[Tensor, Tensor]:
    """Next-token cross entropy summed over loss tokens, and the number of loss tokens.

    logits: (B, T, V); labels: (B, T), already shifted (labels[b, t] is the target of
    position t), `ignore_index` where no loss is taken. Returning the sum rather than the mean
    lets the trainer divide by the loss tokens of the whole accumulation window (and of all
    ranks), which makes the gradient independent of how a batch is split into micro-batches.
    With label smoothing eps the per-token loss is (1 - eps) * nll + eps * mean_v(-log p_v).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}; use e.g. 0.1")
    V = logits.size(-1)
    # float32 maths whatever the model dtype: bf16 log-softmax over a large vocab loses the loss
    loss_sum = F.cross_entropy(
        logits.reshape(-1, V).float(),  # (B*T, V)
        labels.reshape(-1),  # (B*T,)
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    num_tokens = (labels != ignore_index).sum()
    return loss_sum, num_tokens


def cross_entropy_from_logps(logps: Tensor, mean_logps: Tensor | None, label_smoothing: float = 0.0) -> Tensor:
    """``token_cross_entropy``'s sum from the loss tokens' log pi(label) (M,) and, with label
    smoothing eps, their mean_v log pi_v (M,): sum of -(1 - eps) * log pi(label) - eps * mean_v log pi_v."""
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}; use e.g. 0.1")
    if not label_smoothing:
        return -logps.sum()
    return -((1 - label_smoothing) * logps + label_smoothing * mean_logps).sum()


def sum_token_logps(token_logps: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """Per-sequence sums (or means, ``average``) (B,) of the loss tokens' log-probs: given (B, T)
    with `mask` (B, T), or the mask's M set tokens row by row (M,)."""
    if token_logps.shape != mask.shape:
        token_logps = token_logps.new_zeros(mask.shape).masked_scatter(mask, token_logps)  # (B, T)
    total = masked_sum(token_logps, mask, dim=-1)  # (B,)
    if not average:
        return total
    return total / mask.sum(dim=-1).clamp(min=1).to(total.dtype)


def sequence_logps(
    logits: Tensor, labels: Tensor, average: bool = False, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Per-sequence log-probability of the labelled tokens: (B,) sums (or means) over loss tokens.

    logits: (B, T, V); labels: (B, T) shifted, `ignore_index` where no loss is taken. This is
    the `logps` that DPO compares; `average=True` gives the per-token mean (IPO's length
    normalisation).
    """
    mask = labels != ignore_index  # (B, T)
    safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
    return sum_token_logps(selective_log_softmax(logits, safe_labels), mask, average)  # (B,)


# ---------------------------------------------------------------------------------------------
# Preference losses


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor | None,
    ref_rejected_logps: Tensor | None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO-family loss per pair, with the implicit rewards: (losses, chosen_rewards, rejected_rewards).

    All inputs are (B,) sequence log-probs. A reference of `None` (or zeros) is the
    reference-free variant. With h = (pi_c - ref_c) - (pi_r - ref_r):
      sigmoid: -(1 - eps) * log sigmoid(beta h) - eps * log sigmoid(-beta h)   (eps = label smoothing)
      ipo:     (h - 1 / (2 beta))^2   (pass per-token mean log-probs for IPO's length normalisation)
      hinge:   relu(1 - beta h)
    Rewards are beta * (policy - reference) log-ratios, detached.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown dpo loss_type {loss_type!r}; expected one of {list(DPO_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"dpo beta must be > 0, got {beta}; the usual value is 0.1")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(
            f"label_smoothing={label_smoothing} only applies to loss_type 'sigmoid', not {loss_type!r}; set it to 0"
        )
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if ref_chosen_logps is None:
        ref_chosen_logps = torch.zeros_like(policy_chosen_logps)
    if ref_rejected_logps is None:
        ref_rejected_logps = torch.zeros_like(policy_rejected_logps)

    chosen_logratios = policy_chosen_logps - ref_chosen_logps  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected_logps  # (B,)
    h = chosen_logratios - rejected_logratios  # (B,)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:  # hinge
        losses = torch.relu(1 - beta * h)
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return losses, chosen_rewards, rejected_rewards


def bradley_terry_loss(chosen_scores: Tensor, rejected_scores: Tensor, margin: Tensor | None = None,
                       center_coef: float = 0.0) -> Tensor:
    """Reward-model loss per pair (B,): -log sigmoid(r_c - r_r - margin), plus TRL's
    ``center_rewards_coefficient`` term center_coef * (r_c + r_r)^2, which keeps scores near 0."""
    diff = chosen_scores - rejected_scores  # (B,)
    if margin is not None:
        diff = diff - margin
    losses = -F.logsigmoid(diff)
    if center_coef:
        losses = losses + center_coef * (chosen_scores + rejected_scores) ** 2
    return losses


def generalized_jsd(student_logps: Tensor, teacher_logps: Tensor, beta: float = 0.5) -> Tensor:
    """Generalized Jensen-Shannon divergence per token (..., V) -> (...), GKD's convention (TRL's
    ``generalized_jsd_loss``): with M = beta * p_teacher + (1 - beta) * p_student,
    beta * KL(teacher || M) + (1 - beta) * KL(student || M); beta = 0 is the forward KL
    KL(teacher || student), beta = 1 the reverse KL KL(student || teacher). Inputs are log-probs."""
    if beta == 0:
        return (teacher_logps.exp() * (teacher_logps - student_logps)).sum(-1)
    if beta == 1:
        return (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)
    mixture = torch.logsumexp(torch.stack([student_logps + math.log(1 - beta), teacher_logps + math.log(beta)]), dim=0)
    kl_teacher = (teacher_logps.exp() * (teacher_logps - mixture)).sum(-1)
    kl_student = (student_logps.exp() * (student_logps - mixture)).sum(-1)
    return beta * kl_teacher + (1 - beta) * kl_student


# ---------------------------------------------------------------------------------------------
# Reinforcement learning


def grpo_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-8,
                    unbiased: bool = False, std_floor: float = 0.0) -> Tensor:
    """Group-relative advantages: each reward minus its group's mean, divided by the group's std.

    rewards: (N,) with N = num_groups * group_size, the completions of one prompt contiguous.
    Default: the population std and eps 1e-8, as the GRPO specification has it; a group whose
    rewards are all equal gets advantage 0. `unbiased=True, eps=1e-4` is TRL's choice.
    `scale=False` (Dr. GRPO) only centres. `std_floor`: a group's std counts as at least this
    (rl.reward_std_floor), so rewards 1e-6 apart get small advantages, not +-1; a group whose std
    is above it divides exactly as without it.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"grpo_advantages got {rewards.numel()} rewards, not a multiple of group_size={group_size}; "
            "pass num_prompts * num_generations rewards"
        )
    if scale and unbiased and group_size < 2:
        raise ValueError("grpo_advantages with an unbiased std needs group_size >= 2 (one sample has no std)")
    grouped = rewards.reshape(-1, group_size).float()  # (G, group_size)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        std = grouped.std(dim=1, keepdim=True, unbiased=unbiased)
        advantages = advantages / ((std.clamp_min(std_floor) if std_floor > 0 else std) + eps)
    return advantages.reshape(-1)  # (N,)


RL_LOSS_AGGREGATIONS = CHOICES["rl_loss_agg"]


def aggregate_token_loss(per_token: Tensor, mask: Tensor, mode: str = "token_mean",
                         max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Reduce a per-token loss (B, T) over the mask into (sum, number of loss units).

    The caller (the gradient-step window) divides the sum of a whole window by its units:
      token_mean:               every response token weighs the same; units = tokens.
      seq_mean:                 each sequence's token mean, then the mean over sequences; units = sequences.
      seq_mean_token_sum_norm:  each sequence's token sum / max_len (Dr. GRPO), mean over sequences.
    A fully masked row contributes 0 to the sum (and, for the seq modes, still counts as a unit).
    """
    mask = mask.to(per_token.dtype)
    if mode == "token_mean":
        return masked_sum(per_token, mask), mask.sum()
    per_seq = masked_sum(per_token, mask, dim=-1)  # (B,)
    if mode == "seq_mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp(min=1)
    elif mode == "seq_mean_token_sum_norm":
        if not max_len or max_len < 1:
            raise ValueError("seq_mean_token_sum_norm needs max_len >= 1 (the rollout's max tokens)")
        per_seq = per_seq / max_len
    else:
        raise ValueError(f"unknown rl_loss_agg {mode!r}; expected one of {list(RL_LOSS_AGGREGATIONS)}")
    return per_seq.sum(), torch.tensor(float(per_token.size(0)), device=per_token.device)


def kl_estimate(logps: Tensor, ref_logps: Tensor, kind: str = "k3+") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With log r = ref_logps - logps:  k1 = -log r,  k2 = (log r)^2 / 2,  k3 = (r - 1) - log r.
    As values, k1 and k3 are unbiased (k1 can be negative, k3 never is) and k2 is biased with low
    variance. As a loss, only k2's expected gradient is the reverse KL's, E[(log pi - log ref)
    grad log pi]: k1's is E[grad log pi] = 0 and k3's is -E_ref[grad log pi], the forward KL's.
    The straight-through ``k1+`` and ``k3+`` take the value of k1 / k3 and the gradient of k2.
    Shapes broadcast; the result has the shape of the inputs.
    """
    if kind in ("k1+", "k3+"):
        value = kl_estimate(logps, ref_logps, kind[:-1])
        if not (torch.is_grad_enabled() and (logps.requires_grad or ref_logps.requires_grad)):
            return value  # a value only (rewards, metrics): exactly k1's / k3's
        surrogate = kl_estimate(logps, ref_logps, "k2")
        return value.detach() + (surrogate - surrogate.detach())  # exactly the value forward: + 0.0
    log_ratio = ref_logps - logps
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {list(KL_ESTIMATORS)}")


def clipped_surrogate(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped policy loss per token, and which tokens the clip was active on.

    logps, old_logps: (B, T) log-probs of the taken tokens under the current and the behaviour
    policy; advantages: (B, T), or (B,) for one advantage per sequence (GRPO). Returns
    (loss, clipped), both (B, T): loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A).
    `clip_eps_high` (default `clip_eps`) allows DAPO's asymmetric clip. `clip_ratio_c` (> 1) is
    dual-clip PPO for negative advantages: the loss is at most -clip_ratio_c * A, so a token whose
    ratio ran far above 1 with A < 0 sends no gradient (verl's name; `clipped` marks it too).
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if advantages.dim() == logps.dim() - 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1): one advantage for every token of a sequence
    ratio = torch.exp(logps - old_logps)  # (B, T)
    unclipped = ratio * advantages
    clipped_obj = torch.clamp(ratio, 1 - clip_eps, 1 + high) * advantages
    loss = -torch.minimum(unclipped, clipped_obj)
    clipped = clipped_obj < unclipped  # the clipped branch won the min
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * advantages  # (B, T) or (B, 1)
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        clipped = clipped | dual
    return loss, clipped


def cispo_loss(logps: Tensor, old_logps: Tensor, advantages: Tensor, clip_eps: float = 0.2,
               clip_eps_high: float | None = None) -> tuple[Tensor, Tensor]:
    """CISPO's policy loss per token (MiniMax-M1), and where the weight was clipped: a REINFORCE
    loss weighted by the clipped, stop-gradient importance ratio,
    loss = -sg(clip(ratio, 1 - eps, 1 + eps_high)) * A * logp. Unlike PPO's clip, a clipped token
    still sends a gradient (its weight is bounded, not its update zeroed). Shapes as
    ``clipped_surrogate``'s."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if advantages.dim() == logps.dim() - 1:
        advantages = advantages.unsqueeze(-1)  # (B, 1)
    ratio = torch.exp(logps - old_logps).detach()  # (B, T)
    weight = torch.clamp(ratio, 1 - clip_eps, 1 + high)
    return -weight * advantages * logps, weight != ratio


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the masked (response) tokens: (advantages, returns).

    rewards, values, mask: (B, T); mask is 1 on the tokens of the trajectory, 0 on prompt and
    padding, and on the gaps of a multi-turn row (tool and environment tokens, which the policy
    did not choose): the trajectory is its masked tokens in order, so V_{t+1} and A_{t+1} are those
    of the next masked token, across a gap. The value after the last masked token is 0 (the
    episode ends there). delta_t = r_t + gamma V_{t+1} - V_t and A_t = delta_t + gamma lam A_{t+1};
    returns = A + V. Both are 0 outside the mask.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    T = rewards.size(-1)
    advantages = torch.zeros_like(values)
    next_adv = torch.zeros_like(values[..., 0])  # (B,)
    next_value = torch.zeros_like(values[..., 0])  # (B,)
    for t in reversed(range(T)):
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        adv_t = (delta + gamma * lam * next_adv) * mask[..., t]
        advantages[..., t] = adv_t
        # an unmasked position is skipped: the next masked token's value and advantage carry over
        # it (a single-span row is unchanged: nothing before its span reads them)
        keep = mask[..., t].bool()
        next_adv = torch.where(keep, adv_t, next_adv)
        next_value = torch.where(keep, values[..., t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, clip_eps: float | None = 0.2, coef: float = 0.5
) -> tuple[Tensor, Tensor]:
    """Critic loss per token, and which tokens the clip was active on.

    values: (B, T) current predictions; old_values: (B, T) predictions at rollout time;
    returns: (B, T) targets. Unclipped: coef (V - R)^2. Clipped (PPO): coef max((V - R)^2,
    (V_old + clip(V - V_old, -eps, eps) - R)^2); `clip_eps=None` turns clipping off. `coef` is
    0.5 by convention; astrai's online PPO uses 1 (its ppo_vf_coef multiplies (V - R)^2).
    """
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return coef * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    values_clipped = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    clipped = (values_clipped - returns) ** 2
    return coef * torch.maximum(unclipped, clipped), clipped > unclipped


def token_rewards(scores: Tensor, mask: Tensor, logps: Tensor | None = None, ref_logps: Tensor | None = None,
                  kl_coef: float = 0.0, kl_kind: str = "k1") -> Tensor:
    """PPO's per-token rewards (B, T): the sequence score on the last masked token of each row and,
    with a reference, - kl_coef * KL_t on every masked token (KL_t by `kl_kind`, see ``kl_estimate``;
    k1 is the plain log-ratio logps - ref_logps) on every masked
    token. scores: (B,); mask: (B, T), one contiguous span per row; 0 outside the mask."""
    mask = mask.to(torch.float32)
    rewards = torch.zeros_like(mask)
    if kl_coef and logps is not None and ref_logps is not None:
        rewards = -kl_coef * kl_estimate(logps.float(), ref_logps.float(), kl_kind) * mask
    positions = torch.arange(mask.size(1), device=mask.device)
    last = torch.where(mask.bool(), positions, -1).max(dim=1).values  # (B,), -1 for an empty row
    has = last >= 0
    rewards[has, last[has]] += scores.float()[has]
    return rewards


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(R - V) / max(Var(R), 1e-8) over the masked tokens (population variances)."""
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    return 1 - var_d / var_r.clamp(min=1e-8)


def importance_weights(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor, level: str = "token",
                       cap: float = 2.0, mode: str = "truncate", low: float | None = None) -> tuple[Tensor, Tensor]:
    """Importance sampling for the sampler-trainer mismatch: (weights, capped), (B, T).

    The samples were drawn by the engine (pi_sampler) but the ratio is taken against the trainer's
    own log-probs at the same weights (pi_trainer_old); where the two differ (bf16, kernels), each
    token's loss is weighted by w = min(pi_trainer_old / pi_sampler, cap) (level "token"), or every
    token of a sample by w = min(exp(sum over its tokens of log(pi_trainer_old / pi_sampler)), cap)
    (level "sequence"); level "none" gives ones. Mode "mask" (TRL's default) keeps the weight
    w = pi_trainer_old / pi_sampler where low <= w <= cap and zeroes the token (or the sample) where
    it leaves that band (low None: 1 / cap), so a token the sampler and trainer disagree on carries
    no loss instead of a capped one; `capped` is then where it left the band. Weights are
    detached; 0 outside the mask.
    """
    mask = mask.bool()
    if level == "none":
        return mask.float(), torch.zeros_like(mask)
    log_ratio = torch.where(mask, (trainer_logps - sampler_logps).detach().float(), 0.0)  # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"unknown rollout_is_level {level!r}; expected none, token or sequence")
    raw = log_ratio.exp()
    if mode == "mask":
        out = ((raw > cap) | (raw < (1 / cap if low is None else low))) & mask
        return torch.where(mask & ~out, raw, 0.0), out
    if mode != "truncate":
        raise ValueError(f"unknown rollout_is_mode {mode!r}; expected truncate or mask")
    capped = (raw > cap) & mask
    return torch.where(mask, raw.clamp(max=cap), 0.0), capped


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each position's distribution, (..., V) -> (...), float32, no gradient."""
    logits = logits.detach().float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the *other* rewards of its group (leave one out).

    rewards: (N,) with groups of `group_size` contiguous -> (N,) float32. Equals
    group_size / (group_size - 1) * (r_i - mean(r)); a group whose rewards are all equal gets 0.
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rloo_advantages needs group_size >= 2 and a multiple of it, got {rewards.numel()} rewards "
                         f"with group_size={group_size}; set --group_size 2 or more")
    grouped = rewards.reshape(-1, group_size).float()  # (G, group_size)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1)


def reward_to_go(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Per-token returns G_t = sum_{s >= t} gamma^(k(s) - k(t)) r_s over each row's masked tokens,
    (B, T), k counting masked tokens; 0 outside the mask. REINFORCE++ (with the KL folded into the
    per-token rewards). As in ``gae``, the trajectory is the row's masked tokens in order: an
    unmasked gap of a multi-turn row (tool and environment tokens) is skipped, so the episode's
    final reward reaches every earlier turn; rewards outside the mask are ignored."""
    mask = mask.to(torch.float32)
    returns = torch.zeros_like(mask)
    running = torch.zeros(mask.size(0), device=mask.device)
    for t in range(mask.size(1) - 1, -1, -1):
        keep = mask[:, t].bool()
        running = torch.where(keep, rewards[:, t].float() + gamma * running, running)
        returns[:, t] = running * mask[:, t]
    return returns


def whiten_with_sums(values: Tensor, mask: Tensor, all_reduce: Any = None, eps: float = 1e-8) -> Tensor:
    """(values - mean) / std over every masked position of the whole batch, all ranks included
    when `all_reduce` sums a tensor over them (REINFORCE++'s batch normalisation); population
    variance; 0 outside the mask."""
    mask = mask.to(torch.float32)
    sums = torch.stack([(values * mask).sum(), (values**2 * mask).sum(), mask.sum()])
    if all_reduce is not None:
        sums = all_reduce(sums)
    count = sums[2].clamp(min=1)
    mean = sums[0] / count
    var = (sums[1] / count - mean**2).clamp(min=0)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def sequence_token_log_ratio(logps: Tensor, old_logps: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token's log ratio per token, (B, T): the value of the sample's ``sequence_log_ratio`` on
    every token, the gradient of that token's own log-prob (log s_i,t = sg[log s_i] + log pi_t -
    sg[log pi_t]), so that a per-token advantage weighs its own token; with one advantage per
    sample its gradient is GSPO's."""
    seq = sequence_log_ratio(logps.detach(), old_logps, mask)  # (B, 1)
    return seq + (logps - logps.detach())


def sequence_log_ratio(logps: Tensor, old_logps: Tensor, mask: Tensor) -> Tensor:
    """GSPO's sequence-level log importance ratio: the mean over a sample's masked tokens of
    log(pi / pi_old), (B, T) -> (B, 1), with gradients through every token's log-prob."""
    mask = mask.to(logps.dtype)
    return ((logps - old_logps) * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1)
