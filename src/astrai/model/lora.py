"""LoRA: low-rank adapters on named projections of a CausalLM, trained while the base is frozen.

`apply_lora(model, r, alpha, dropout, targets)` swaps the chosen `nn.Linear` projections (short
names q, k, v, o, gate, up, down, i.e. `*_proj`) for `LoraLinear`, which keeps the base
`weight`/`bias` under their original names (so state dicts and the model directory format keep
working) and adds `lora_A` (r, in) and `lora_B` (out, r). Only adapter weights stay trainable.
`merge_lora` folds W + (alpha / r) * B @ A back into plain `nn.Linear`s. `merged_state_dict`
gives the merged weights without touching the model (what `hf.save_model` writes for a model
that still carries adapters: a normal Hugging Face model directory).

Adapters travel in PEFT's format: `save_adapter` writes `adapter_config.json` +
`adapter_model.safetensors` (keys `base_model.model.<name>.lora_A.weight`), `load_adapter` reads
one (written here or by PEFT) onto a loaded base, and `resolve_base` finds an adapter's base
directory. A model class may name heads that train whole beside the adapters (PEFT's
`modules_to_save`) and its PEFT task type, as class attributes `peft_modules_to_save` and
`peft_task_type`: a reward model (`SequenceClassifier`) trains its `score` head and travels as a
`SEQ_CLS` adapter holding `base_model.model.score.weight`, the way PEFT saves one. The tensor files go through safetensors_io.py; this module imports no model
directory code: hf.py, above it, composes "adapter directory = base + adapter" for
`astrai.load_model(adapter_dir)`, `--lora` and `astrai lora merge`.
`adapters_disabled` / `AdapterDisabled` run the same module as its frozen base: the reference
model of DPO, GRPO and PPO under LoRA costs no second copy of the weights.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from astrai.model.hub import is_hub_id, resolve_model_path
from astrai.model.manifest import check_model_dir
from astrai.model.safetensors_io import read_json, read_safetensors_file, save_safetensors

PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
               "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's PeftModel -> LoraModel -> the transformers model


class LoraLinear(nn.Module):
    """y = x W^T + b + (alpha / r) * dropout(x) A^T B^T; B starts at zero, so y starts as the base's."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got {r}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the base's own Parameter: same key, shared with any tie
        self.bias = base.bias
        self.r, self.alpha = r, alpha
        self.scaling = alpha / r
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, **kw))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear: variance ~ 1/in
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False  # True inside `adapters_disabled`: the layer is its base

    def forward(self, x: Tensor) -> Tensor:
        base = F.linear(x, self.weight, self.bias)  # (..., out)
        if self.disabled:
            return base
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)  # (..., out)
        return base + self.scaling * update

    def delta_weight(self) -> Tensor:
        return lora_delta(self.lora_A, self.lora_B, self.scaling)

    def merged(self) -> nn.Linear:
        """A plain nn.Linear with W + delta; reuses the base Parameter so ties survive."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")
        with torch.no_grad():
            self.weight.add_(self.delta_weight().to(self.weight.dtype))
        linear.weight = self.weight
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.alpha}"


def lora_delta(lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """What an adapter adds to its base weight: (alpha / r) * B @ A, (out, in)."""
    return scaling * (lora_B @ lora_A)


def merged_weight(weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """A base weight with its adapter folded in, in the base's dtype: what `merged_state_dict` holds
    and a rollout server computes from a broadcast adapter (serve/admin.py)."""
    return weight + lora_delta(lora_A, lora_B, scaling).to(weight.dtype)


def modules_to_save(model: nn.Module) -> tuple[str, ...]:
    """The heads of `model` that train whole under LoRA and are saved with its adapters."""
    return tuple(getattr(getattr(model, "module", model), "peft_modules_to_save", ()))


def is_adapter_tensor(model: nn.Module, key: str) -> bool:
    """Whether state-dict `key` of `model` is saved in its adapter directory: an adapter matrix,
    or a tensor of a head that trains whole (`modules_to_save`)."""
    return key.endswith((".lora_A", ".lora_B")) or key.split(".", 1)[0] in modules_to_save(model)


def _resolve_targets(targets: tuple[str, ...] | list[str]) -> set[str]:
    unknown = [t for t in targets if t not in PROJECTIONS and t not in PROJECTIONS.values()]
    if unknown or not targets:
        raise ValueError(
            f"unknown LoRA target(s) {unknown or list(targets)}; choose from {list(PROJECTIONS)}"
        )
    return {PROJECTIONS.get(t, t) for t in targets}


def apply_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
) -> list[str]:
    """Wrap the target projections in place and freeze everything else but the model's
    `modules_to_save` (a reward model's score head); returns wrapped names."""
    names = _resolve_targets(targets)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in names and type(child) is nn.Linear:
                setattr(module, child_name, LoraLinear(child, r, alpha, dropout))
                wrapped.append(f"{name}.{child_name}" if name else child_name)
    if not wrapped:
        raise ValueError(f"no nn.Linear named {sorted(names)} found in {type(model).__name__}")
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter_tensor(model, pname))
    return wrapped


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors and whole-trained heads (what a LoRA run saves besides the
    frozen base)."""
    return {k: v for k, v in model.state_dict().items() if is_adapter_tensor(model, k)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place; the model is plain again (all
    parameters trainable, as a freshly loaded model)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoraLinear):
                setattr(module, child_name, child.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict the merged model would have, without changing `model`."""
    state = model.state_dict()
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            prefix = f"{name}." if name else ""
            del state[prefix + "lora_A"], state[prefix + "lora_B"]
            state[prefix + "weight"] = merged_weight(module.weight, module.lora_A, module.lora_B, module.scaling)
    return state


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoraLinear) for m in getattr(model, "module", model).modules())


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoraLinear of `model` computes its base layer only (the frozen base model)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    before = [m.disabled for m in layers]
    for m in layers:
        m.disabled = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m.disabled = flag


