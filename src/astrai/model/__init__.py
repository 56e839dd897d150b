"""The model layer: one decoder-only transformer (dense or MoE), its config and HF interop."""

from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM, ModelOutput

__all__ = ["CausalLM", "ModelConfig", "ModelOutput"]
