"""MoE routing replay: a forward that uses given experts per token, with the router's gradient kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.model import CausalLM, ModelConfig

MOE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=24, shared_expert_intermediate_size=16, mlp_only_layers=[1])


def loss_and_grads(model: CausalLM, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(ids, return_routing=True, **kw)
    (out.logits.float().square().mean() + out.aux_loss).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_replaying_its_own_routing_gives_identical_outputs_and_gradients(norm_topk_prob):
    model = CausalLM(ModelConfig(**MOE, norm_topk_prob=norm_topk_prob)).train()
    ids = torch.randint(0, 97, (2, 9))
    own, own_grads = loss_and_grads(model, ids)
    assert own.routing.shape == (2, 9, 2, 2)  # (batch, tokens, MoE layers, k): layer 1 is dense
    replayed, grads = loss_and_grads(model, ids, routing=own.routing)
    assert torch.equal(replayed.logits, own.logits) and torch.equal(replayed.aux_loss, own.aux_loss)
    assert torch.equal(replayed.routing, own.routing)
    assert grads.keys() == own_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], own_grads[name]), name


def test_replaying_other_experts_uses_them_and_keeps_the_router_gradient():
    model = CausalLM(ModelConfig(**MOE, norm_topk_prob=True)).train()
    ids = torch.randint(0, 97, (1, 7))
    own = model(ids, return_routing=True).routing  # (1, 7, 2, 2)
    other = (own + 1) % 4  # each token's two experts moved: still two distinct ones
    other[0, 3] = -1  # token 3 routes on its own in every layer
    inputs = {}
    moe = model.model.layers[2].mlp
    hook = moe.register_forward_hook(lambda m, i, o: inputs.update(x=i[0]))
    out, grads = loss_and_grads(model, ids, routing=other)
    hook.remove()
    expect = other.clone()
    expect[0, 3] = own[0, 3]
    assert torch.equal(out.routing, expect)
    # the last MoE layer's output by hand: the replayed experts, weighted by this router's softmax there
    x = inputs["x"][0].detach()  # (7, C)
    probs = F.softmax(moe.gate(x).float(), dim=-1)
    idx = expect[0, :, 1]  # (7, k)
    w = probs.gather(1, idx)
    w = w / w.sum(-1, keepdim=True)
    gu, d = moe.experts.gate_up_proj, moe.experts.down_proj
    hand = torch.zeros_like(x)
    for t in range(7):
        for j in range(2):
            g, u = (x[t] @ gu[idx[t, j]].T).chunk(2)
            hand[t] += w[t, j] * ((F.silu(g) * u) @ d[idx[t, j]].T)
    hand = hand + torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    with torch.no_grad():
        got = moe(inputs["x"], routing=expect[:, :, 1])[0][0]
    torch.testing.assert_close(got, hand, atol=1e-6, rtol=1e-5)
    assert not torch.equal(out.logits, model(ids).logits)  # other experts, other outputs
    for layer in (0, 2):  # every MoE router still learns
        assert grads[f"model.layers.{layer}.mlp.gate.weight"].abs().sum() > 0


def test_routing_of_the_wrong_shape_is_refused():
    model = CausalLM(ModelConfig(**MOE))
    with pytest.raises(ValueError, match="routing has shape"):
        model(torch.randint(0, 97, (1, 5)), routing=torch.zeros(1, 5, 3, 2, dtype=torch.long))