class AdapterDisabled:
    """A LoRA model's base as a callable: the same module (no copy of its weights) run with its
    adapters off. Stands in for a frozen reference model; call it under `torch.no_grad()`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied parameters count once."""
    params = list({id(p): p for p in model.parameters()}.values())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


# -- PEFT adapter directories ---------------------------------------------------------------------
def _layers(model: nn.Module) -> dict[str, LoraLinear]:
    model = getattr(model, "module", model)
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def peft_config(model: nn.Module, base_model_name_or_path: str | None) -> dict[str, Any]:
    """adapter_config.json for `model`'s adapters (one r, alpha and dropout for every layer)."""
    layers = list(_layers(model).values())
    if not layers:
        raise ValueError("the model has no LoRA adapters to save")
    first = layers[0]
    if any((m.r, m.alpha) != (first.r, first.alpha) for m in layers):
        raise ValueError("PEFT's adapter_config.json holds one r and alpha; this model's adapters differ")
    dropout = first.dropout.p if isinstance(first.dropout, nn.Dropout) else 0.0
    targets = sorted({name.rsplit(".", 1)[-1] for name in _layers(model)})
    heads = list(modules_to_save(model)) or None
    task_type = getattr(getattr(model, "module", model), "peft_task_type", "CAUSAL_LM")
    return {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
        "r": first.r, "lora_alpha": first.alpha, "lora_dropout": dropout, "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": heads, "init_lora_weights": True, "inference_mode": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "revision": None,
    }


def to_peft_key(name: str) -> str:
    """`model.layers.0.self_attn.q_proj.lora_A` -> PEFT's `base_model.model.<same>.weight`; a
    head's tensor keeps its own name: `score.weight` -> `base_model.model.score.weight`."""
    return f"{PEFT_PREFIX}{name}.weight" if name.endswith((".lora_A", ".lora_B")) else f"{PEFT_PREFIX}{name}"


def from_peft_key(key: str) -> str:
    """PEFT's key -> the state-dict name (the inverse of `to_peft_key`; PEFT's in-memory names,
    with `.default` and `.modules_to_save.default`, map the same way)."""
    name = key.removeprefix(PEFT_PREFIX).replace(".modules_to_save.default", "")
    name = name.replace(".lora_A.default", ".lora_A").replace(".lora_B.default", ".lora_B")
    return name.removesuffix(".weight") if name.endswith((".lora_A.weight", ".lora_B.weight")) else name


