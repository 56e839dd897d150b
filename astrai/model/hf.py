"""Hugging Face model directories in and out: config.json + safetensors <-> CausalLM.

This is the border of the model layer. `load_model` reads a directory written by transformers
(or by astrai) for the families llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe and mixtral, maps its
`config.json` onto `ModelConfig` and its weights onto `CausalLM` (parameter names are HF's, so
the map is identity except for the fused expert tensors that transformers 5 keeps in memory and
zero output-projection biases). `save_model` writes the same format back, choosing the family
from the features the model uses, so that `AutoModelForCausalLM.from_pretrained` loads it.
A feature astrai does not implement is an error naming the field and its value, and weights
that do not match the model exactly are an error listing the keys: nothing loads half-random.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from astrai.model.attention import rope_inv_freq
from astrai.model.config import ModelConfig
from astrai.model.manifest import check_model_dir
from astrai.model.transformer import CausalLM

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# generation_config.json's sampling defaults (HF names), carried from a loaded model to its saves
GENERATION_SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p",
                            "repetition_penalty", "max_new_tokens")


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
# Mixtral's file names for an expert's projections, and astrai's (= Qwen-MoE's)
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

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
})


class HFFormatError(ValueError):
    """A model directory astrai cannot load exactly (unsupported feature or mismatched weights)."""


# -- config.json <-> ModelConfig ------------------------------------------------------------------
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


# -- weights ------------------------------------------------------------------------------------
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_O_BIAS = re.compile(r"^.*\.self_attn\.o_proj\.bias$")
_SHARED = re.compile(r"^.*\.mlp\.shared_expert(_gate|\.\w+_proj)\.weight$")


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a model directory: model.safetensors or the shards of its index."""
    path = Path(path)
    if (path / SAFE_INDEX).exists():
        weight_map = _read_json(path / SAFE_INDEX)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (path / SAFE_WEIGHTS).exists():
        files = [SAFE_WEIGHTS]
    else:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "no such directory"
        raise FileNotFoundError(
            f"{path} has neither {SAFE_WEIGHTS} nor {SAFE_INDEX} (found: {found}); "
            "save the model with safetensors (transformers' save_pretrained does by default)"
        )
    tensors: dict[str, Tensor] = {}
    for name in files:
        try:
            with safe_open(path / name, framework="pt") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise HFFormatError(f"{path / name} is damaged and cannot be read ({reason}); "
                                "restore the file or point to another model directory") from None
    return tensors


