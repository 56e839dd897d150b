"""One run builder for both loops (train/build.py), and the config's closed choices as data.

The config module imports nothing of ``astrai.train``: each closed choice is a table in
``astrai.config_values``, and here every entry is checked against the module that implements it,
so the tables and the implementations cannot drift apart.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from astrai.config import load_config
from astrai.config_values import CHOICES, REPORTERS, TRAIN_TYPES, is_online
from astrai.train import losses, reporters
from astrai.train.cli import main
from astrai.train.objectives import OBJECTIVES
from astrai.train.optim import LRSchedule, build_optimizer
from tests.train.rl_runs import write_rl_run
from tests.train.trainer_utils import tiny_model


def test_every_train_type_has_an_objective_and_a_record_kind():
    assert list(OBJECTIVES) == list(TRAIN_TYPES) == list(CHOICES["train_type"])
    assert {kind for kind in TRAIN_TYPES.values()} <= {"seq", "sft", "dpo", "rollout", "prompt"}
    assert [t for t in TRAIN_TYPES if is_online(t)] == ["online_grpo", "online_dpo", "online_ppo", "online_distill"]


@pytest.mark.parametrize("optimizer", CHOICES["optimizer"])
@pytest.mark.parametrize("schedule", CHOICES["schedule"])
def test_every_optimizer_and_schedule_choice_is_implemented(optimizer, schedule):
    cfg = load_config(None, ["--optimizer", optimizer, "--schedule", schedule, "--max_lr", "1e-3"])
    opt = build_optimizer(tiny_model(), cfg.optim)
    sched = LRSchedule(opt, cfg.optim, total_steps=10)
    for _ in range(10):
        sched.step()
    assert 0.0 <= sched.get_last_lr()[0] <= 1e-3


def test_every_loss_choice_is_implemented():
    logps = torch.tensor([-1.0, -2.0])
    for loss_type in CHOICES["loss_type"]:
        out, _, _ = losses.dpo_loss(logps, logps - 1, logps, logps, loss_type=loss_type)
        assert torch.isfinite(out).all(), loss_type
    per_token, mask = torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    for mode in CHOICES["rl_loss_agg"]:
        total, units = losses.aggregate_token_loss(per_token, mask, mode, max_len=3)
        assert torch.isfinite(total), mode
    assert set(losses.RL_LOSS_AGGREGATIONS) == set(CHOICES["rl_loss_agg"])


def test_every_reporter_and_parallel_mode_choice_is_known_to_its_module():
    from astrai.train import dist

    assert reporters.REPORTERS == tuple(REPORTERS)
    assert dist.PARALLEL_MODES == CHOICES["parallel_mode"]
    info = dist.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    model = tiny_model()
    for mode in CHOICES["parallel_mode"]:
        assert dist.wrap_model(model, mode, info) is model  # one rank: nothing to wrap, every mode accepted


def test_config_module_imports_nothing_of_train():
    import ast
    from pathlib import Path

    import astrai.config
    import astrai.config_values

    for module in (astrai.config, astrai.config_values):
        tree = ast.parse(Path(module.__file__).read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [n for n in names if n.startswith(("astrai.train", "astrai.infer", "astrai.serve"))], module


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]


def test_online_rl_switches_off_router_statistics_nobody_reads(tmp_path, tok_dir):  # noqa: F811
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    config = write_rl_run(tmp_path, tok_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"].update(moe)
    config.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(config), "--max_steps", "1", "--log_metrics", "[]"]) == 0
    line = _metrics(tmp_path)[0]
    assert not [k for k in line if k.startswith("router/")]


@pytest.mark.slow
def test_compile_trains_online_rl_and_leaves_the_engine_eager(tmp_path, tok_dir, monkeypatch):  # noqa: F811
    """``train.compile`` compiles the trainer's forward for online RL too (it was silently ignored
    there); the engine keeps the eager module, so the sampler's log-probs still match."""
    from astrai.train.rl import loop as loop_mod

    built = {}
    real_init = loop_mod.OnlineLoop.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built["loop"] = self

    monkeypatch.setattr(loop_mod.OnlineLoop, "__init__", spy)
    config = write_rl_run(tmp_path, tok_dir)
    assert main(["--config", str(config), "--max_steps", "2", "--compile", "true"]) == 0
    loop = built["loop"]
    assert isinstance(loop.model, torch._dynamo.eval_frame.OptimizedModule)  # the trainer's forward
    assert loop.rollout_sampler.engine.model is loop.raw_model  # the engine's: eager
    assert getattr(loop.raw_model, "_compiled_call_impl", None) is None
    first = _metrics(tmp_path)[0]
    assert first["sampler_logp_diff"] < 1e-4


def test_rollouts_are_fitted_to_the_models_positions():
    from astrai.train.build import fit_rollouts_to_model

    cfg = load_config(None, ["--train_type", "online_grpo", "--rollout_max_tokens", "8"])
    fit_rollouts_to_model(cfg, 128)
    assert cfg.rl.max_prompt_len == 120  # unset: 120 + 8 rollout tokens = the model's 128 positions
    cfg = load_config(None, ["--train_type", "online_grpo", "--max_prompt_len", "256", "--rollout_max_tokens", "8"])
    with pytest.raises(ValueError, match="set --max_prompt_len to at most 120"):  # given: refused, not lowered
        fit_rollouts_to_model(cfg, 128)
    cfg = load_config(None, ["--train_type", "online_grpo", "--rollout_max_tokens", "128"])
    with pytest.raises(ValueError, match="rollout_max_tokens=128 leaves no room for a prompt"):
        fit_rollouts_to_model(cfg, 128)


def test_a_rollout_interval_beyond_the_policy_lag_is_refused_at_start():
    from astrai.config import ConfigError

    with pytest.raises(ConfigError, match="rollout_interval=3 .* more than max_policy_lag=1; raise --max_policy_lag to 2"):
        load_config(None, ["--train_type", "online_grpo", "--rollout_interval", "3", "--max_policy_lag", "1"])
    assert load_config(None, ["--rollout_interval", "3", "--max_policy_lag", "2"]).rl.rollout_interval == 3
