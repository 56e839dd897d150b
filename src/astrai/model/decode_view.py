"""The dense per-step copy of the decoding sequences' KV (`DecodeKVView`), and the decode tables
and masks that paged attention metadata builds from block tables; used by `attention.py`'s
`PagedAttentionMetadata` and the engine's runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from astrai.model.kernels import to_device


def _pad_tables(block_tables: list[list[int]], width: int) -> list[list[int]]:
    """Each table cut or padded (with block 0) to `width` blocks."""
    return [t[:width] + [0] * (width - len(t)) for t in block_tables]


def _decode_mask(context_lens: Tensor, width: int, kv_caches: list[tuple[Tensor, Tensor]],
                 device: torch.device | str) -> Tensor:
    """(Sd, 1, 1, width) additive mask, 0 on each sequence's context and -inf past it; in the cache
    dtype and made once per step rather than by every layer."""
    real = (torch.arange(width)[None, :] < context_lens[:, None])[:, None, None, :]
    dtype = kv_caches[0][0].dtype if kv_caches else torch.float32
    return to_device(torch.zeros(real.shape, dtype=dtype).masked_fill_(~real, float("-inf")), device)


# -- a dense copy of the decoding sequences' KV, kept across steps ----------------------------
@dataclass
class DecodeViewStep:
    """What one step does with a `DecodeKVView`: rebuild it from the paged cache, or append."""

    view: DecodeKVView
    rebuild: bool
    blocks: Tensor | None  # rebuild: (Sd * capacity / block_size,) blocks to gather, row after row
    slots: Tensor | None  # append: (Sd,) each sequence's new column, row * capacity + column
    capacity: int  # tokens per row
    mask: Tensor  # (Sd, 1, 1, longest context) additive decode mask, a view of the kept one
    _at: dict[int, Tensor] = field(default_factory=dict)  # append: flat rows per kv-head count
    _scratch: Tensor | None = None  # rebuild: the gathered blocks of one layer's keys or values

    def layer_kv(self, layer: int, k_cache: Tensor, v_cache: Tensor, new_k: Tensor, new_v: Tensor
                 ) -> tuple[Tensor, Tensor]:
        """This layer's (Sd, Hkv, capacity, D) keys and values, current to this step's tokens
        (the paged cache already holds them: a rebuild reads it after this step's write). Heads
        before positions, so each (sequence, kv head) is one contiguous (capacity, D) matrix, the
        layout the attention kernel reads without a copy."""
        kv = self.view.kv
        Hkv, D = k_cache.size(2), k_cache.size(3)
        if self.rebuild:
            while len(kv) <= layer:
                kv.append(None)
            kv[layer] = None  # free the old copy before making the new one
            copies = []
            for cache in (k_cache, v_cache):
                # gathered into one scratch block, reused by every layer of the step, so the kept
                # copies are made back to back with no freed gather between them
                if self._scratch is None or self._scratch.shape[1:] != cache.shape[1:] or self._scratch.dtype != cache.dtype:
                    self._scratch = cache.new_empty((len(self.blocks), *cache.shape[1:]))
                gathered = torch.index_select(cache, 0, self.blocks, out=self._scratch)
                copies.append(gathered.view(-1, self.capacity, Hkv, D).transpose(1, 2).contiguous())
            kv[layer] = tuple(copies)
            return kv[layer]
        kd, vd = kv[layer]
        at = self._at.get(Hkv)
        if at is None:  # row r's new column c is flat row (r * Hkv + h) * capacity + c of the (., D) view
            row, col = self.slots // self.capacity, self.slots % self.capacity
            heads = torch.arange(Hkv, device=self.slots.device) * self.capacity
            at = self._at[Hkv] = ((row * Hkv * self.capacity + col)[:, None] + heads).flatten()  # (Sd * Hkv,)
        kd.view(-1, D).index_copy_(0, at, new_k.reshape(-1, D).to(kd.dtype))
        vd.view(-1, D).index_copy_(0, at, new_v.reshape(-1, D).to(vd.dtype))
        return kd, vd


class DecodeKVView:
    """Dense per-layer copies (rows, kv_heads, capacity, head_dim) of the decoding sequences' KV.

    A decode step attends over each sequence's whole context. Gathering that context out of the
    paged cache every step copies the batch's entire KV once per layer per step, which on a CPU
    costs as much as the attention itself. From one step to the next the same sequences
    usually grow by one token, so the gathered copy is kept and each step only appends the new
    token's keys and values. It is rebuilt from the paged cache (which stays the only source of
    truth) whenever the decoding sequences or their order change, a context outgrows the
    capacity (`slack` spare tokens per row are gathered on each rebuild), autograd mode changes
    between inference_mode and no_grad, or a step failed. A copy that would exceed `max_bytes`
    is not made: that step gathers from the paged cache instead. `reach`, when the caller sets it
    (the runner does, before each step), is the longest context any of the step's sequences can
    still grow to (prompt + max_tokens): a rebuild gathers no spare tokens beyond it, so a short
    rollout does not copy (and fault in) `slack` tokens per row it never uses.
    """

    def __init__(self, max_bytes: int, slack: int = 128) -> None:
        self.max_bytes = max_bytes
        self.slack = slack
        self.kv: list[tuple[Tensor, Tensor] | None] = []
        self.mask: Tensor | None = None  # (rows, 1, 1, capacity), kept up to date like the copy
        self.num_rebuilds = 0
        self.reach: int | None = None  # longest context the step's sequences can reach (None: unknown)
        self._state: tuple | None = None  # (seq ids, context lens, capacity, inference mode) once valid
        self._pending: tuple | None = None

    def plan(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int,
             kv_caches: list[tuple[Tensor, Tensor]], device: torch.device | str) -> DecodeViewStep | None:
        """This step's use of the copy; None (and the copy dropped) when it would be too large."""
        inference = torch.is_inference_mode_enabled()
        ids = tuple(seq_ids)
        state, self._state = self._state, None  # invalid until `commit` says the forward pass ran
        if state is not None and state[0] == ids and state[3] == inference and max(context_lens) <= state[2]:
            capacity = state[2]
            if all(c == p + 1 for c, p in zip(context_lens, state[1])):
                self._pending = (ids, context_lens, capacity, inference)
                slots = to_device(torch.tensor([row * capacity + c - 1 for row, c in enumerate(context_lens)],
                                     dtype=torch.long), device)
                self.mask.view(-1).index_fill_(0, slots, 0.0)  # each row's new token becomes visible
                return DecodeViewStep(self, False, None, slots, capacity, self.mask[..., : max(context_lens)])
        longest = max(context_lens) + self.slack
        if self.reach is not None:
            longest = max(min(longest, self.reach), max(context_lens))
        width = -(-longest // block_size)
        capacity = width * block_size
        per_token = sum(2 * k.element_size() * k.size(2) * k.size(3) for k, _ in kv_caches)
        if len(ids) * capacity * per_token > self.max_bytes:
            self.invalidate()
            return None
        self._pending = (ids, context_lens, capacity, inference)
        self.num_rebuilds += 1
        blocks = to_device(torch.tensor(_pad_tables(block_tables, width), dtype=torch.long).flatten(), device)
        self.mask = _decode_mask(torch.tensor(context_lens, dtype=torch.long), capacity, kv_caches, device)
        return DecodeViewStep(self, True, blocks, None, capacity, self.mask[..., : max(context_lens)])

    def commit(self) -> None:
        """The step's forward pass completed: the copy now matches the paged cache."""
        self._state, self._pending = self._pending, None

    def invalidate(self) -> None:
        """Forget the copy (the next step rebuilds it)."""
        self._state = self._pending = None
        self.kv = []
        self.mask = None
