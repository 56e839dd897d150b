"""LoRA: adapters on named projections, only adapters trainable, merge equals the adapted model,
and the merged model saves as a normal model directory that loads back (and in transformers)."""

from __future__ import annotations

import pytest
import torch

from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.lora import LoraLinear, apply_lora, lora_state_dict, merge_lora
from astrai.model.transformer import CausalLM

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def model(**kw) -> CausalLM:
    return CausalLM(ModelConfig(**{**CONFIG, **kw}), seed=0)


def randomize_adapters(m):
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)


def test_only_named_projections_wrapped_and_trainable():
    m = model()
    wrapped = apply_lora(m, r=4, alpha=8, targets=["q", "v", "down"])
    assert sorted(w.rsplit(".", 1)[1] for w in wrapped) == ["down_proj"] * 2 + ["q_proj"] * 2 + ["v_proj"] * 2
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(m)) and len(trainable) == 12
    assert "model.layers.0.self_attn.q_proj.weight" in m.state_dict()  # base keys keep HF names
    assert isinstance(m.model.layers[0].self_attn.q_proj, LoraLinear)
    assert not isinstance(m.model.layers[0].self_attn.k_proj, LoraLinear)


def test_fresh_adapters_leave_outputs_unchanged_and_training_moves_only_adapters():
    m = model().eval()
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        before = m(ids).logits
    base = {k: v.clone() for k, v in m.state_dict().items()}
    apply_lora(m, r=4, alpha=8, dropout=0.1)
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(ids).logits, before)  # B = 0
    m.train()
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        loss = m(ids).logits.logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = m.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base.items())
    assert any(v.abs().sum() > 0 for k, v in lora_state_dict(m).items() if k.endswith("lora_B"))


def test_merge_equals_adapted_model_and_tied_embedding_survives():
    m = model(tie_word_embeddings=True).eval()
    apply_lora(m, r=4, alpha=16)
    randomize_adapters(m)
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        adapted = m(ids).logits
        merged = merge_lora(m)(ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert not any(isinstance(x, LoraLinear) for x in m.modules())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert all(p.requires_grad for p in m.parameters())


def test_saved_merged_model_is_a_normal_model_dir(tmp_path):
    m = model().eval()
    apply_lora(m, r=2, alpha=4)
    randomize_adapters(m)
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        adapted = m(ids).logits
    save_model(m, tmp_path)
    assert any(isinstance(x, LoraLinear) for x in m.modules())  # saving did not merge in place
    with torch.no_grad():
        loaded = load_model(tmp_path).eval()(ids).logits
    torch.testing.assert_close(loaded, adapted, atol=1e-5, rtol=1e-5)


def test_merged_dir_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    m = model(attention_bias=True).eval()
    apply_lora(m, r=2, alpha=4, targets=["q", "k", "gate"])
    randomize_adapters(m)
    save_model(m, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, m(ids).logits, atol=1e-4, rtol=0)


def test_bad_targets_and_rank():
    with pytest.raises(ValueError, match="unknown LoRA target"):
        apply_lora(model(), targets=["qkv"])
    with pytest.raises(ValueError, match="rank r"):
        apply_lora(model(), r=0)
