"""Objectives on the chunked lm head and padding-free micro-batches equal the padded full-logits path.

The reference is the path before the chunked head, written out here: the model's full logits at
the labelled positions, ``truncated_token_logps`` / ``selective_log_softmax`` / ``token_entropy``
on them, every micro-batch at the rollout's width. Each rollout objective runs one step's
micro-batches under that reference and under every row layout (pad, sort, pack, share), on
rollouts whose groups have distinct prompts and on ones whose samples share their group's prompt
(as GRPO's do, which ``share`` computes once); the loss sum, every gradient, the metrics and the
pins agree to 1e-6 (gradients: of their largest entry).
SFT and DPO are checked against their losses on full logits.
"""

from __future__ import annotations

import pytest
import torch

from astrai.config import load_config
from astrai.model.config import ModelConfig
from astrai.model.logprobs import selective_log_softmax, truncated_token_logps
from astrai.model.transformer import CausalLM
from astrai.train.losses import dpo_loss, sequence_logps, token_cross_entropy, token_entropy
from astrai.train.objectives import OBJECTIVES
from astrai.train.objectives.base import labelled_positions
from astrai.train.objectives.logps import PolicyLogps
from astrai.train.objectives.packing import MIN_SHARED_PREFIX, RowLayout, first_fit_decreasing, prefix_trees
from astrai.train.rl.data import Rollout
from tests.train.resume_data import MODEL
from tests.train.trainer_utils import dpo_with_a_moved_reference

V = MODEL["vocab_size"]


def assert_grad_close(a, b):
    scale = max(1.0, b.abs().max().item())
    assert (a - b).abs().max().item() <= 1e-6 * scale, ((a - b).abs().max().item(), scale)


