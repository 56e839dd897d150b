"""The engine's precision: the dtype its forward passes compute in and the dtype of its KV pool.

`resolve_precision` turns `EngineConfig.autocast_dtype` / `kv_cache_dtype` into dtypes: forward
passes in the weights' dtype, or under `torch.autocast` as a bf16 trainer runs them, and a KV pool
in the autocast dtype (the written keys and values are cast to it) unless set apart.
`InferenceMode` is the context every engine forward pass runs in: eval mode, no autograd, that
precision. engine.py resolves and enters them; runner.py warms compiled decode up under
`forward_precision`. Nothing here knows the scheduler or the KV cache's layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def _as_dtype(name: torch.dtype | str, field_name: str) -> torch.dtype:
    value = name if isinstance(name, torch.dtype) else getattr(torch, str(name), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"{field_name} is {name!r}, not a floating-point torch dtype; use e.g. 'bfloat16'")
    return value


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """'bfloat16' for torch.bfloat16 (describe()'s spelling); None stays None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def resolve_precision(autocast_dtype: torch.dtype | str | None, kv_cache_dtype: torch.dtype | str | None,
                      weights_dtype: torch.dtype) -> tuple[torch.dtype | None, torch.dtype]:
    """(autocast dtype or None, KV pool dtype). The pool defaults to the autocast dtype, where the
    attention reads its keys and values anyway (autocast runs scaled_dot_product_attention in
    it), else to the weights' dtype."""
    autocast = None if autocast_dtype is None else _as_dtype(autocast_dtype, "autocast_dtype")
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype is {autocast_dtype!r}; use 'bfloat16' or 'float16', or None for "
                         f"forward passes in the weights' dtype")
    kv = _as_dtype(kv_cache_dtype, "kv_cache_dtype") if kv_cache_dtype is not None else autocast or weights_dtype
    return autocast, kv


def forward_precision(device: torch.device, autocast_dtype: torch.dtype | None) -> Any:
    """The context of the engine's forward passes: `torch.autocast(device type, dtype)`, the form a
    bf16 trainer's `dist.autocast` enters (so the same ops run in bf16), or none."""
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype)


class InferenceMode:
    """The context of the engine's forward passes over `model`; re-entrant, so a whole batch
    (generate_all) can hold it across its steps."""

    def __init__(self, model: nn.Module, device: torch.device, autocast_dtype: torch.dtype | None) -> None:
        self.model, self.device, self.autocast_dtype = model, device, autocast_dtype
        self.active = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.active:  # generate_all holds the mode for the whole batch
            yield
            return
        was_training = self.model.training
        if was_training:
            self.model.eval()
        # inference_mode skips autograd's view and version tracking (cheaper per op than no_grad),
        # but tensors it creates can never join a backward pass; a module in training mode is
        # someone's live policy, whose wrappers (FSDP's unsharded parameters) may keep state
        # made here, so it gets plain no_grad. Autocast is entered here too, once per batch in
        # generate_all, so its cache of bf16 weight copies lasts the batch instead of one step
        try:
            with (torch.no_grad() if was_training else torch.inference_mode(),
                  forward_precision(self.device, self.autocast_dtype)):
                self.active = True
                yield
        finally:
            self.active = False
            if was_training:
                self.model.train()
