"""astrai: a compact PyTorch framework for the whole life of a decoder-only language model.

The top-level names are imported lazily so that `import astrai` stays fast and light (the
server and the CLI import only what they use).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ModelConfig": "astrai.model.config",
    "CausalLM": "astrai.model.transformer",
    "load_model": "astrai.model.hf",
    "save_model": "astrai.model.hf",
    "load_tokenizer": "astrai.data.tokenizer",
    "LLM": "astrai.infer.llm",
    "LLMEngine": "astrai.infer.engine",
    "SamplingParams": "astrai.infer.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'astrai' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
