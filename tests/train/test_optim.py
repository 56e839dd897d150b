"""Optimizers (AdamW groups, Muon split) and LR schedules, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.config import load_config
from astrai.train.optim import LRSchedule, OptimizerList, build_optimizer, lr_factor
from tests.train.trainer_utils import tiny_model


def optim_cfg(*flags):
    return load_config(None, list(flags)).optim


def test_adamw_decays_only_matrices_by_default():
    model = tiny_model()
    opt = build_optimizer(model, optim_cfg("--weight_decay", "0.1"))
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert opt.defaults["fused"]  # CPU fp32 tensors take the fused kernel
    everything = build_optimizer(model, optim_cfg("--weight_decay", "0.1", "--decay_all_params"))
    assert len(everything.param_groups) == 1


def test_muon_takes_hidden_matrices_adamw_the_rest():
    model = tiny_model()
    opt = build_optimizer(model, optim_cfg("--optimizer", "muon"))
    assert isinstance(opt, OptimizerList)
    muon, adamw = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon_names = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert all("embed_tokens" not in n and "lm_head" not in n for n in muon_names)
    assert "model.layers.0.self_attn.q_proj.weight" in muon_names
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    opt.step()
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)
    state = opt.state_dict()
    opt2 = build_optimizer(model, optim_cfg("--optimizer", "muon"))
    opt2.load_state_dict(state)
    with pytest.raises(ValueError, match="same --optimizer"):
        opt2.load_state_dict({"optimizers": [state["optimizers"][0]]})


def test_constant_and_warmup():
    cfg = optim_cfg("--schedule", "constant", "--warmup_steps", "4")
    assert [lr_factor(s, 10, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_with_floor():
    cfg = optim_cfg("--schedule", "cosine", "--warmup_ratio", "0.0", "--min_lr_ratio", "0.1")
    assert lr_factor(0, 10, cfg) == pytest.approx(1.0)
    assert lr_factor(5, 10, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(10, 10, cfg) == pytest.approx(0.1)
    warm = optim_cfg("--schedule", "cosine", "--warmup_ratio", "0.2")
    assert lr_factor(0, 10, warm) == pytest.approx(0.5) and lr_factor(2, 10, warm) == pytest.approx(1.0)


def test_wsd_holds_then_decays_linearly():
    cfg = optim_cfg("--schedule", "wsd", "--decay_ratio", "0.2", "--min_lr_ratio", "0.0")
    values = [lr_factor(s, 10, cfg) for s in range(10)]
    assert values[:8] == [1.0] * 8
    assert values[8:] == pytest.approx([0.5, 0.0])


def test_schedule_steps_and_restores():
    model = tiny_model()
    cfg = optim_cfg("--schedule", "cosine", "--max_lr", "1e-2", "--warmup_steps", "2")
    opt = build_optimizer(model, cfg)
    sched = LRSchedule(opt, cfg, total_steps=10)
    assert sched.get_last_lr()[0] == pytest.approx(5e-3)
    for _ in range(3):
        sched.step()
    again = LRSchedule(build_optimizer(model, cfg), cfg, total_steps=10)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr()


def test_warmup_warning_only_past_the_run():
    from astrai.config import OptimConfig
    from astrai.train.optim import warmup_warning

    assert warmup_warning(OptimConfig(warmup_steps=10), 10) is None
    assert "ends at 50% of max_lr" in warmup_warning(OptimConfig(warmup_steps=20), 10)
