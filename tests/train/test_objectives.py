"""Objectives learn on CPU in seconds; DPO separates a toy preference set; MoE adds its aux loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from astrai.train.objectives import OBJECTIVES, DPOObjective, SeqObjective, SFTObjective, labelled_positions
from astrai.train.trainer import Trainer
from tests.train.toydata import ToyPairDataset, ToySeqDataset
from tests.train.trainer_utils import tiny_config, tiny_model, without_checkpoints


def run(tmp_path, dataset, *flags, model=None):
    cfg = tiny_config(tmp_path, "--max_lr", "3e-3", *flags)
    t = Trainer(cfg, model=model or tiny_model(), train_dataset=dataset)
    without_checkpoints(t)
    t.train()
    lines = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    return t, [x for x in lines if x["split"] == "train"]


def test_objectives_table():
    assert set(OBJECTIVES) == {"seq", "sft", "dpo", "grpo", "online_grpo", "online_dpo", "online_ppo",
                               "online_distill", "kd", "reward"}


def test_seq_learns(tmp_path):
    _, lines = run(tmp_path, ToySeqDataset(32), "--train_type", "seq", "--batch_per_device", "8", "--n_epoch", "10")
    first, last = lines[0]["loss"], lines[-1]["loss"]
    assert first > 3.0  # ~ln(32) at init
    assert last < 0.6 * first, (first, last)


def test_sft_learns_only_on_labelled_tokens(tmp_path):
    ds = ToySeqDataset(32, prompt_len=6)
    t, lines = run(tmp_path, ds, "--train_type", "sft", "--batch_per_device", "8", "--n_epoch", "10")
    assert lines[-1]["loss"] < 0.6 * lines[0]["loss"]
    batch = ds.collate([ds[i] for i in range(8)])
    # units are the labelled tokens only (prompt positions carry -100)
    assert int(t.objective.num_units(batch)) == int((batch["labels"] != -100).sum())
    assert int(t.objective.num_units(batch)) < int(batch["attention_mask"].sum())


def test_dpo_reaches_high_reward_accuracy(tmp_path):
    _, lines = run(tmp_path, ToyPairDataset(64), "--train_type", "dpo", "--batch_per_device", "16",
                   "--n_epoch", "6", "--beta", "0.1")
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in lines[-1]
    assert lines[-1]["rewards/accuracies"] > 0.9
    assert lines[-1]["rewards/margins"] > 0
    assert lines[-1]["loss"] < 0.5


@pytest.mark.parametrize("loss_type", ["ipo", "hinge"])
def test_dpo_loss_types_and_reference_free_run(tmp_path, loss_type):
    _, lines = run(tmp_path, ToyPairDataset(16), "--train_type", "dpo", "--batch_per_device", "8",
                   "--max_steps", "3", "--loss_type", loss_type, "--reference_free")
    assert all(math.isfinite(x["loss"]) for x in lines)


def test_dpo_reference_is_a_frozen_copy(tmp_path):
    cfg = tiny_config(tmp_path, "--train_type", "dpo")
    model = tiny_model()
    obj = DPOObjective(cfg, model)
    assert obj.reference is not model
    assert all(not p.requires_grad for p in obj.reference.parameters())
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert not torch.equal(obj.reference.lm_head.weight, model.lm_head.weight)


def test_label_smoothing_changes_seq_loss(tmp_path):
    ds = ToySeqDataset(4)
    batch = ds.collate([ds[i] for i in range(4)])
    model = tiny_model()
    plain = SeqObjective(tiny_config(tmp_path), model)(model, batch).loss
    smooth = SeqObjective(tiny_config(tmp_path, "--label_smoothing", "0.1"), model)(model, batch).loss
    assert not torch.allclose(plain, smooth)


def test_moe_adds_weighted_aux_loss_and_router_stats(tmp_path):
    model = tiny_model(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    ds = ToySeqDataset(8)
    batch = ds.collate([ds[i] for i in range(8)])
    out = SeqObjective(tiny_config(tmp_path), model)(model, batch)
    m = out.metrics
    for key in ("task_loss", "aux_loss", "aux_loss_weighted", "router/entropy", "router/load_max"):
        assert key in m, key
    torch.testing.assert_close(out.loss.detach(), m["task_loss"] + m["aux_loss_weighted"])
    torch.testing.assert_close(m["aux_loss_weighted"], 0.5 * m["aux_loss"])
    # the model section overrides the coefficient of the model's own config
    out2 = SeqObjective(tiny_config(tmp_path, "--router_aux_loss_coef", "0.0"), model)(model, batch)
    torch.testing.assert_close(out2.loss.detach(), out2.metrics["task_loss"])


def test_moe_training_logs_aux_metrics(tmp_path):
    model = tiny_model(num_experts=4, num_experts_per_tok=2)
    _, lines = run(tmp_path, ToySeqDataset(16), "--train_type", "seq", "--batch_per_device", "8",
                   "--max_steps", "2", model=model)
    assert {"task_loss", "aux_loss", "aux_loss_weighted", "router/dead_fraction"} <= set(lines[-1])


def test_logits_only_where_labelled_gives_the_same_loss_and_gradient(tmp_path):
    from astrai.train.losses import token_cross_entropy

    ds = ToySeqDataset(8, prompt_len=6)
    batch = ds.collate([ds[i] for i in range(8)])
    model = tiny_model()
    out = SFTObjective(tiny_config(tmp_path), model)(model, batch)
    out.loss.backward()
    fast = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full = model(batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    ref, _ = token_cross_entropy(full.logits, batch["labels"])
    ref.backward()
    torch.testing.assert_close(out.loss, ref)
    for g, p in zip(fast, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_labelled_positions():
    labels = torch.tensor([[-100, -100, 3, 4], [-100, 5, 6, -100]])
    assert labelled_positions(labels).tolist() == [1, 2, 3]
    assert labelled_positions(torch.tensor([[1, 2], [3, -100]])) is None


def test_unrequested_metrics_are_not_computed(tmp_path, monkeypatch):
    import astrai.model.moe as moe
    import astrai.train.objectives as objectives

    calls = {"stats": 0, "dpo_sums": 0}
    real_stats = moe.router_statistics

    def counting_stats(*args):
        calls["stats"] += 1
        return real_stats(*args)

    monkeypatch.setattr(moe, "router_statistics", counting_stats)
    # only the metrics log reads objective metrics here, and it asks for one
    model = tiny_model(num_experts=4, num_experts_per_tok=2)
    _, lines = run(tmp_path, ToyPairDataset(16), "--train_type", "dpo", "--batch_per_device", "8",
                   "--max_steps", "2", "--log_metrics", "[rewards/accuracies]", model=model)
    objective_keys = {k for k in lines[-1] if "/" in k or k in ("task_loss", "aux_loss", "aux_loss_weighted")}
    assert objective_keys == {"rewards/accuracies"}
    assert calls["stats"] == 0  # router statistics were never computed

    # the objective itself: a request for nothing yields no metrics, None yields all of them
    model = tiny_model(num_experts=4, num_experts_per_tok=2)  # the trainer switched the first one's stats off
    cfg = tiny_config(tmp_path, "--train_type", "dpo")
    obj = objectives.DPOObjective(cfg, model)
    ds = ToyPairDataset(8)
    batch = ds.collate([ds[i] for i in range(8)])
    obj.requested_metrics = frozenset()
    assert obj(model, batch).metrics == {}
    obj.requested_metrics = None
    assert {"rewards/margins", "logps/chosen", "task_loss", "router/entropy"} <= set(obj(model, batch).metrics)


def test_a_user_callback_without_a_request_gets_every_metric(tmp_path):
    from astrai.train.callbacks import requested_metrics

    class Reader:  # reads trainer.step_metrics but does not say which
        def after_optimizer_step(self, trainer):
            pass

    class Picky:
        requested_metrics = {"val/rewards/margins"}

    assert requested_metrics([Picky()]) == {"rewards/margins"}
    assert requested_metrics([Picky(), Reader()]) is None
    cfg = tiny_config(tmp_path, "--train_type", "dpo", "--batch_per_device", "8", "--max_steps", "1",
                      "--log_metrics", "[]")
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToyPairDataset(8), callbacks=[Reader()])
    assert t.objective.requested_metrics is None
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToyPairDataset(8), callbacks=[Picky()])
    assert t.objective.requested_metrics == {"rewards/margins"}
    without_checkpoints(t)
    t.train()
    last = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "rewards/margins" in last and "rewards/accuracies" not in last
