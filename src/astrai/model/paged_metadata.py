"""What one engine step tells every attention layer: `PagedAttentionMetadata`, and the decode view.

The engine's runner builds one `PagedAttentionMetadata` per step from its flat batch (how many
new tokens each sequence has, its context length and block table): the cache slot of every new
token, the prefill segments, and for the decoding sequences their padded block tables and
additive masks, made once here rather than by every layer. Decoding sequences can instead read
their context from `DecodeKVView`, a dense copy of their KV kept across steps (appended to, not
rebuilt, while the batch holds), or in place through the varlen kernel's tables (kernels.py).
The types live in the model layer because both `attention.py` and the engine (infer/runner.py,
infer/cuda_graphs.py) need them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from astrai.model.kernels import PagedDecodeTables, to_device


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


# -- the metadata of one step -------------------------------------------------------------------
@dataclass
class PrefillSegment:
    start: int  # first token of this sequence in the flat batch
    end: int
    blocks: Tensor | None  # (num_blocks,) cache blocks of its whole context; None: no cached prefix
    context_len: int  # keys it attends to (the first context_len slots of its blocks)
    mask: Tensor | None  # (query_len, context_len) bool for a chunk after cached context


@dataclass
class PagedAttentionMetadata:
    """What one engine step tells every attention layer about the flat batch it runs."""

    kv_caches: list[tuple[Tensor, Tensor]]  # per layer, (num_blocks, block_size, kv_heads, head_dim)
    slot_mapping: Tensor  # (N,) cache slot of every new token
    decode_token_idx: Tensor | None  # (Sd,) flat index of each single-token (decode) sequence
    decode_blocks: Tensor | None  # (Sd, W) cache blocks of its context, padded with block 0 (None: decode_view)
    decode_mask: Tensor | None  # (Sd, 1, 1, L) additive: 0 on real context, -inf elsewhere; L = W * block_size,
    # or with a decode_view the longest context
    prefills: list[PrefillSegment]
    decode_view: DecodeViewStep | None = None  # read decode context from a kept dense copy instead
    paged_decode: PagedDecodeTables | None = None  # or read it in place (the varlen kernel; no mask, no blocks)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[tuple[Tensor, Tensor]],
        device: torch.device | str = "cpu",
        seq_ids: list[int] | None = None,
        decode_view: DecodeKVView | None = None,
        paged_kernel: str = "gather",
    ) -> PagedAttentionMetadata:
        """`decode_view` with `seq_ids` (one stable id per sequence): decoding sequences read their
        context from the view's dense copy, which is updated in place from step to step.
        `paged_kernel="varlen"`: they read it where it lies in the cache (PagedDecodeTables)."""
        if paged_kernel not in ("gather", "varlen"):
            raise ValueError(f"paged_kernel is {paged_kernel!r}; use 'gather' or 'varlen'")
        if paged_kernel == "varlen":
            decode_view = None
        # built once per engine step and shared by every layer: vectorised over sequences,
        # since a Python loop here costs more than the attention itself for tiny models
        if decode_view is not None and seq_ids is None:
            raise ValueError("a decode_view needs the seq_ids of the sequences")
        if all(n == 1 for n in query_lens) and all(c > 1 for c in context_lens):
            return cls._build_decode_only(context_lens, block_tables, block_size, kv_caches, device,
                                          seq_ids, decode_view, paged_kernel)
        S = len(query_lens)
        q = torch.tensor(query_lens, dtype=torch.long)  # (S,)
        ctx = torch.tensor(context_lens, dtype=torch.long)  # (S,)
        num_blocks = torch.tensor([len(t) for t in block_tables], dtype=torch.long)  # (S,)
        bad = ((q <= 0) | (ctx < q)).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"sequence {i}: query_len {query_lens[i]} and context_len {context_lens[i]} "
                             "are inconsistent")
        bad = (ctx > num_blocks * block_size).nonzero()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"sequence {i}: context_len {context_lens[i]} exceeds its {len(block_tables[i])} "
                             f"blocks of {block_size} tokens")
        width = int(num_blocks.max())
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)  # (S, W)
        starts = q.cumsum(0) - q  # (S,) first flat index of each sequence
        seq_of = torch.repeat_interleave(torch.arange(S), q)  # (N,)
        pos = torch.arange(int(q.sum())) - starts[seq_of] + (ctx - q)[seq_of]  # (N,) absolute positions
        slot_mapping = tables[seq_of, pos // block_size] * block_size + pos % block_size  # (N,)
        is_decode = (q == 1) & (ctx > 1)
        prefills = []
        for i in (~is_decode).nonzero()[:, 0].tolist():
            start, q_len, ctx_len = int(starts[i]), query_lens[i], context_lens[i]
            if ctx_len == q_len:  # whole prompt in this step: attend over the fresh keys
                prefills.append(PrefillSegment(start, start + q_len, None, ctx_len, None))
            else:  # a chunk after cached context
                key_pos = torch.arange(ctx_len)
                blocks = tables[i, : -(-ctx_len // block_size)]
                mask = key_pos[None, :] <= (ctx_len - q_len + torch.arange(q_len))[:, None]
                prefills.append(PrefillSegment(start, start + q_len, to_device(blocks, device), ctx_len, to_device(mask, device)))
        dec_idx = dec_blocks = dec_mask = view = tables_d = None
        dec = is_decode.nonzero()[:, 0]
        if decode_view is not None and not len(dec):
            decode_view.invalidate()  # its copy must come from the step right before
        if len(dec):
            # whole blocks are gathered (a few large copies instead of one small copy per token);
            # the mask hides the tail of each sequence's last block and the padding blocks
            ctx_d = ctx[dec]  # (Sd,)
            w = -(-int(ctx_d.max()) // block_size)
            if decode_view is not None:
                d = dec.tolist()
                view = decode_view.plan([seq_ids[i] for i in d], ctx_d.tolist(), [block_tables[i] for i in d],
                                        block_size, kv_caches, device)
            if paged_kernel == "varlen":
                d = dec.tolist()
                tables_d = PagedDecodeTables.build(ctx_d.tolist(), [block_tables[i] for i in d], block_size, device)
            elif view is None:
                dec_blocks = to_device(tables[dec, :w], device)  # (Sd, w)
                dec_mask = _decode_mask(ctx_d, w * block_size, kv_caches, device)
            else:
                dec_mask = view.mask
            dec_idx = to_device(starts[dec], device)
        return cls(kv_caches=kv_caches, slot_mapping=to_device(slot_mapping, device), decode_token_idx=dec_idx,
                   decode_blocks=dec_blocks, decode_mask=dec_mask, prefills=prefills, decode_view=view,
                   paged_decode=tables_d)

    @classmethod
    def _build_decode_only(
        cls, context_lens: list[int], block_tables: list[list[int]], block_size: int,
        kv_caches: list[tuple[Tensor, Tensor]], device: torch.device | str,
        seq_ids: list[int] | None, decode_view: DecodeKVView | None, paged_kernel: str = "gather",
    ) -> PagedAttentionMetadata:
        """The common steady state, every sequence adding one token: plain Python over the
        sequences is cheaper here than the general path's tensor bookkeeping."""
        w = -(-max(context_lens) // block_size)
        slots = []
        for i, (ctx, table) in enumerate(zip(context_lens, block_tables)):
            if ctx > len(table) * block_size:
                raise ValueError(f"sequence {i}: context_len {ctx} exceeds its {len(table)} blocks of "
                                 f"{block_size} tokens")
            slots.append(table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size)
        view = blocks = mask = tables = None
        if paged_kernel == "varlen":
            tables = PagedDecodeTables.build(context_lens, block_tables, block_size, device)
        elif decode_view is not None:
            view = decode_view.plan(seq_ids, context_lens, block_tables, block_size, kv_caches, device)
        if view is None and tables is None:
            blocks = to_device(torch.tensor(_pad_tables(block_tables, w), dtype=torch.long), device)
            mask = _decode_mask(torch.tensor(context_lens, dtype=torch.long), w * block_size, kv_caches, device)
        elif view is not None:
            mask = view.mask
        return cls(kv_caches=kv_caches, slot_mapping=to_device(torch.tensor(slots, dtype=torch.long), device),
                   decode_token_idx=torch.arange(len(context_lens), device=device),
                   decode_blocks=blocks, decode_mask=mask, prefills=[], decode_view=view, paged_decode=tables)


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
