"""config.json <-> ModelConfig for the transformers families astrai loads and writes.

The family table (`FAMILIES`: llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral) says
what each transformers architecture fixes and which config.json key switches what. `config_from_hf`
maps a config.json dict onto `ModelConfig`, refusing any feature astrai does not implement with
an error naming the field and its value; `pick_model_type` and `config_to_hf` go the other way,
choosing the family a model can be written as. It sits under hf.py (the directory load/save API)
beside hf_weights.py (the state-dict side), and defines `HFFormatError`, the error of all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from astrai.model.config import ModelConfig


@dataclass(frozen=True)
class Family:
    """What a transformers architecture fixes, and which config key switches what."""

    architecture: str
    moe: bool = False
    qk_norm: bool = False
    bias_key: str | None = None  # config key turning projection biases on; None = fixed
    bias_fixed: bool = False  # the bias setting when bias_key is None or absent from config.json
    bias_on_o: bool = False  # the family's bias also covers o_proj (astrai's does not)
    shared_expert: bool = False  # the family has a (gated) shared expert
    # Mixtral's layout: every layer sparse, top-k weights always renormalised, experts sized by
    # intermediate_size and counted by num_local_experts, files keyed block_sparse_moe.*.w1/w2/w3
    mixtral: bool = False
    sliding_window: bool = False  # config.json's sliding_window is honoured (Mistral's window)
    extra: tuple[tuple[str, Any], ...] = ()  # fixed keys written on export


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", bias_key="attention_bias", bias_on_o=True,
                    extra=(("mlp_bias", False), ("pretraining_tp", 1))),
    "mistral": Family("MistralForCausalLM", sliding_window=True),
    "qwen2": Family("Qwen2ForCausalLM", bias_fixed=True,
                    extra=(("use_sliding_window", False), ("sliding_window", None))),
    "qwen3": Family("Qwen3ForCausalLM", qk_norm=True, bias_key="attention_bias", bias_on_o=True,
                    extra=(("use_sliding_window", False), ("sliding_window", None))),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", moe=True, bias_key="qkv_bias", bias_fixed=True,
                        shared_expert=True, extra=(("use_sliding_window", False), ("sliding_window", None))),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", moe=True, qk_norm=True, bias_key="attention_bias",
                        bias_on_o=True, extra=(("use_sliding_window", False), ("sliding_window", None))),
    "mixtral": Family("MixtralForCausalLM", moe=True, mixtral=True, sliding_window=True,
                      extra=(("router_jitter_noise", 0.0),)),
}
# when a model's own model_type cannot express it, the first family that can is written
EXPORT_ORDER = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral")

COMMON_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "hidden_act", "initializer_range", "bos_token_id", "eos_token_id",
    "pad_token_id",
)
MOE_KEYS = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
)
# keys with no effect on the forward pass
IGNORED_KEYS = frozenset({
    "architectures", "transformers_version", "use_cache", "output_router_logits",
    "max_window_layers", "output_attentions", "output_hidden_states", "return_dict",
    "tokenizer_class", "is_decoder", "tie_encoder_decoder", "unk_token_id",
    "id2label", "label2id", "problem_type",  # a sequence-classification model's labels (its head's shape says)
})


class HFFormatError(ValueError):
    """A model directory astrai cannot load exactly (unsupported feature or mismatched weights)."""


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """Map a transformers config.json dict onto ModelConfig; unsupported features are errors."""
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise HFFormatError(
            f"config.json field 'model_type' is {model_type!r}; astrai loads {sorted(FAMILIES)}"
        )
    family = FAMILIES[model_type]
    raw = {k: v for k, v in raw.items() if k != "model_type"}  # what is left must be understood
    if "num_local_experts" in raw:  # transformers 5 writes qwen3_moe's num_experts under this name
        raw.setdefault("num_experts", raw.pop("num_local_experts"))
        raw.pop("num_local_experts", None)
    fields: dict[str, Any] = {"model_type": model_type}
    for key in COMMON_KEYS + (MOE_KEYS if family.moe else ()):
        value = raw.pop(key, None)
        if value is not None:  # None (e.g. head_dim, pad_token_id) keeps ModelConfig's default
            fields[key] = value
    if family.shared_expert:
        fields["shared_expert_intermediate_size"] = raw.pop("shared_expert_intermediate_size", 5632)
    if family.moe:
        fields.setdefault("num_experts", 0)
        if fields["num_experts"] <= 0:
            _unsupported("num_experts", fields["num_experts"], "a MoE family needs num_experts >= 1")
    if family.mixtral:
        fields["norm_topk_prob"] = True
        jitter = raw.pop("router_jitter_noise", 0.0)
        if jitter not in (0, 0.0, None):
            _unsupported("router_jitter_noise", jitter, "astrai's router adds no noise; set it to 0.0")
    fields["qk_norm"] = family.qk_norm
    bias = raw.pop(family.bias_key, family.bias_fixed) if family.bias_key else family.bias_fixed
    fields["attention_bias"] = bool(bias)
    fields["rope_theta"], fields["rope_scaling"] = _rope_from_hf(raw)
    dtype = raw.pop("dtype", None) or raw.pop("torch_dtype", None)
    raw.pop("torch_dtype", None)
    if isinstance(dtype, str):
        fields["torch_dtype"] = dtype
    fields["sliding_window"] = _check_inert_features(raw, model_type, fields.get("max_position_embeddings"))
    for key, value in raw.items():
        if key in IGNORED_KEYS or key.startswith("_"):
            continue
        _unsupported(key, value, f"astrai does not implement it for model_type '{model_type}'")
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise HFFormatError(f"config.json describes a model astrai cannot build: {e}") from e


def _unsupported(key: str, value: Any, why: str) -> None:
    raise HFFormatError(f"config.json field '{key}' = {value!r} is not supported: {why}")


def _check_inert_features(raw: dict[str, Any], model_type: str, max_len: int | None) -> int | None:
    """Pop the keys that are fine only at their neutral value (no dropout, no sliding window);
    the sliding window of a family that has one (None when it covers the whole context)."""
    dropout = raw.pop("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        _unsupported("attention_dropout", dropout, "astrai has no attention dropout; set it to 0.0")
    raw.pop("pretraining_tp", None)  # a split matmul, mathematically the same; transformers 5 ignores it
    for key, neutral in (("mlp_bias", False), ("use_sliding_window", False)):
        value = raw.pop(key, neutral)
        if value != neutral:
            _unsupported(key, value, f"astrai supports only {key}={neutral}")
    window = raw.pop("sliding_window", None)
    if not FAMILIES[model_type].sliding_window or window in (None, 0):
        window = None  # the qwen families apply it only with use_sliding_window (refused above)
    elif not isinstance(window, int) or isinstance(window, bool) or window < 0:
        _unsupported("sliding_window", window, "expected a positive integer or null")
    elif max_len is not None and window >= max_len:
        window = None  # a window at least the context length never masks anything
    layer_types = raw.pop("layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        _unsupported("layer_types", layer_types, "astrai supports only 'full_attention' layers")
    if "quantization_config" in raw:
        _unsupported("quantization_config", raw["quantization_config"], "dequantise the weights first")
    return window  # kept: the model refuses sequences longer than it


def _rope_from_hf(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5 `rope_parameters` or 4.x `rope_theta` +
    `rope_scaling`."""
    params = dict(raw.pop("rope_parameters", None) or {})
    legacy = raw.pop("rope_scaling", None)
    theta = raw.pop("rope_theta", None)
    if legacy:
        params = {**legacy, **params}
    if params and "rope_type" not in params and "type" not in params and any(
        isinstance(v, dict) for v in params.values()
    ):
        _unsupported("rope_parameters", params, "per-layer-type RoPE is not supported")
    theta = float(params.pop("rope_theta", theta if theta is not None else 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ("linear", "llama3"):
        _unsupported("rope_parameters.rope_type", kind, "astrai implements 'default', 'linear' and 'llama3'")
    return theta, {"rope_type": kind, **params}


def pick_model_type(config: ModelConfig) -> str:
    """The HF family to write: among those that can express the model, the ones that need no
    zero o_proj bias first, then the config's own model_type, then EXPORT_ORDER."""
    order = (config.model_type, *EXPORT_ORDER) if config.model_type in FAMILIES else EXPORT_ORDER
    reasons = {mt: _misfit(config, mt) for mt in order}
    fits = [mt for mt in order if reasons[mt] is None]
    if not fits:
        detail = "; ".join(f"{k}: {v}" for k, v in reasons.items())
        raise HFFormatError(f"no transformers family can express this model ({detail})")
    return min(fits, key=lambda mt: config.attention_bias and FAMILIES[mt].bias_on_o)


def _misfit(config: ModelConfig, model_type: str) -> str | None:
    family = FAMILIES[model_type]
    moe = config.num_experts > 0
    if moe != family.moe:
        return "needs num_experts > 0" if family.moe else "has no mixture-of-experts layers"
    if config.qk_norm != family.qk_norm:
        return f"qk_norm must be {family.qk_norm}"
    if family.bias_key is None and config.attention_bias != family.bias_fixed:
        return f"attention_bias must be {family.bias_fixed}"
    if moe and config.shared_expert_intermediate_size and not family.shared_expert:
        return "has no shared expert"
    if config.sliding_window is not None and not family.sliding_window:
        return f"has no sliding window (this model's is {config.sliding_window})"
    if family.mixtral and not (config.norm_topk_prob and config.decoder_sparse_step == 1
                               and not config.mlp_only_layers):
        return "needs renormalised top-k weights (norm_topk_prob) and every layer sparse"
    return None


def config_to_hf(config: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """A transformers config.json dict for `config` written as `model_type` (default: picked)."""
    model_type = model_type or pick_model_type(config)
    reason = _misfit(config, model_type)
    if reason is not None:
        raise HFFormatError(f"model cannot be written as model_type '{model_type}': {reason}")
    family = FAMILIES[model_type]
    out: dict[str, Any] = {"architectures": [family.architecture], "model_type": model_type}
    for key in COMMON_KEYS + (MOE_KEYS if family.moe else ()):
        value = getattr(config, key)
        out[key] = list(value) if isinstance(value, list) else value
    if family.shared_expert:
        out["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    if family.mixtral:  # its experts are sized by intermediate_size (no layer is dense)
        for key in ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            del out[key]
        out["num_local_experts"] = out.pop("num_experts")
        out["intermediate_size"] = config.moe_intermediate_size
    if family.bias_key:
        out[family.bias_key] = config.attention_bias
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        scaling = dict(config.rope_scaling)
        scaling["rope_type"] = scaling.pop("type", None) or scaling["rope_type"]
        rope.update(scaling)
    out["rope_parameters"] = rope
    out["rope_theta"] = config.rope_theta  # what transformers 4.x reads
    out["attention_dropout"] = 0.0
    out.update(dict(family.extra))
    if family.sliding_window:
        out["sliding_window"] = config.sliding_window
    out["dtype"] = config.torch_dtype
    out["use_cache"] = True
    return out
