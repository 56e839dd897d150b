"""State dicts between astrai's CausalLM and Hugging Face checkpoint files.

Parameter names are HF's, so the map is identity except where layouts differ: the fused expert
tensors that CausalLM (like transformers 5) keeps in memory are split into the per-expert keys of
checkpoint files and fused back (`split_experts` / `fuse_experts`), Mixtral's file names
(block_sparse_moe.*.w1/w2/w3) are renamed to astrai's, and what a family's architecture has but
astrai's lacks (a zero o_proj bias, an empty qwen2_moe shared expert) is dropped on the way in
and written as zeros on the way out. hf_dir.py calls `state_dict_from_hf` after reading
safetensors and `state_dict_to_hf` before writing them; the family table comes from hf_config.py.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from astrai.model.config import ModelConfig
from astrai.model.hf_config import FAMILIES, HFFormatError

# Mixtral's file names for an expert's projections, and astrai's (= Qwen-MoE's)
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_O_BIAS = re.compile(r"^.*\.self_attn\.o_proj\.bias$")
_SHARED = re.compile(r"^.*\.mlp\.shared_expert(_gate|\.\w+_proj)\.weight$")


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
