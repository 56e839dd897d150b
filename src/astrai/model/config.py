"""ModelConfig: the shape of a decoder-only model, with Hugging Face's field names.

Every layer of astrai reads the model's shape from here: the model builds itself from it,
`hf.py` maps it to and from a `config.json` of each supported family, and the trainer's YAML
`model:` section is parsed into it. Unknown keys are errors with a did-you-mean, so a typo in a
config never silently builds a different model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from astrai.config_values import did_you_mean

ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None = num_attention_heads (plain multi-head)
    head_dim: int | None = None  # None = hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", "factor": ...}
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    # Mistral's attention window: astrai attends over the full context, which equals the window
    # for sequences no longer than it, so longer ones are refused (None = no window)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # mixture of experts (num_experts == 0: every layer is dense)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # None = intermediate_size
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert (Qwen2-MoE has one)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; set head_dim explicitly or change one of them"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self.mlp_only_layers = list(self.mlp_only_layers or [])
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"model config field '{name}' must be a positive integer, got {value!r}")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or isinstance(self.sliding_window, bool) or self.sliding_window <= 0
        ):
            raise ValueError(f"model config field 'sliding_window' must be a positive integer or null, "
                             f"got {self.sliding_window!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"model config field 'hidden_act' is {self.hidden_act!r}; only 'silu' is supported")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_SCALING_TYPES:
                raise ValueError(
                    f"model config field 'rope_scaling' has type {kind!r}; supported: {list(ROPE_SCALING_TYPES)}"
                )
            if "factor" not in self.rope_scaling:
                raise ValueError("model config field 'rope_scaling' needs a 'factor'")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    # -- derived -----------------------------------------------------------------------------
    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen-MoE rule: sparse every `decoder_sparse_step` layers, except `mlp_only_layers`."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    # -- (de)serialisation ---------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any], section: str = "model") -> ModelConfig:
        """Strict: unknown keys are errors naming the key and the closest known one."""
        names = cls.field_names()
        for key in data:
            if key not in names:
                raise ValueError(f"unknown config key '{key}' in section '{section}'{did_you_mean(key, names)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
