"""Online PPO: GAE by hand, KL folded into rewards, pinned targets, critic warm start, critic checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from astrai.train import losses as L
from astrai.train.cli import main
from astrai.train.publish import latest_checkpoint
from tests.train.resume_data import read_metrics
from tests.train.rl_runs import sigterm_after_step, write_rl_run

REPO = Path(__file__).resolve().parents[2]


def test_gae_with_gamma_lambda_one_and_zero_values_gives_the_terminal_reward_everywhere():
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    rewards = L.token_rewards(torch.tensor([2.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 2.0, 0.0]]  # the score sits on the last response token
    adv, ret = L.gae(rewards, torch.zeros(1, 5), mask, gamma=1.0, lam=1.0)
    assert adv.tolist() == [[0.0, 2.0, 2.0, 2.0, 0.0]] and ret.tolist() == adv.tolist()


def test_gae_with_lambda_zero_gives_td_residuals_and_padding_never_leaks():
    r, v, m = torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[0.5, 1.0, -0.5]]), torch.ones(1, 3)
    adv, _ = L.gae(r, v, m, gamma=0.9, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.4, -1.45, 2.5]]))
    # padding after the trajectory, with garbage rewards and values, changes no valid position
    padded, _ = L.gae(torch.tensor([[0.0, 0.0, 2.0, 7.0, -3.0]]), torch.tensor([[0.5, 1.0, -0.5, 9.0, 4.0]]),
                      torch.tensor([[1, 1, 1, 0, 0]]), gamma=0.9, lam=0.0)
    torch.testing.assert_close(padded[:, :3], adv)
    assert padded[0, 3:].tolist() == [0.0, 0.0]


def test_kl_in_reward_per_token_is_minus_coef_times_log_ratio():
    mask = torch.tensor([[1, 1, 1, 0]])
    logps = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, 9.0]])
    rewards = L.token_rewards(torch.tensor([1.0]), mask, logps, ref, kl_coef=0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 1.0, 0.0]]))


def test_explained_variance():
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    assert L.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert L.explained_variance(torch.zeros(1, 5) + 2.5, returns, mask).item() == pytest.approx(0.0)


def test_critic_warm_start_equals_the_policy_trunk_with_a_zero_head(tok_dir):
    from astrai.config import load_config
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM
    from astrai.train.objectives import PPOObjective
    from tests.train.resume_data import MODEL

    policy = CausalLM(ModelConfig(**MODEL), seed=0).eval()
    objective = PPOObjective(load_config(None, ["--train_type", "online_ppo"]), policy)
    critic = objective.critic.eval()
    ids = torch.randint(3, 300, (2, 9))
    hidden, _, _, _ = policy.model(ids, None, None, None)
    trunk, _, _, _ = critic.model(ids, None, None, None)
    torch.testing.assert_close(trunk, hidden)
    assert critic(ids).abs().max().item() == 0.0
    assert critic.model is not policy.model  # a copy: the critic trains on its own


def test_online_ppo_pins_targets_across_replayed_steps_and_checkpoints_the_critic(tmp_path, tok_dir):
    from astrai.train.rl import loop as loop_mod

    seen = []
    original = loop_mod.OnlineLoop._metrics

    def spy(self, result, rollout, fresh, seconds):
        seen.append((rollout.policy_version, {k: v.clone() for k, v in rollout.pinned.items()}))
        return original(self, result, rollout, fresh, seconds)

    loop_mod.OnlineLoop._metrics = spy
    try:
        # k1, the plain log-ratio, in the per-token rewards (kl_estimator's default k3 is exactly 0 while the
        # policy equals its reference, and the format reward is 0 here: the critic would see only zeros)
        config = write_rl_run(tmp_path, tok_dir, train_type="online_ppo", rollout_interval=2,
                              rewards=["format"], kl_coef=0.05, kl_estimator="k1")
        assert main(["--config", str(config)]) == 0
    finally:
        loop_mod.OnlineLoop._metrics = original
    assert [v for v, _ in seen] == [0, 0, 2, 2]
    for (_, a), (_, b) in ((seen[0], seen[1]), (seen[2], seen[3])):  # a replayed step: the same targets
        assert a.keys() == {"advantages", "returns", "old_values"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    lines = read_metrics(tmp_path)
    for key in ("policy_loss", "value_loss", "explained_variance", "clip_fraction", "approx_kl", "value_mean",
                "return_mean", "critic_grad_norm", "kl"):
        assert key in lines[0], key
    assert abs(lines[0]["kl"]) < 1e-6 < abs(lines[2]["kl"])  # the policy equals its reference at first only
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert "value_model.pt" in files and "value_optimizer.pt" in files
    # the critic learned something: its head is no longer zero
    head = torch.load(ckpt / "value_model.pt", weights_only=True)["value_head.weight"]
    assert head.abs().sum().item() > 0
    # --param_path at a PPO checkpoint loads the policy weights only (the critic warm-starts)
    again = write_rl_run(tmp_path / "again", tok_dir, train_type="online_ppo", rewards=["format"])
    raw = yaml.safe_load(again.read_text())
    del raw["model"]  # the checkpoint's config.json defines the model
    again.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(again), "--param_path", str(ckpt), "--max_steps", "1"]) == 0


def test_resume_without_the_critic_files_fails_naming_them(tmp_path, tok_dir, capsys):
    config = write_rl_run(tmp_path, tok_dir, train_type="online_ppo", rewards=["format"])
    assert main(["--config", str(config), "--max_steps", "2"]) == 0
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    (ckpt / "value_optimizer.pt").unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["value_optimizer.pt"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["--config", str(config), "--resume", "--param_path", str(ckpt)]) == 1
    assert "value_optimizer.pt" in capsys.readouterr().err
    # `astrai ckpt latest` (what --resume and the container entrypoint pick) skips it, naming the file
    from astrai.train.ckpt_cli import main as ckpt_main

    assert ckpt_main(["latest", str(tmp_path / "ckpt")]) == 1
    assert "value_optimizer.pt" in capsys.readouterr().err


@pytest.mark.slow
def test_ppo_sigterm_and_resume_equals_the_uninterrupted_run(tmp_path, tok_dir):
    straight = write_rl_run(tmp_path / "straight", tok_dir, train_type="online_ppo", rollout_interval=2,
                            rewards=["format"])
    stopped = write_rl_run(tmp_path / "stopped", tok_dir, train_type="online_ppo", rollout_interval=2,
                           rewards=["format"])
    for cfg in (straight, stopped):
        cfg.write_text(cfg.read_text().replace("max_steps: 4", "max_steps: 5"))
    assert main(["--config", str(straight)]) == 0
    sigterm_after_step(stopped, 3, tmp_path)
    assert main(["--config", str(stopped), "--resume"]) == 0
    keys = ("step", "loss", "policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "explained_variance")
    got = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "stopped")]
    want = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "straight")]
    assert got == want
    for name in ("model.safetensors",):
        a = load_file(str(latest_checkpoint(tmp_path / "stopped" / "ckpt") / name))
        b = load_file(str(latest_checkpoint(tmp_path / "straight" / "ckpt") / name))
        assert all(a[k].equal(b[k]) for k in a)
    ca = torch.load(latest_checkpoint(tmp_path / "stopped" / "ckpt") / "value_model.pt", weights_only=True)
    cb = torch.load(latest_checkpoint(tmp_path / "straight" / "ckpt") / "value_model.pt", weights_only=True)
    assert all(ca[k].equal(cb[k]) for k in ca)


@pytest.mark.slow
def test_online_ppo_under_ddp_with_two_ranks(tmp_path, tok_dir):
    config = write_rl_run(tmp_path, tok_dir, train_type="online_ppo", rewards=["format"])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "astrai", "train", "--config", str(config), "--nprocs", "2",
                        "--parallel_mode", "ddp", "--max_steps", "2"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    state = json.loads((latest_checkpoint(tmp_path / "ckpt") / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["policy_version"] == 2
    files = json.loads((latest_checkpoint(tmp_path / "ckpt") / "manifest.json").read_text())["files"]
    assert {"value_model.pt", "value_optimizer.pt", "rollout.pt"} <= set(files)


def test_ppo_batches_with_bad_logp_old_are_errors_naming_the_field():
    from astrai.config import load_config
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM
    from astrai.train.objectives import PPOObjective
    from tests.train.resume_data import MODEL

    policy = CausalLM(ModelConfig(**MODEL), seed=0)
    objective = PPOObjective(load_config(None, ["--train_type", "online_ppo"]), policy)
    ids = torch.randint(3, 300, (2, 6))
    labels = torch.full((2, 6), -100)
    labels[:, 2:5] = ids[:, 3:6]
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, 6, dtype=torch.long), "labels": labels,
             "old_logps": torch.zeros(2, 6), "advantages": torch.zeros(2, 6), "returns": torch.zeros(2, 6),
             "old_values": torch.zeros(2, 6)}
    objective(policy, batch)  # well-formed: runs
    bad = {**batch, "old_logps": batch["old_logps"].clone()}
    bad["old_logps"][0, 3] = float("nan")
    with pytest.raises(ValueError, match="'old_logps'"):
        objective(policy, bad)
    with pytest.raises(ValueError, match="'old_logps' has shape"):
        objective(policy, {**batch, "old_logps": torch.zeros(2, 5)})
