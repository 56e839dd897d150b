"""ValueModel: the PPO critic, the policy's trunk with a scalar head instead of the LM head.

`online_ppo` trains it next to the policy: `ValueModel.from_policy(policy)` warm-starts the trunk
from the policy's weights, the head starts at zero (so the first value estimates are 0 and the
first advantages are the plain returns), and `forward` gives one value per token (B, T), which
the GAE and value-loss functions in `train/losses.py` consume. The trunk is the same
`Transformer` class as `CausalLM.model`, so packing, padding masks and gradient checkpointing
behave exactly as in the policy.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM, Transformer, WithTrunk


class ValueModel(WithTrunk):
    def __init__(self, config: ModelConfig, seed: int | None = 0, trunk: Transformer | None = None) -> None:
        """A critic with a freshly initialised trunk (seeded like CausalLM), or around `trunk`."""
        super().__init__()
        self.config = config
        if trunk is None:
            trunk = CausalLM(config, seed=seed).model  # same init as a policy built with `seed`
        self.model = trunk
        ref = next(trunk.parameters())
        self.value_head = nn.Linear(config.hidden_size, 1, device=ref.device, dtype=ref.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_policy(cls, policy: CausalLM) -> ValueModel:
        """A critic whose trunk is a copy of the policy's (same dtype and device); zero head.
        Frozen parameters (a LoRA policy's base) are shared, not copied: the critic of a LoRA
        policy trains its own adapters and head on the same base weights."""
        policy = getattr(policy, "module", policy)  # DDP wrapper
        if not isinstance(getattr(policy, "model", None), Transformer):
            raise TypeError(f"from_policy needs a CausalLM, got {type(policy).__name__}")
        shared = {id(p): p for p in policy.model.parameters() if not p.requires_grad}
        return cls(policy.config, trunk=copy.deepcopy(policy.model, shared))

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device | str | None = None,
                        require_head: bool = False) -> ValueModel:
        """A critic (or reward model) from a model directory: the trunk from its weights, the head
        from ``score.weight`` (transformers' sequence classification, one label) or
        ``value_head.weight``/``.bias`` when present, else zero (a warm start from a policy). A
        LoRA reward run's checkpoint (a PEFT ``SEQ_CLS`` adapter) is its base with the adapter
        merged and the adapter's ``score`` head (``classifier.load_classifier``)."""
        from astrai.model.classifier import load_classifier
        from astrai.model.hf_dir import load_config
        from astrai.model.hf_weights import state_dict_from_hf
        from astrai.model.hub import resolve_model_path
        from astrai.model.lora import is_adapter_dir
        from astrai.model.manifest import resolve_model_dir
        from astrai.model.safetensors_io import read_safetensors

        path = resolve_model_path(path, "critic_model_path")  # a Hub id -> its cached snapshot
        path = resolve_model_dir(path)  # a run's ckpt_dir -> its newest complete checkpoint
        if is_adapter_dir(path) and not (Path(path) / "config.json").is_file():
            scorer = load_classifier(path)
            critic = cls(scorer.config, trunk=scorer.model)
            with torch.no_grad():
                critic.value_head.weight.copy_(scorer.score.weight)
            return critic.to(device) if device is not None else critic
        config = load_config(path)
        tensors = read_safetensors(path)
        weight, bias = tensors.pop("score.weight", None), tensors.pop("score.bias", None)
        if weight is None:
            weight, bias = tensors.pop("value_head.weight", None), tensors.pop("value_head.bias", None)
        if weight is None and require_head:
            raise ValueError(f"{path} has no scalar head ('score.weight' or 'value_head.weight' in "
                             "model.safetensors); a reward model needs one")
        if weight is not None and tuple(weight.shape) != (1, config.hidden_size):
            raise ValueError(f"{path}: the scalar head has shape {tuple(weight.shape)}, expected "
                             f"(1, {config.hidden_size}); a value or reward model has one output")
        critic = cls(config, seed=None)
        trunk = {k.removeprefix("model."): v for k, v in state_dict_from_hf(tensors, config).items()
                 if k.startswith("model.")}
        critic.model.load_state_dict(trunk)
        if weight is not None:
            with torch.no_grad():
                critic.value_head.weight.copy_(weight)
                critic.value_head.bias.copy_(bias if bias is not None else torch.zeros(1))
        return critic.to(device) if device is not None else critic

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        *,
        prefix_ids: Tensor | None = None,
    ) -> Tensor:
        """input_ids (B, T) -> values (B, T) in float32, one per token (the value of the state
        after reading that token). MoE load-balancing loss of the trunk is not used.
        `prefix_ids`: shared prompts in packed rows (`Transformer.forward`)."""
        _check_shapes(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      document_ids=document_ids, prefix_ids=prefix_ids)
        hidden, _, _, _ = self.model(input_ids, attention_mask, position_ids, document_ids,
                                     prefix_ids=prefix_ids)  # (B, T, C)
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)


def _check_shapes(input_ids: Tensor, **others: Tensor | None) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(
            f"ValueModel expects input_ids of shape (batch, seq_len), got {shape}; "
            "add a batch dimension with input_ids[None] for a single sequence"
        )
    if input_ids.is_floating_point():
        raise ValueError(f"ValueModel expects integer token ids, got dtype {input_ids.dtype}")
    for name, t in others.items():
        if t is not None and tuple(t.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"ValueModel: {name} has shape {tuple(t.shape)} but input_ids has "
                f"{tuple(input_ids.shape)}; they must match"
            )

