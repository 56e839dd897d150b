"""Objectives on the chunked lm head and padding-free micro-batches equal the padded full-logits path.

The reference is the path before the chunked head, written out here: the model's full logits at
the labelled positions, ``truncated_token_logps`` / ``selective_log_softmax`` / ``token_entropy``
on them, every micro-batch at the rollout's width. Each rollout objective runs one step's
micro-batches under that reference and under every row layout (pad, sort, pack); the loss sum,
every gradient, the metrics and the pins agree to 1e-6 (gradients: of their largest entry).
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
from astrai.train.objectives.base import PolicyLogps, labelled_positions
from astrai.train.objectives.packing import RowLayout, first_fit_decreasing
from astrai.train.rl.rollout import Rollout
from tests.train.resume_data import MODEL

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


@pytest.mark.parametrize("name", list(SETTINGS))
def test_rollout_objectives_equal_the_padded_full_logits_path(name):
    train_type, flags = SETTINGS[name]
    cfg = load_config(None, ["--train_type", train_type, *flags])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    with torch.no_grad():  # peaked distributions, so top-k / top-p cut
        model.lm_head.weight.mul_(8.0)
    objective = OBJECTIVES[train_type](cfg, model)
    rollout = make_rollout(PROMPTS, RESPONSES)
    objective.prepare(rollout)
    ref_loss, ref_grads, ref_metrics, ref_pins = one_step(objective, model, rollout, "old")
    assert "entropy" in ref_metrics and ref_loss.abs() > 0
    for layout in ("pad", "sort", "pack"):
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

    cfg = load_config(None, ["--train_type", "dpo", "--loss_type", loss_type])
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    objective = OBJECTIVES["dpo"](cfg, model)
    with torch.no_grad():  # a reference that differs from the policy
        for p in objective.reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
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
    losses, _, _ = dpo_loss(pol[:2], pol[2:], ref[:2], ref[2:], cfg.objective.beta, loss_type)
    torch.testing.assert_close(new, losses.sum(), atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(new, params), torch.autograd.grad(losses.sum(), params), strict=True):
        assert_grad_close(a, b)
