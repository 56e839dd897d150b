"""The sampler-trainer log-prob contract: for every sampling setting a rollout accepts, the
trainer's log-prob of a token equals the one the sampler recorded when the weights are the ones
that drew it (``sampler_logp_diff`` on a fresh rollout <= 1e-5 in fp32). Both sides truncate with
the one ``apply_truncation`` (``astrai.model.logprobs``) and renormalise over the kept tokens."""

from __future__ import annotations

import math

import pytest
import torch

from astrai.model.logprobs import truncated_token_logps
from astrai.train.cli import main
from tests.train.resume_data import read_metrics
from tests.train.rl_runs import write_rl_run

PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])  # a 5-token vocabulary, most likely first


def logp(token: int, **truncation) -> float:
    return truncated_token_logps(PROBS.log()[None], torch.tensor([token]), **truncation).exp().item()


def test_truncated_log_probs_by_hand():
    assert logp(0) == pytest.approx(0.4)  # no truncation: the plain softmax
    # top_k 2 keeps {0.4, 0.3}: renormalised over 0.7
    assert logp(0, top_k=2) == pytest.approx(0.4 / 0.7)
    assert logp(1, top_k=2) == pytest.approx(0.3 / 0.7)
    # top_p 0.6: 0.4 alone is short of 0.6, 0.4 + 0.3 reaches it: the same two tokens
    assert logp(1, top_p=0.6) == pytest.approx(0.3 / 0.7)
    # top_k 3 first (0.4, 0.3, 0.15 renormalised over 0.85: 0.47, 0.35, 0.18), then top_p 0.6 of
    # that: 0.47 + 0.35 reaches it, so again {0, 1}
    assert logp(0, top_k=3, top_p=0.6) == pytest.approx(0.4 / 0.7)
    # top_p 0.9 keeps four tokens (0.95 >= 0.9 only with the fourth)
    assert logp(3, top_p=0.9) == pytest.approx(0.1 / 0.95)
    # top_p 0.35: the first token alone; a token outside the nucleus that was drawn anyway (a
    # rounding difference at the boundary) keeps a finite log-prob over the kept set plus itself
    assert logp(0, top_p=0.35) == pytest.approx(1.0)
    assert logp(2, top_p=0.35) == pytest.approx(0.15 / 0.55)


def test_truncated_log_probs_send_gradients_to_the_kept_logits_only():
    logits = PROBS.log()[None].clone().requires_grad_(True)
    truncated_token_logps(logits, torch.tensor([1]), top_k=2).sum().backward()
    grad = logits.grad[0]
    assert torch.all(grad[2:] == 0)
    assert grad[1].item() == pytest.approx(1 - 0.3 / 0.7) and grad[0].item() == pytest.approx(-0.4 / 0.7)
    assert math.isclose(grad.sum().item(), 0.0, abs_tol=1e-6)


SETTINGS = {
    "temperature 1": {},
    "temperature 0.7": {"rollout_temperature": 0.7},
    "top_p 0.9": {"rollout_top_p": 0.9},
    "top_k 20": {"rollout_top_k": 20},
    "top_k 5 + top_p 0.8, temperature 1.3": {"rollout_top_k": 5, "rollout_top_p": 0.8, "rollout_temperature": 1.3},
    "min_p 0.9 + top_p 0.95, temperature 0.8": {"rollout_min_p": 0.9, "rollout_top_p": 0.95, "rollout_temperature": 0.8},
    "repetition_penalty 1.5 + top_k 20, temperature 0.9": {"rollout_repetition_penalty": 1.5, "rollout_top_k": 20,
                                                           "rollout_temperature": 0.9},
}


@pytest.mark.parametrize("train_type", ["online_grpo", "online_ppo"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_fresh_rollout_log_probs_match_the_sampler_for_every_setting(tmp_path, tok_dir, setting, train_type):  # noqa: F811
    config = write_rl_run(tmp_path, tok_dir, train_type=train_type, **SETTINGS[setting])
    assert main(["--config", str(config), "--max_steps", "1"]) == 0
    first = read_metrics(tmp_path)[0]
    # the trainer that divided by the temperature only gave 0.104 (top_p 0.9), 2.56 (top_k 20)
    # and 4.17 (top_k 5 + top_p 0.8) on this tiny model
    assert first["sampler_logp_diff"] <= 1e-5, (setting, first["sampler_logp_diff"])


@pytest.mark.parametrize("level", ["token", "sequence", "none"])
def test_a_sampler_mismatch_is_corrected_by_truncated_importance_weights(tmp_path, tok_dir, monkeypatch, level):  # noqa: F811
    """A sampler that reports log-probs 1.0 lower than the trainer's on every other token (as a
    bf16 engine might, exaggerated): the ratio still starts at 1 (its old log-probs are the
    trainer's own), and the weights min(pi_trainer / pi_sampler, cap) = min(e, 2) = 2 cap half the
    tokens (token level), every sample (sequence level), or nothing (none)."""
    from astrai.train.rl import runner as runner_mod

    real = runner_mod.pack_episodes

    def skewed(rows, group_size, policy_version):
        out = real(rows, group_size, policy_version)
        out.old_logps[:, ::2] -= 1.0
        return out

    monkeypatch.setattr(runner_mod, "pack_episodes", skewed)
    config = write_rl_run(tmp_path, tok_dir, rollout_is_level=level, rollout_interval=2)
    assert main(["--config", str(config), "--max_steps", "2"]) == 0
    first, second = read_metrics(tmp_path)[:2]
    assert first["sampler_logp_diff"] > 0.3  # the mismatch is seen...
    assert first["clip_fraction"] == 0.0  # ...but the ratio's old log-probs are the trainer's: ratio 1
    if level == "token":
        assert 0.3 < first["is_weight_capped_fraction"] < 0.7
        assert 1.3 < first["is_weight_mean"] < 1.7  # 2 on the skewed half, 1 on the rest
    elif level == "sequence":
        assert first["is_weight_capped_fraction"] == pytest.approx(1.0)
        assert first["is_weight_mean"] == pytest.approx(2.0)
    else:
        assert first["is_weight_mean"] == pytest.approx(1.0) and first["is_weight_capped_fraction"] == 0.0
    assert second["is_weight_mean"] == pytest.approx(first["is_weight_mean"])  # pinned for the reused rollout
    for key in ("entropy", "clip_fraction_low", "clip_fraction_high", "truncated_fraction", "frac_reward_zero_std"):
        assert key in first, key
