"""LoRA adapters as PEFT directories: written here and opened by PEFT with the same logits, made by
PEFT and loaded here with the same logits (a reward model's SEQ_CLS adapter too), merged by `astrai lora merge`, and the adapter-disabled
view that stands in for a reference model."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.cli import main as astrai_main
from astrai.model.classifier import load_classifier
from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterDisabled,
    apply_lora,
    load_adapter,
    read_adapter_config,
    save_adapter,
)
from astrai.model.transformer import CausalLM
from astrai.model.value import ValueModel

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def base_dir(tmp_path):
    path = tmp_path / "base"
    save_model(CausalLM(ModelConfig(**CONFIG), seed=0), path)
    return path


def adapted(base_dir, **kw) -> CausalLM:
    m = load_model(base_dir).eval()
    apply_lora(m, **{"r": 4, "alpha": 8, **kw})
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("lora_B"):
                p.normal_(0, 0.1)
    return m


IDS = torch.tensor([[1, 5, 9, 13, 2, 7], [3, 3, 8, 40, 63, 0]])


def test_adapter_dir_is_peft_format_and_loads_back_merged(tmp_path, base_dir):
    m = adapted(base_dir, targets=["q", "v", "down"])
    save_adapter(m, tmp_path / "ad", str(base_dir))
    config = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["base_model_name_or_path"] == str(base_dir)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "ad" / ADAPTER_WEIGHTS)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 12
    with torch.no_grad():
        want = m(IDS).logits
        for loaded in (load_model(tmp_path / "ad"), load_model(base_dir, lora=tmp_path / "ad")):
            assert not any(n.endswith("lora_A") for n, _ in loaded.named_parameters())  # merged: a plain model
            torch.testing.assert_close(loaded.eval()(IDS).logits, want, atol=1e-5, rtol=1e-5)


def test_astrai_adapter_opens_in_peft_with_the_same_logits(tmp_path, base_dir):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    m = adapted(base_dir)
    save_adapter(m, tmp_path / "ad", str(base_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=IDS).logits, m(IDS).logits, atol=1e-4, rtol=0)


def test_peft_made_adapter_loads_here_with_the_same_logits(tmp_path, base_dir):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["k_proj", "o_proj", "up_proj"], task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(hf, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.eval().save_pretrained(tmp_path / "peft_ad")
    with torch.no_grad():
        want = peft_model(input_ids=IDS).logits
        unmerged = load_model(base_dir).eval()
        load_adapter(unmerged, tmp_path / "peft_ad")
        torch.testing.assert_close(unmerged(IDS).logits, want, atol=1e-4, rtol=0)
        merged = load_model(base_dir, lora=tmp_path / "peft_ad").eval()
        torch.testing.assert_close(merged(IDS).logits, want, atol=1e-4, rtol=0)


def test_peft_made_reward_model_adapter_loads_here_with_the_same_scores(tmp_path, base_dir):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1, dtype=torch.float32)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], task_type="SEQ_CLS")
    peft_model = peft.get_peft_model(hf, lora)  # SEQ_CLS: the score head trains whole (modules_to_save)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "score" in name:
                p.normal_(0, 0.1)
    peft_model.eval().save_pretrained(tmp_path / "rm_ad")
    assert read_adapter_config(tmp_path / "rm_ad")["modules_to_save"] == ["classifier", "score"]
    with torch.no_grad():
        want = peft_model(input_ids=IDS[:1]).logits[0, 0]
        got = load_classifier(tmp_path / "rm_ad").eval()(IDS[:1])[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="is a sequence-classification .reward model. adapter, but the model is a CausalLM"):
        load_model(tmp_path / "rm_ad")


def test_lora_merge_command_writes_a_plain_model_dir(tmp_path, base_dir):
    m = adapted(base_dir)
    save_adapter(m, tmp_path / "ad", str(base_dir))
    assert astrai_main(["lora", "merge", "--base", str(base_dir), "--adapter", str(tmp_path / "ad"),
                        "--out", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file() and not (tmp_path / "merged" / ADAPTER_CONFIG).exists()
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "merged")(IDS).logits, m(IDS).logits, atol=1e-5, rtol=1e-5)
    # --base defaults to the adapter's base_model_name_or_path
    assert astrai_main(["lora", "merge", "--adapter", str(tmp_path / "ad"), "--out", str(tmp_path / "m2")]) == 0
    assert (tmp_path / "m2" / "model.safetensors").is_file()


def test_unsupported_peft_options_are_errors(tmp_path, base_dir):
    m = adapted(base_dir)
    save_adapter(m, tmp_path / "ad", str(base_dir))
    config = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        read_adapter_config(tmp_path / "ad")
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match=r"modules_to_save=\['lm_head'\] with task_type='CAUSAL_LM' is not supported"):
        read_adapter_config(tmp_path / "ad")


def test_adapter_disabled_view_is_the_base_without_a_copy(base_dir):
    base = load_model(base_dir).eval()
    m = adapted(base_dir)
    view = AdapterDisabled(m)
    with torch.no_grad():
        torch.testing.assert_close(view(IDS).logits, base(IDS).logits, atol=0, rtol=0)
        assert not torch.allclose(m(IDS).logits, base(IDS).logits)  # the adapters are back on after the call
    assert view.model is m


def test_critic_of_a_lora_policy_shares_the_frozen_base(base_dir):
    m = adapted(base_dir)
    critic = ValueModel.from_policy(m)
    policy_ptrs = {p.data_ptr() for p in m.parameters() if not p.requires_grad}
    frozen = [p for p in critic.parameters() if not p.requires_grad]
    assert frozen and all(p.data_ptr() in policy_ptrs for p in frozen)  # no second base
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) or n.startswith("value_head") for n in trainable)
    lora_ptrs = {p.data_ptr() for n, p in m.named_parameters() if p.requires_grad}
    assert not any(p.data_ptr() in lora_ptrs for p in critic.parameters() if p.requires_grad)  # own adapters
