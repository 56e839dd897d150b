"""hf.py's file handling: shards, fused expert tensors, family choice on save, special ids,
tokenizer files, and loud errors for anything astrai would otherwise load wrongly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.model.config import ModelConfig
from astrai.model.hf import load_model, save_model
from astrai.model.hf_config import HFFormatError, pick_model_type
from astrai.model.hf_weights import fuse_experts, split_experts
from astrai.model.transformer import CausalLM

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def tiny(**kw) -> CausalLM:
    return CausalLM(ModelConfig(**{**TINY, **kw}), seed=0).eval()


def same_logits(a: CausalLM, b: CausalLM) -> bool:
    ids = torch.randint(0, a.config.vocab_size, (2, 7))
    with torch.no_grad():
        return torch.equal(a(ids).logits, b(ids).logits)


def test_sharded_save_writes_index_and_loads_back(tmp_path):
    model = tiny()
    save_model(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(model.state_dict())
    assert same_logits(model, load_model(tmp_path))
    save_model(model, tmp_path)  # a later unsharded save replaces the shards
    assert (tmp_path / "model.safetensors").exists()
    assert not list(tmp_path.glob("model-*-of-*.safetensors"))


def test_fused_expert_tensors_are_split(tmp_path):
    model = tiny(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True)
    save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for i in range(2):  # the layout transformers 5 keeps in memory: (E, 2I, C) and (E, C, I)
        p = f"model.layers.{i}.mlp.experts"
        gate = [tensors.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)]
        up = [tensors.pop(f"{p}.{e}.up_proj.weight") for e in range(4)]
        down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(4)]
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[f"{p}.down_proj"] = torch.stack(down)
    save_file(tensors, tmp_path / "model.safetensors")
    assert same_logits(model, load_model(tmp_path))


@pytest.mark.parametrize(("features", "model_type"), [
    ({}, "llama"),
    ({"attention_bias": True}, "qwen2"),
    ({"qk_norm": True}, "qwen3"),
    ({"qk_norm": True, "attention_bias": True}, "qwen3"),
    ({"num_experts": 4, "shared_expert_intermediate_size": 32}, "qwen2_moe"),
    ({"num_experts": 4}, "qwen2_moe"),
    ({"num_experts": 4, "qk_norm": True}, "qwen3_moe"),
    ({"model_type": "mistral"}, "mistral"),
    ({"model_type": "mistral", "attention_bias": True}, "qwen2"),
    ({"model_type": "mixtral", "num_experts": 4, "norm_topk_prob": True}, "mixtral"),
    ({"model_type": "mixtral", "num_experts": 4}, "qwen2_moe"),  # Mixtral always renormalises top-k
])
def test_save_picks_family_from_features(features, model_type):
    assert pick_model_type(ModelConfig(**{**TINY, **features})) == model_type


def test_no_family_for_qk_norm_with_shared_expert():
    config = ModelConfig(**TINY, num_experts=4, qk_norm=True, shared_expert_intermediate_size=32)
    with pytest.raises(HFFormatError, match="shared expert"):
        pick_model_type(config)


def test_qwen3_with_qkv_bias_round_trips_through_zero_o_bias(tmp_path):
    model = tiny(qk_norm=True, attention_bias=True)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.bias.normal_()
    save_model(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert not tensors["model.layers.0.self_attn.o_proj.bias"].any()
    assert same_logits(model, load_model(tmp_path))
    tensors["model.layers.0.self_attn.o_proj.bias"][0] = 1.0
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(HFFormatError, match="o_proj.bias"):
        load_model(tmp_path)


def test_tied_embeddings_are_written_once_and_retied(tmp_path):
    save_model(tiny(tie_word_embeddings=True), tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    save_model(tiny(), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(HFFormatError, match=r"missing 1 \[model.layers.1.mlp.up_proj.weight\].*"
                                            r"unexpected 1 \[model.layers.1.mlp.extra.weight\]"):
        load_model(tmp_path)


def test_wrong_shape_is_an_error(tmp_path):
    save_model(tiny(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(HFFormatError, match=r"gate_proj.weight \(48, 32\) \(expected \(40, 32\)\)"):
        load_model(tmp_path)


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("use_sliding_window", True, "'use_sliding_window' = True"),
    ("layer_types", ["sliding_attention", "full_attention"], "'layer_types' = ['sliding_attention'"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}, "'rope_parameters.rope_type' = 'yarn'"),
    ("attention_dropout", 0.1, "'attention_dropout' = 0.1"),
    ("mlp_bias", True, "'mlp_bias' = True"),
    ("hidden_act", "gelu", "'hidden_act' is 'gelu'"),
    ("model_type", "gpt2", "'model_type' is 'gpt2'"),
    ("some_new_feature", 3, "'some_new_feature' = 3"),
])
def test_unsupported_config_feature_names_field_and_value(tmp_path, key, value, shown):
    save_model(tiny(model_type="qwen2", attention_bias=True), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(HFFormatError) as err:
        load_model(tmp_path)
    assert shown in str(err.value)


def test_mistral_window_longer_than_context_is_full_attention(tmp_path):
    save_model(tiny(model_type="mistral"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 4096}))
    loaded = load_model(tmp_path)
    assert loaded.config.model_type == "mistral" and loaded.config.sliding_window is None


def test_qwen2_window_without_use_sliding_window_is_inert(tmp_path):
    # transformers applies a qwen window only with use_sliding_window, which is refused above
    save_model(tiny(model_type="qwen2", attention_bias=True), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    assert load_model(tmp_path).config.sliding_window is None


def test_mistral_window_shorter_than_context_caps_the_sequence_length(tmp_path):
    from astrai.infer.engine import LLMEngine

    model = tiny(model_type="mistral", sliding_window=8)
    save_model(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == 8
    loaded = load_model(tmp_path)
    assert loaded.config.sliding_window == 8 and same_logits(model, loaded)  # 7 tokens: inside the window
    with pytest.raises(ValueError, match="sliding_window is 8"):
        loaded(torch.zeros(1, 9, dtype=torch.long))
    packed = torch.tensor([list(range(6)) * 2])  # two documents of 6 tokens: each inside the window
    loaded(torch.zeros(1, 12, dtype=torch.long), position_ids=packed)
    assert LLMEngine(loaded, None, kv_cache_tokens=64).max_model_len == 8
    with pytest.raises(ValueError, match="set max_model_len to at most 8"):
        LLMEngine(loaded, None, kv_cache_tokens=64, max_model_len=16)
    assert pick_model_type(ModelConfig(**TINY, sliding_window=8)) == "mistral"  # llama has no window
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": "wide"}))
    with pytest.raises(HFFormatError, match="'sliding_window' = 'wide'"):
        load_model(tmp_path)


def test_mixtral_files_round_trip_and_router_noise_is_refused(tmp_path):
    model = tiny(model_type="mixtral", num_experts=4, norm_topk_prob=True, moe_intermediate_size=24)
    save_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_local_experts"] == 4 and config["intermediate_size"] == 24
    assert "moe_intermediate_size" not in config and "num_experts" not in config
    keys = set(load_file(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys  # Mixtral's file names
    assert not any(".mlp." in k for k in keys)
    loaded = load_model(tmp_path)
    assert loaded.config.model_type == "mixtral" and same_logits(model, loaded)
    (tmp_path / "config.json").write_text(json.dumps({**config, "router_jitter_noise": 0.1}))
    with pytest.raises(HFFormatError, match="'router_jitter_noise' = 0.1"):
        load_model(tmp_path)


def test_weights_read_back_whatever_model_type_the_config_names(tmp_path):
    # a training config may name no HF family; its checkpoints are written as one that fits
    from astrai.model.hf_weights import state_dict_from_hf
    from astrai.model.safetensors_io import read_safetensors

    for features in ({"attention_bias": True, "qk_norm": True}, {"num_experts": 4, "norm_topk_prob": True}):
        model = tiny(model_type="my-model", **features)
        save_model(model, tmp_path / str(len(features)))
        tensors = state_dict_from_hf(read_safetensors(tmp_path / str(len(features))), model.config)
        assert not any("o_proj.bias" in k for k in tensors)  # the zero output biases qwen3 carries


def test_legacy_rope_keys_and_missing_weights_file(tmp_path):
    model = tiny(rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    save_model(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["rope_parameters"]
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}  # transformers 4.x spelling
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(tmp_path)
    assert loaded.config.rope_theta == 5e5 and loaded.config.rope_scaling["factor"] == 2.0
    assert same_logits(model, loaded)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


class FakeTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 5, 6, 7

    def save(self, path):
        (path / "tokenizer.json").write_text("{}")


def test_generation_config_and_tokenizer_files(tmp_path):
    save_model(tiny(eos_token_id=3), tmp_path, tokenizer=FakeTokenizer())
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 5, "eos_token_id": 3, "pad_token_id": 7}
    assert (tmp_path / "tokenizer.json").exists()
    loaded = load_model(tmp_path, dtype="auto")
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (5, 3)
    assert loaded.lm_head.weight.dtype == torch.float32


def test_split_and_fuse_experts_are_inverse():
    gen = torch.Generator().manual_seed(0)
    fused = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 5, generator=gen),
             "model.layers.0.mlp.experts.down_proj": torch.randn(3, 5, 4, generator=gen),
             "model.norm.weight": torch.randn(5, generator=gen)}
    split = split_experts(fused)
    assert split["model.layers.0.mlp.experts.2.up_proj.weight"].equal(fused["model.layers.0.mlp.experts.gate_up_proj"][2, 4:])
    assert len(split) == 3 * 3 + 1
    again = fuse_experts(split, fused)  # a model whose state dict holds the fused layout
    assert again.keys() == fused.keys() and all(again[k].equal(v) for k, v in fused.items())


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("features", [
    {"num_experts": 4, "moe_intermediate_size": 16},  # qwen2_moe with an empty shared expert
    {"qk_norm": True, "attention_bias": True},  # qwen3 with a zero o_proj bias
])
def test_padded_families_load_in_transformers(tmp_path, features):
    transformers = pytest.importorskip("transformers")
    model = tiny(**features)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    save_model(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert same_logits(model, load_model(tmp_path))
