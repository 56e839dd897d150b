"""ValueModel (PPO critic): trunk parity with the policy, zero-initialised head, (B, T) values,
clear errors on other input shapes."""

from __future__ import annotations

import pytest
import torch

from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM
from astrai.model.value import ValueModel

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def policy(**kw) -> CausalLM:
    return CausalLM(ModelConfig(**{**CONFIG, **kw}), seed=0).eval()


def test_from_policy_trunk_matches_policy_hidden_states():
    pol = policy()
    critic = ValueModel.from_policy(pol).eval()
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        hidden, _, _, _ = critic.model(ids, mask)
        expected = pol(ids, attention_mask=mask).hidden_states
        values = critic(ids, attention_mask=mask)
    assert torch.equal(hidden, expected)
    assert values.shape == (2, 9) and values.dtype == torch.float32
    assert not values.any()  # zero head: first estimates are exactly 0
    with torch.no_grad():
        critic.value_head.weight.normal_()
        critic.value_head.bias.fill_(0.5)
        values = critic(ids, attention_mask=mask)
    head = expected @ critic.value_head.weight[0] + 0.5
    torch.testing.assert_close(values, head)


def test_from_policy_copies_weights():
    pol = policy()
    critic = ValueModel.from_policy(pol)
    with torch.no_grad():
        critic.model.embed_tokens.weight.add_(1.0)
    assert not torch.equal(critic.model.embed_tokens.weight, pol.model.embed_tokens.weight)


def test_fresh_critic_is_seeded_like_a_policy_and_trains():
    critic = ValueModel(ModelConfig(**CONFIG), seed=0)
    assert torch.equal(critic.model.embed_tokens.weight, policy().model.embed_tokens.weight)
    ids = torch.randint(0, 64, (2, 5))
    loss = (critic(ids) - 1.0).pow(2).mean()
    loss.backward()
    assert critic.value_head.bias.grad is not None and critic.value_head.bias.grad.abs().item() > 0


def test_moe_trunk_and_gradient_checkpointing():
    pol = policy(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    critic = ValueModel.from_policy(pol).train()
    with torch.no_grad():
        critic.value_head.weight.normal_()
    ids = torch.randint(0, 64, (2, 7))
    critic(ids).sum().backward()
    grads = [p.grad.clone() for p in critic.parameters()]
    critic.zero_grad()
    critic.gradient_checkpointing = True
    critic(ids).sum().backward()
    for g, p in zip(grads, critic.parameters()):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("bad", [torch.zeros(7, dtype=torch.long), torch.zeros(1, 2, 7, dtype=torch.long),
                                 torch.zeros(2, 7)])
def test_other_input_shapes_raise(bad):
    critic = ValueModel(ModelConfig(**CONFIG))
    with pytest.raises(ValueError, match="ValueModel expects"):
        critic(bad)


def test_mask_shape_mismatch_raises():
    critic = ValueModel(ModelConfig(**CONFIG))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 6\)"):
        critic(torch.zeros(2, 7, dtype=torch.long), attention_mask=torch.ones(2, 6))