def make_rollout(prompt_lens, response_lens, group_size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N, T = len(prompt_lens), max(p + r for p, r in zip(prompt_lens, response_lens, strict=True))
    ids, att = torch.zeros(N, T, dtype=torch.long), torch.zeros(N, T, dtype=torch.long)
    labels = torch.full((N, T), -100)
    for i, (P, R) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        ids[i, :P + R] = torch.randint(3, V, (P + R,), generator=gen)
        att[i, :P + R] = 1
        labels[i, P - 1:P + R - 1] = ids[i, P:P + R]
    old = torch.where(labels != -100, -torch.rand(N, T, generator=gen) * 3, 0.0)
    rewards = torch.rand(N // group_size, group_size, generator=gen)
    return Rollout(ids, att, labels, old, rewards, group_size, 0, truncated=torch.zeros(N, dtype=torch.bool))


PROMPTS, RESPONSES = [3, 5, 4, 6, 2, 7, 3, 5], [9, 1, 4, 2, 6, 3, 8, 1]
SHARED_PROMPTS = [10] * 4 + [12] * 4


def shared_prompt_rollout(prompt_lens=SHARED_PROMPTS, response_lens=RESPONSES, group_size=4, seed=0):
    """make_rollout, with every sample of a group starting with its group's prompt (as GRPO's do)."""
    rollout = make_rollout(prompt_lens, response_lens, group_size, seed)
    for first in range(0, len(prompt_lens), group_size):
        P = prompt_lens[first]
        rollout.input_ids[first:first + group_size, :P] = rollout.input_ids[first, :P]
    return rollout


def old_logps(rl):
    """token_logps before the chunked head and the row layouts: full logits, padded rows."""
    def logps(model, batch, entropy=False):
        labels, att = batch["labels"], batch["attention_mask"]
        idx = labelled_positions(labels)
        out = model(batch["input_ids"], attention_mask=att, logits_indices=idx)  # (B, K, V)
        assert out.logits is not None
        lab = labels if idx is None else labels[:, idx]
        mask = lab != -100
        targets = torch.where(mask, lab, torch.zeros_like(lab))
        if rl.rollout_temperature > 0:
            lp = truncated_token_logps(out.logits.float() / rl.rollout_temperature, targets,
                                       rl.rollout_top_k, rl.rollout_top_p)
        else:
            lp = selective_log_softmax(out.logits.float(), targets)
        scale = rl.rollout_temperature if rl.rollout_temperature > 0 else 1.0
        ent = token_entropy(out.logits.float() / scale) if entropy else None
        return PolicyLogps(lp, mask, idx, ent, out.aux_loss, out.router_stats,
                           RowLayout.build(att, labels != -100, "pad"))
    return logps


def one_step(objective, model, rollout, layout):
    """Loss sum, gradients, metric sums and pins of one step's micro-batches in `layout`."""
    params = [p for p in model.parameters() if p.requires_grad]
    params += [p for c in objective.companions for p in c.module.parameters()] if objective.companions else []
    if hasattr(objective, "critic"):
        params += list(objective.critic.parameters())
    if layout == "old":
        objective.logps = old_logps(objective.rl)
        objective.layout = "pad"
    else:
        objective.__dict__.pop("logps", None)
        objective.layout = layout
    total, metrics, pins = 0.0, {}, {}
    for batch in objective.batches(rollout, 3):
        out = objective(model, batch)
        total = total + out.loss
        for k, v in out.metrics.items():
            metrics[k] = metrics.get(k, 0.0) + v.detach()
        mask = batch["labels"] != -100
        for k, v in out.pins.items():
            for row, sample in enumerate(batch["sample_index"].tolist()):
                pins[(k, sample)] = v[row][mask[row]].detach()
    grads = torch.autograd.grad(total, params)
    return total.detach(), grads, metrics, pins


SETTINGS = {
    "grpo_plain": ("online_grpo", []),
    "grpo_truncated_kl": ("online_grpo", ["--rollout_temperature", "0.8", "--rollout_top_k", "20",
                                          "--rollout_top_p", "0.9", "--kl_coef", "0.1"]),
    "gspo_seq_mean": ("online_grpo", ["--importance_sampling_level", "sequence", "--rl_loss_agg", "seq_mean",
                                      "--rollout_temperature", "0.7"]),
    "greedy": ("online_grpo", ["--rollout_temperature", "0"]),
    "reinforce_pp": ("online_grpo", ["--advantage_estimator", "reinforce_pp", "--kl_coef", "0.05"]),
    "offline_grpo": ("grpo", ["--rollout_top_p", "0.8"]),
    "ppo": ("online_ppo", ["--kl_coef", "0.05", "--rollout_top_k", "30"]),
}


@pytest.mark.parametrize("shared", [False, True], ids=["distinct_prompts", "shared_prompts"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_rollout_objectives_equal_the_padded_full_logits_path(name, shared):
    train_type, flags = SETTINGS[name]
    cfg = load_config(None, ["--train_type", train_type, *flags])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    with torch.no_grad():  # peaked distributions, so top-k / top-p cut
        model.lm_head.weight.mul_(8.0)
    objective = OBJECTIVES[train_type](cfg, model)
    rollout = shared_prompt_rollout() if shared else make_rollout(PROMPTS, RESPONSES)
    objective.prepare(rollout)
    ref_loss, ref_grads, ref_metrics, ref_pins = one_step(objective, model, rollout, "old")
    assert "entropy" in ref_metrics and ref_loss.abs() > 0
    for layout in ("pad", "sort", "pack", "share"):
        loss, grads, metrics, pins = one_step(objective, model, rollout, layout)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
        for a, b in zip(grads, ref_grads, strict=True):
            assert_grad_close(a, b)
        assert metrics.keys() == ref_metrics.keys()
        for k in metrics:
            torch.testing.assert_close(metrics[k], ref_metrics[k], atol=1e-6, rtol=1e-6, msg=f"{layout} {k}")
        assert pins.keys() == ref_pins.keys()
        for k in pins:
            torch.testing.assert_close(pins[k], ref_pins[k], atol=1e-6, rtol=1e-6)


def test_first_fit_decreasing_by_hand():
    bins, offsets = first_fit_decreasing([9, 1, 4, 2, 6, 3, 8, 1], 10)
    # longest first: 9 -> bin 0, 8 -> bin 1, 6 -> bin 2, 4 -> bin 2, 3 -> bin 3, 2 -> bin 1, 1 -> bin 0, 1 -> bin 3
    assert bins == [0, 0, 2, 1, 2, 3, 1, 3]
    assert offsets == [0, 9, 6, 8, 0, 0, 0, 3]


def test_packed_rows_hold_every_token_once_with_positions_restarting():
    rollout = make_rollout(PROMPTS, RESPONSES)
    labelled = rollout.labels != -100
    rows = RowLayout.build(rollout.attention_mask, labelled, "pack")
    lengths = rollout.attention_mask.sum(1)
    assert rows.width == int(lengths.max()) and rows.num_rows < len(PROMPTS)
    inputs = rows.inputs(rollout.input_ids, rollout.attention_mask)
    assert int(inputs["attention_mask"].sum()) == int(lengths.sum())
    for i in range(len(PROMPTS)):
        doc = inputs["document_ids"] == i + 1
        assert torch.equal(inputs["input_ids"][doc], rollout.input_ids[i, :lengths[i]])
        assert torch.equal(inputs["position_ids"][doc], torch.arange(int(lengths[i])))
    # the labelled tokens' targets are where the layout says they are
    targets = rollout.labels[rows.src]
    shifted = torch.zeros_like(inputs["input_ids"])
    shifted[:, :-1] = inputs["input_ids"][:, 1:]
    assert torch.equal(shifted[rows.dst], targets)


def test_prefix_trees_by_hand():
    P = MIN_SHARED_PREFIX
    base = torch.arange(3, 3 + 2 * P + 4)
    ids = torch.stack([base, base, base, base]).clone()
    ids[1, P + 2] = 0  # rows 0 and 1 agree on P + 2 tokens
    ids[2, P] = 0  # row 2 agrees with row 0 on P only
    ids[3, 0] = 0  # row 3 shares nothing
    lengths = [len(base)] * 4
    # row 2 joins (2 members x P >= 1 x (P + 2)); row 3 starts a tree of its own
    assert prefix_trees(ids, lengths) == [([0, 1, 2], P), ([3], 0)]
    # a prefix never takes a member's last token, and shorter common prefixes are not shared
    assert prefix_trees(ids[:2, :P + 1], [P + 1, P + 1]) == [([0, 1], P)]
    assert prefix_trees(ids[:2, :P], [P, P]) == [([0], 0), ([1], 0)]


def test_shared_rows_hold_each_prompt_once_with_positions_continuing():
    rollout = shared_prompt_rollout()
    labelled = rollout.labels != -100
    rows = RowLayout.build(rollout.attention_mask, labelled, "share", rollout.input_ids)
    lengths = rollout.attention_mask.sum(1)
    inputs = rows.inputs(rollout.input_ids, rollout.attention_mask)
    shared_tokens = sum(3 * P for P in SHARED_PROMPTS[::4])  # every group's prompt 3 times fewer
    assert int(inputs["attention_mask"].sum()) == int(lengths.sum()) - shared_tokens
    for i in range(len(SHARED_PROMPTS)):
        own = inputs["document_ids"] == i + 1
        P = SHARED_PROMPTS[i]
        assert torch.equal(inputs["input_ids"][own], rollout.input_ids[i, P:lengths[i]])
        assert torch.equal(inputs["position_ids"][own], torch.arange(P, int(lengths[i])))
        prefix = inputs["prefix_ids"][own]
        assert len(prefix.unique()) == 1 and int(prefix[0]) > len(SHARED_PROMPTS)
        prompt = inputs["document_ids"] == prefix[0]
        assert torch.equal(inputs["input_ids"][prompt], rollout.input_ids[i, :P])
    targets = rollout.labels[rows.src]
    shifted = torch.zeros_like(inputs["input_ids"])
    shifted[:, :-1] = inputs["input_ids"][:, 1:]
    in_prompt = rows.src[1] == torch.tensor(SHARED_PROMPTS)[rows.src[0]] - 1  # predicts the first response token
    assert torch.equal(shifted[rows.dst][~in_prompt], targets[~in_prompt])
    # the prompt's last position is read once per sample, each time with that sample's target
    assert len(set(zip(*(t[in_prompt].tolist() for t in rows.dst)))) == 2


@pytest.mark.parametrize("head_dim", [8, 64])  # keys longer than the head (SDPA), then shorter (short_key_attention)
def test_shared_prefix_attention_equals_its_dense_mask(head_dim):
    from astrai.model.attention import shared_prefix_dense_mask
    from astrai.model.kernels import shared_prefix_attention, shared_prefix_segments, takes_short_keys

    rollout = shared_prompt_rollout()
    rows = RowLayout.build(rollout.attention_mask, rollout.labels != -100, "share", rollout.input_ids)
    inputs = rows.inputs(rollout.input_ids, rollout.attention_mask)
    R, W = inputs["input_ids"].shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(R, W, h, head_dim, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    segs = shared_prefix_segments(inputs["document_ids"], inputs["prefix_ids"])
    key_len = segs.key_idx.size(1)
    assert takes_short_keys(q.transpose(1, 2), k[:, :key_len].transpose(1, 2)) == (key_len <= head_dim)
    assert 8 < key_len <= 64  # both paths are taken across the two head sizes
    out = shared_prefix_attention(q, k, v, segs, gqa=True)
    mask = shared_prefix_dense_mask(inputs["document_ids"], inputs["prefix_ids"], W, "cpu")
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-12, rtol=1e-12)
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # padding columns read zeros


def test_shared_prefix_attention_gradients_repeat_bit_for_bit_on_two_threads():
    """A shared prompt's keys feed every sample of its group: their gradients are sums over the
    samples (an index_add over the gathered rows), which must come out the same on every run at
    any thread count (a resumed run replays its steps)."""
    from astrai.model.kernels import shared_prefix_attention, shared_prefix_segments

    # two rows, each a 60-token prompt and 8 samples of 40 tokens that all see it
    prompt, samples, length = 60, 8, 40
    W = prompt + samples * length
    docs = torch.tensor([[1] * prompt + [2 + s for s in range(samples) for _ in range(length)]]).repeat(2, 1)
    docs[1] += 20
    prefixes = torch.where(torch.arange(W) < prompt, 0, docs[:, :1])
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, W, h, 64, generator=gen, requires_grad=True) for h in (4, 2, 2))
    d_out = torch.randn(2, W, 4, 64, generator=gen)
    segs = shared_prefix_segments(docs, prefixes)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [torch.autograd.grad(shared_prefix_attention(q, k, v, segs, gqa=True), (q, k, v), d_out) for _ in range(8)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


def test_prefix_ids_naming_no_earlier_prefix_are_refused():
    from astrai.model.kernels import shared_prefix_segments

    docs = torch.tensor([[1, 1, 2, 2, 3, 3]])
    with pytest.raises(ValueError, match="prefix document 3, which is not earlier in the same row"):
        shared_prefix_segments(docs, torch.tensor([[0, 0, 3, 3, 0, 0]]))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_sft_loss_and_gradient_equal_the_full_logits_path(smoothing):
    cfg = load_config(None, ["--train_type", "sft", "--label_smoothing", str(smoothing)])
    model = CausalLM(ModelConfig(**{**MODEL, "tie_word_embeddings": True}), seed=0)
    objective = OBJECTIVES["sft"](cfg, model)
    ids = torch.randint(3, V, (3, 12))
    labels = torch.full((3, 12), -100)
    labels[0, 4:11], labels[1, 2:6], labels[2, 7:11] = ids[0, 5:12], ids[1, 3:7], ids[2, 8:12]
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    params = list(model.parameters())
    new = objective(model, batch).loss
    idx = labelled_positions(labels)
    ref, _ = token_cross_entropy(model(ids, logits_indices=idx).logits, labels[:, idx], smoothing)
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(new, params), torch.autograd.grad(ref, params), strict=True):
        assert_grad_close(a, b)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradient_equal_the_full_logits_path(loss_type):
    from astrai.train.objectives.dpo import concat_pairs

    model, objective = dpo_with_a_moved_reference(loss_type, MODEL)
    batch = {}
    for side, T in (("chosen", 9), ("rejected", 7)):
        ids = torch.randint(3, V, (2, T))
        labels = torch.full((2, T), -100)
        labels[:, 3:T - 1] = ids[:, 4:T]
        batch.update({f"{side}_input_ids": ids, f"{side}_labels": labels,
                      f"{side}_attention_mask": torch.ones_like(ids), f"{side}_position_ids": torch.arange(T).expand(2, T)})
    params = list(model.parameters())
    new = objective(model, batch).loss
    ids, labels, mask, pos = concat_pairs(batch)

    def seq(m):
        return sequence_logps(m(ids, attention_mask=mask, position_ids=pos).logits, labels, average=loss_type == "ipo")
    pol = seq(model)
    with torch.no_grad():
        ref = seq(objective.reference)
    losses, _, _ = dpo_loss(pol[:2], pol[2:], ref[:2], ref[2:], objective.beta, loss_type)
    torch.testing.assert_close(new, losses.sum(), atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(new, params), torch.autograd.grad(losses.sum(), params), strict=True):
        assert_grad_close(a, b)


def test_moe_policies_keep_every_sample_prompt_in_their_routing_statistics():
    """MoE load balancing counts tokens, so a shared prompt would count once instead of once per
    sample: with experts, layout "share" runs as "pack" and the aux loss is the padded path's."""
    cfg = load_config(None, ["--train_type", "online_grpo"])
    model = CausalLM(ModelConfig(**{**MODEL, "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.1}), seed=0)
    objective = OBJECTIVES["online_grpo"](cfg, model)
    rollout = shared_prompt_rollout()
    objective.prepare(rollout)
    losses = {}
    for layout in ("pad", "share"):
        objective.layout = layout
        batch = objective.batches(rollout, 1)[0]
        pol = objective.logps(model, batch)
        # "share" runs as "pack" (here no two rows fit together, so as pack's fallback "trim"), never shared
        assert pol.rows.layout == "pad" if layout == "pad" else pol.rows.layout in ("pack", "trim")
        losses[layout] = objective(model, batch).loss
    torch.testing.assert_close(losses["share"], losses["pad"], atol=1e-6, rtol=1e-6)