def _read_json(file: Path) -> Any:
    """A JSON file of a model directory; a damaged one is an error naming it."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFFormatError(f"{file} is damaged: not valid JSON ({exc}); restore the file or point to "
                            "another model directory") from None


def check_device(device: torch.device | str | None) -> torch.device:
    """`device` as a torch.device, or a one-line ValueError when it is unknown or not available here."""
    if isinstance(device, torch.device):
        parsed = device
    else:
        try:
            parsed = torch.device(device or "cpu")
        except (RuntimeError, TypeError):
            raise ValueError(f"device {device!r} is unknown; use cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} is not available: torch sees no CUDA GPU; use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"device {str(device)!r} is not available: torch sees {count} CUDA GPU(s), "
                             f"cuda:0..cuda:{count - 1}")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r} is not available on this machine; use cpu")
    elif parsed.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"device {str(device)!r} is not supported; use cpu, cuda, cuda:N or mps")
    return parsed


def split_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Fused expert tensors (transformers 5's in-memory layout: gate_up_proj (E, 2I, C) with
    gate rows first, down_proj (E, C, I)) -> per-expert `experts.{e}.*_proj.weight` keys, the
    layout of checkpoint files. Other keys pass through."""
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        fused = _FUSED.match(key)
        if not (fused and t.dim() == 3):
            out[key] = t
            continue
        prefix, kind = fused.groups()
        for e in range(t.shape[0]):
            if kind == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)  # (I, C) each
                out[f"{prefix}.{e}.gate_proj.weight"] = gate
                out[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def fuse_experts(tensors: dict[str, Tensor], expected: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of split_experts for every fused key the model expects (per-expert -> 3D)."""
    out = dict(tensors)
    for key, ref in expected.items():
        fused = _FUSED.match(key)
        if not (fused and ref.dim() == 3 and key not in out):
            continue
        prefix, kind = fused.groups()
        names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        parts = [f"{prefix}.{e}.{n}.weight" for e in range(ref.shape[0]) for n in names]
        if all(p in out for p in parts):
            per_expert = [torch.cat([out.pop(p) for p in parts[i:i + len(names)]])
                          for i in range(0, len(parts), len(names))]
            out[key] = torch.stack(per_expert)  # (E, 2I, C) or (E, C, I)
    return out


_MIXTRAL_FILE_KEY = re.compile(r"^(.*)\.block_sparse_moe\.(gate\.weight|experts\.\d+\.)(w1|w2|w3)?(\.weight)?$")
_MOE_KEY = re.compile(r"^(.*)\.mlp\.(gate\.weight|experts\.\d+\.)(gate_proj|up_proj|down_proj)?(\.weight)?$")


def _rename_moe_keys(tensors: dict[str, Tensor], to_mixtral: bool) -> dict[str, Tensor]:
    """Mixtral's file names (block_sparse_moe.gate, experts.{e}.w1/w3/w2) <-> astrai's
    (mlp.gate, experts.{e}.gate_proj/up_proj/down_proj); other keys pass through."""
    pattern, names = (_MOE_KEY, {v: k for k, v in MIXTRAL_EXPERT_NAMES.items()}) if to_mixtral \
        else (_MIXTRAL_FILE_KEY, MIXTRAL_EXPERT_NAMES)
    block = "block_sparse_moe" if to_mixtral else "mlp"
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        m = pattern.match(key)
        if m is None:
            out[key] = t
        else:
            prefix, part, proj, suffix = m.groups()
            out[f"{prefix}.{block}.{part}{names[proj] if proj else ''}{suffix or ''}"] = t
    return out


def state_dict_from_hf(tensors: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Map HF tensors onto CausalLM names (per-expert layout): drop zero o_proj biases and the
    duplicate lm_head of tied embeddings."""
    # decided by the names in the file, not by config.model_type: a training run's config may
    # name no family, and its checkpoints are written as whichever family fits
    if any(".block_sparse_moe." in key for key in tensors):
        tensors = _rename_moe_keys(tensors, to_mixtral=False)
    out: dict[str, Tensor] = {}
    for key, t in split_experts(tensors).items():
        if _O_BIAS.match(key):  # astrai's attention has no output bias: only zeros can be dropped
            if bool(t.any()):
                raise HFFormatError(
                    f"weight '{key}' is nonzero but astrai's attention has no output bias; "
                    "this checkpoint cannot be loaded exactly"
                )
        elif _SHARED.match(key) and config.num_experts and not config.shared_expert_intermediate_size:
            continue  # the empty shared expert of a qwen2_moe written without one: adds zero
        elif key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # transformers ties it to the embedding as well
        else:
            out[key] = t
    return out


def state_dict_to_hf(state: dict[str, Tensor], config: ModelConfig, model_type: str) -> dict[str, Tensor]:
    """CausalLM state dict -> the tensors transformers expects for `model_type` (CPU, contiguous,
    per-expert keys as transformers' save_pretrained writes them)."""
    out: dict[str, Tensor] = {}
    for key, t in split_experts(state).items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # safetensors refuses shared storage; transformers re-ties on load
        t = out[key] = t.detach().to("cpu").contiguous()
        # what the family's architecture has and astrai's lacks is written as zeros that add 0
        if key.endswith("self_attn.v_proj.bias") and FAMILIES[model_type].bias_on_o:
            out[key.replace("v_proj.bias", "o_proj.bias")] = torch.zeros(config.hidden_size, dtype=t.dtype)
        if key.endswith("mlp.gate.weight") and FAMILIES[model_type].shared_expert \
                and not config.shared_expert_intermediate_size:
            mlp, C = key.removesuffix("gate.weight"), config.hidden_size
            for name, shape in (("gate_proj", (0, C)), ("up_proj", (0, C)), ("down_proj", (C, 0))):
                out[f"{mlp}shared_expert.{name}.weight"] = torch.zeros(shape, dtype=t.dtype)
            out[f"{mlp}shared_expert_gate.weight"] = torch.zeros(1, C, dtype=t.dtype)
    return _rename_moe_keys(out, to_mixtral=True) if FAMILIES[model_type].mixtral else out


def _check_keys(tensors: dict[str, Tensor], expected: dict[str, Tensor], where: str) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise HFFormatError(
            f"weights in {where} do not match the model built from its config.json: "
            f"missing {len(missing)} {_abbrev(missing)}, unexpected {len(unexpected)} {_abbrev(unexpected)}"
        )
    wrong = [
        f"{k} {tuple(tensors[k].shape)} (expected {tuple(expected[k].shape)})"
        for k in expected if tensors[k].shape != expected[k].shape
    ]
    if wrong:
        raise HFFormatError(f"weights in {where} have the wrong shape: {_abbrev(wrong)}")


def _abbrev(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return f"[{shown}{', ...' if len(items) > limit else ''}]"


# -- public API ---------------------------------------------------------------------------------
def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a model directory (eos from generation_config.json when config lacks it)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file} not found; a model directory needs config.json")
    raw = _read_json(config_file)
    if not isinstance(raw, dict):
        raise HFFormatError(f"{config_file} is damaged: expected a JSON object, got {type(raw).__name__}")
    config = config_from_hf(raw)
    generation_file = path / "generation_config.json"
    if generation_file.exists():
        generation = _read_json(generation_file)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(config, key) is None and generation.get(key) is not None:
                setattr(config, key, generation[key])
    return config


def resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    """None -> float32 (training precision); "auto" -> the dtype recorded in config.json."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    value = getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32' or 'bfloat16'")
    return value


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
    verify: bool = False, lora: str | Path | None = None,
) -> CausalLM:
    """A CausalLM from a HF model directory; built on the meta device, then given the weights.
    A checkpoint directory's manifest is checked first: file sizes always, sha256 with `verify`.
    A PEFT adapter directory (a LoRA run's checkpoint) loads its base with the adapter merged,
    and so does a base directory with `lora=ADAPTER_DIR`."""
    path = Path(path)
    check_device(device)
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        from astrai.model.lora import resolve_base

        return load_model(resolve_base(path), dtype=dtype, device=device, verify=verify, lora=path)
    check_model_dir(path, verify=verify)
    config = load_config(path)
    model = build_model(config, read_safetensors(path), dtype, device, where=str(path))
    if lora is not None:
        from astrai.model.lora import load_adapter, merge_lora

        load_adapter(model, lora)
        merge_lora(model)
    # the source's sampling defaults travel with the weights, so a fine-tune's checkpoints keep them
    model.generation_defaults = load_generation_defaults(path)
    return model


def load_generation_defaults(path: str | Path) -> dict[str, Any]:
    """The sampling defaults (temperature, top_p, ...) in a model directory's generation_config.json,
    with HF's names; {} when the file is absent or sets none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    raw = _read_json(file)
    if not isinstance(raw, dict):
        raise HFFormatError(f"{file} is damaged: expected a JSON object, got {type(raw).__name__}")
    return {k: raw[k] for k in GENERATION_SAMPLING_KEYS if raw.get(k) is not None}


def build_model(
    config: ModelConfig,
    tensors: dict[str, Tensor],
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    where: str = "the state dict",
) -> CausalLM:
    """CausalLM(config) holding exactly `tensors` (HF names/layouts); any key mismatch raises."""
    dtype = resolve_dtype(dtype, config)
    device = torch.device(device or "cpu")
    model = CausalLM(config, seed=None, device="meta")
    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    tensors = fuse_experts(state_dict_from_hf(tensors, config), expected)
    _check_keys(tensors, expected, where)
    # assign=True adopts the loaded tensors: no second copy, no random init to overwrite
    tensors = {k: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
               for k, t in tensors.items()}
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.inv_freq = rope_inv_freq(config).to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise HFFormatError(f"tensors left uninitialised after loading {where}: {_abbrev(left)}")
    return model


def save_model(
    model: CausalLM,
    path: str | Path,
    tokenizer: Any | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    state_dict: dict[str, Tensor] | None = None,
) -> Path:
    """Write `model` as a HF model directory (config.json, safetensors, generation_config.json,
    and the tokenizer files when a tokenizer is given). `state_dict` overrides the model's own
    (e.g. a full state dict gathered from FSDP ranks). generation_config.json's eos_token_id lists
    every id the tokenizer stops at (so transformers' `generate` ends a chat turn where astrai
    does), and the sampling defaults `load_model` found in the source directory
    (`model.generation_defaults`) are written back."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = getattr(model, "module", model)  # DDP wrapper
    config = model.config
    model_type = pick_model_type(config)
    hf_config = config_to_hf(config, model_type)
    ids = _special_ids(config, tokenizer)
    hf_config.update(ids)
    state = state_dict if state_dict is not None else model.state_dict()
    if any(k.endswith(".lora_A") for k in state):
        from astrai.model.lora import merged_state_dict  # a LoRA run's checkpoint: fold adapters

        state = merged_state_dict(model)
    tensors = state_dict_to_hf(state, config, model_type)
    floats = [t.dtype for t in tensors.values() if t.is_floating_point()]
    if floats:
        hf_config["dtype"] = str(floats[0]).removeprefix("torch.")
    _write_shards(tensors, path, max_shard_bytes)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    write_generation_config(model, path, tokenizer)
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def write_generation_config(model: CausalLM, path: str | Path, tokenizer: Any | None = None) -> None:
    """generation_config.json: bos/pad ids, an eos_token_id list naming every id the tokenizer stops
    at (transformers' `generate` then ends a chat turn at <|im_end|> as astrai does), and the
    sampling defaults in `model.generation_defaults`."""
    ids = _special_ids(model.config, tokenizer)
    generation = {k: v for k, v in ids.items() if v is not None}
    eos = _end_of_turn_ids(model.config, tokenizer)
    if len(eos) > 1:
        generation["eos_token_id"] = eos
    generation.update(getattr(model, "generation_defaults", None) or {})
    (Path(path) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _special_ids(config: ModelConfig, tokenizer: Any | None) -> dict[str, Any]:
    """bos/eos/pad ids from the config, falling back to the tokenizer's."""
    out = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(config, key)
        if value is None and tokenizer is not None:
            value = getattr(tokenizer, key, None)
        out[key] = value
    return out


def _end_of_turn_ids(config: ModelConfig, tokenizer: Any | None) -> list[int]:
    """The config's eos ids, then every id the tokenizer stops at (eos, the chat template's
    end-of-turn token, ...): what generation_config.json's eos_token_id lists."""
    ids = list(config.eos_token_ids)
    ids += list(getattr(tokenizer, "stop_token_ids", None) or [])
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return [i for i in dict.fromkeys(ids) if isinstance(i, int) and 0 <= i < config.vocab_size]


def _write_shards(tensors: dict[str, Tensor], path: Path, max_shard_bytes: int) -> None:
    """One model.safetensors, or numbered shards plus model.safetensors.index.json."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    # files of an earlier save in another layout would shadow or confuse the new one
    for old in [*path.glob("model-*-of-*.safetensors"), path / SAFE_WEIGHTS, path / SAFE_INDEX]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / SAFE_WEIGHTS), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