def save_adapter(model: nn.Module, path: str | Path, base_model_name_or_path: str | None,
                 state_dict: dict[str, Tensor] | None = None, tokenizer: Any | None = None) -> Path:
    """Write `model`'s adapters as a PEFT adapter directory (the base weights are not written).
    `state_dict` overrides the model's own (e.g. gathered from FSDP ranks)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(model, base_model_name_or_path)
    state = state_dict if state_dict is not None else getattr(model, "module", model).state_dict()
    tensors = {to_peft_key(k): v.detach().to("cpu").contiguous()
               for k, v in state.items() if is_adapter_tensor(model, k)}
    save_safetensors(tensors, path / ADAPTER_WEIGHTS)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(path)
    return path


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


# PEFT options astrai's LoraLinear does not implement, with the value that it does
_PEFT_NEUTRAL = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none",
                 "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None}
# the heads PEFT trains whole for a SEQ_CLS task (its classifier_module_names); absent ones are skipped
SEQ_CLS_HEADS = ("classifier", "score")


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """adapter_config.json of a LoRA adapter astrai can load exactly; anything else is an error."""
    file = Path(path) / ADAPTER_CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found; an adapter directory needs {ADAPTER_CONFIG} "
                                f"and {ADAPTER_WEIGHTS} (PEFT's save_pretrained writes both)")
    config = read_json(file)  # a damaged file: an HFFormatError naming it
    if not isinstance(config, dict):
        raise ValueError(f"{file} is damaged: expected a JSON object, got {type(config).__name__}")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        found = "missing" if "r" not in config else f"{r!r}"
        raise ValueError(f"{file}: 'r' (the adapter rank) must be a positive integer, found {found}; restore the "
                         "file (PEFT's save_pretrained writes it)")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"{file}: 'lora_alpha' must be a number, found {alpha!r}; restore the file")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type is {config.get('peft_type')!r}; astrai loads LORA adapters only")
    for key, neutral in _PEFT_NEUTRAL.items():
        value = config.get(key)
        if value is not None and value != neutral and value not in ([], {}):
            raise ValueError(f"{file}: {key}={config[key]!r} is not supported; astrai's LoRA supports {key}={neutral!r}")
    heads = config.get("modules_to_save") or []
    allowed = SEQ_CLS_HEADS if config.get("task_type") == "SEQ_CLS" else ()
    if not isinstance(heads, list) or any(h not in allowed for h in heads):
        raise ValueError(f"{file}: modules_to_save={heads!r} with task_type={config.get('task_type')!r} is not "
                         f"supported; astrai trains whole heads only for SEQ_CLS adapters (a reward model's "
                         f"{SEQ_CLS_HEADS[1]!r})")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{file}: target_modules is {targets!r}; astrai needs a list of projection names "
                         f"(e.g. {sorted(PROJECTIONS.values())})")
    return config


def split_adapter(model: str, lora: str | None, prog: str) -> tuple[str, str | None]:
    """A command's (--model, --lora): a LoRA adapter given as --model (a LoRA run's checkpoint: an
    adapter_config.json, no config.json) becomes (its base from adapter_config.json, the adapter),
    said on stderr; anything else is returned as it is."""
    import sys

    path = Path(model)
    if not is_adapter_dir(path) or (path / "config.json").is_file():
        return model, lora
    if lora:
        raise ValueError(f"--model {model} is a LoRA adapter and --lora {lora} is another; pass the base model "
                         "as --model and one adapter as --lora")
    base = resolve_base(path)
    print(f"{prog}: --model {model} is a LoRA adapter; loading it on its base {base} (adapter_config.json)",
          file=sys.stderr)
    return str(base), str(path)


def resolve_base(adapter: str | Path, base: str | Path | None = None) -> Path:
    """The base model directory of an adapter: `base`, else its base_model_name_or_path (as
    written, or relative to the adapter directory, or a Hub id's cached snapshot as PEFT names it)."""
    if base is not None:
        return Path(base)
    named = read_adapter_config(adapter).get("base_model_name_or_path")
    for candidate in ([Path(named), Path(adapter) / named] if named else []):
        if (candidate / "config.json").is_file():
            return candidate
    if named and is_hub_id(named):
        return Path(resolve_model_path(named, f"the base model of adapter {adapter}"))
    raise FileNotFoundError(f"the base model of adapter {adapter} ({named!r}) is not a model directory "
                            "here; pass the base directory explicitly (--base DIR or --model DIR)")


def read_adapter(path: str | Path, verify: bool | None = None) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """An adapter directory's checked config and its tensors (astrai names), before any model is
    touched: what `load_adapter` loads and what `astrai serve --lora` checks before it starts. Its
    manifest, when it has one (a LoRA run's checkpoint), is checked as a model directory's is
    (`check_model_dir`: sizes, and sha256 as `verify` says); every damaged file is an error naming it."""
    path = Path(path)
    check_model_dir(path, verify=verify)
    config = read_adapter_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found; the adapter directory is incomplete")
    return config, {from_peft_key(k): v for k, v in read_safetensors_file(weights).items()}


def load_adapter(model: nn.Module, path: str | Path, verify: bool | None = None) -> list[str]:
    """Wrap `model`'s target projections and load the adapter at `path` onto them (the model's
    device and dtype), and its whole-trained heads (a SEQ_CLS adapter's ``score``) onto the
    model's; returns the wrapped names. The model is left unmerged (trainable adapters). The
    directory is read and checked by `read_adapter` first."""
    config, tensors = read_adapter(path, verify)
    is_seq_cls, has_heads = config.get("task_type") == "SEQ_CLS", bool(modules_to_save(model))
    if is_seq_cls != has_heads:
        what = "a sequence-classification (reward model) adapter" if is_seq_cls else \
            f"a {config.get('task_type') or 'causal LM'} adapter without a score head"
        fix = "load it as a reward model (rewards: [DIR], critic_model_path, load_classifier)" if is_seq_cls else \
            "load it onto a causal LM (load_model), or train a reward model with train_type reward"
        raise ValueError(f"adapter {path} is {what}, but the model is a {type(model).__name__}; {fix}")
    r = config["r"]
    wrapped = apply_lora(model, r=r, alpha=float(config.get("lora_alpha", r)), dropout=0.0,
                         targets=config["target_modules"])
    state = model.state_dict()
    expected = {k for k in state if is_adapter_tensor(model, k)}
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(f"adapter {path} does not fit the model: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]}; was it trained on another base model?")
    with torch.no_grad():
        for k in expected:
            if tensors[k].shape != state[k].shape:
                raise ValueError(f"adapter {path}: {k} has shape {tuple(tensors[k].shape)}, the model needs "
                                 f"{tuple(state[k].shape)}")
            state[k].copy_(tensors[k])
    return wrapped
