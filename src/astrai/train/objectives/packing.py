"""How a micro-batch of right-padded rows goes through the model: padded, trimmed, or packed.

Rollout rows (prompt + response) differ in length, and a micro-batch of them is padded to the
rollout's longest row: every layer's projections and MLP then run on padding. ``RowLayout`` maps
the rows to what the model runs on, and back: ``pad`` (as they come), ``trim`` (cut to the
micro-batch's longest row), ``pack`` (the rows' real tokens placed into as few rows of that width
as first-fit decreasing allows, position ids restarting at each sample and document ids keeping
attention inside it, as packed SFT does; when no two rows fit together, ``trim``'s rows, which
are the same work without a per-document mask), ``flat`` (as ``pack``, but every real token in one
row: no padding at all, since per-document attention costs the same whatever the row's width; so
also when no two rows would share a ``pack`` row: trimming rows of 256, 200 and 150 tokens to 256
computes 162 padding tokens; on the tiny SFT benchmark 3 of 32 batches are such, and flat rows
there save 3% of the epoch's tokens and time). The objective keeps working on its padded (B, K) tensors:
``RowLayout`` says where each labelled token sits in the model's input (``dst``), which of those
columns the last layer needs (``keep``), and scatters per-token results back (``scatter``).
``forward_rows`` is the one call every objective makes: rows in, the model run in a layout, the
labelled tokens' hidden states (or the model's per-token outputs) out, in the padded rows' order.

``share`` packs like ``pack`` and also computes a prompt once for the samples that share it: the
G samples of a GRPO group are consecutive rows that begin with the same tokens, so the trunk's
work on those tokens is the same G times. Consecutive rows with a common prefix (at least
``MIN_SHARED_PREFIX`` tokens, and no row's last token) become one tree: the prefix once, then each
row's remaining tokens, with positions continuing from the prefix. ``prefix_ids`` let each
sample's tokens attend to the whole prefix and causally to their own
(``model/kernels.py: SharedPrefixSegments``). A labelled token inside the prefix (the prompt's
last, which predicts each sample's first response token) reads the shared hidden state, once
per sample. Values equal the padded path's; gradients are the same sums in another order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from astrai.model.attention import document_ids_from_positions
from astrai.train.dist import unwrap_model
from astrai.train.losses import IGNORE_INDEX

ROW_LAYOUTS = ("pad", "trim", "pack", "flat", "share")
MIN_SHARED_PREFIX = 8  # shorter common prefixes are not worth a segment of their own


def common_prefix(a: Tensor, b: Tensor) -> int:
    """Length of the common prefix of two 1-D token tensors."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def prefix_trees(input_ids: Tensor, lengths: list[int], min_prefix: int = MIN_SHARED_PREFIX) -> list[tuple[list[int], int]]:
    """Consecutive rows grouped into (rows, shared prefix length) trees, greedily: a row joins
    the current tree while the tokens saved, (members - 1) x prefix, do not shrink; a prefix
    keeps every member's last token its own; a tree of one row shares nothing (prefix 0)."""
    trees: list[tuple[list[int], int]] = []
    i, B = 0, len(lengths)
    while i < B:
        members, shared = [i], lengths[i] - 1
        j = i + 1
        while j < B:
            new = min(shared, lengths[j] - 1, common_prefix(input_ids[i, :lengths[i]], input_ids[j, :lengths[j]]))
            if new < min_prefix or len(members) * new < (len(members) - 1) * shared:
                break
            members.append(j)
            shared = new
            j += 1
        trees.append((members, shared if len(members) > 1 else 0))
        i = j
    return trees


def first_fit_decreasing(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """(bin, offset) per row: rows longest first, each into the first bin with room (capacity width)."""
    bins, offsets, loads = [0] * len(lengths), [0] * len(lengths), []
    for r in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = next((i for i, load in enumerate(loads) if load + lengths[r] <= width), len(loads))
        if b == len(loads):
            loads.append(0)
        bins[r], offsets[r] = b, loads[b]
        loads[b] += lengths[r]
    return bins, offsets


@dataclass
class RowLayout:
    """Right-padded rows (B, T) -> the model's input (R, W) and back, for one layout."""

    layout: str
    shape: tuple[int, int]  # (B, T) of the padded rows
    bin_of: Tensor  # (B,) the model-input row of each padded row
    offset: Tensor  # (B,) the column where each padded row starts there
    num_rows: int  # R
    width: int  # W
    src: tuple[Tensor, Tensor]  # (M,) rows and columns of the labelled tokens in the padded rows
    dst: tuple[Tensor, Tensor]  # (M,) where they sit in the model's input
    # layout "share": per padded row, the length of the prefix it shares (0: none), where that
    # prefix starts in its model-input row, and whether this row writes it (its tree's first)
    shared: Tensor | None = None
    base: Tensor | None = None
    writes_prefix: Tensor | None = None

    @classmethod
    def build(cls, attention_mask: Tensor, labelled: Tensor, layout: str,
              input_ids: Tensor | None = None) -> RowLayout:
        """attention_mask (B, T), right-padded; labelled (B, T) bool: where a loss is taken;
        input_ids (B, T): layout "share" only, to find the shared prefixes."""
        if layout not in ROW_LAYOUTS:
            raise ValueError(f"row layout {layout!r} is unknown; choose one of {', '.join(ROW_LAYOUTS)}")
        B, T = attention_mask.shape
        lengths = attention_mask.sum(dim=1)  # (B,)
        if layout == "share":
            if input_ids is None:
                raise ValueError("row layout 'share' compares the rows' tokens: pass input_ids")
            return cls._build_shared(lengths.tolist(), labelled, input_ids)
        width = T if layout == "pad" else max(int(lengths.max()), 1)
        rows = torch.arange(B, device=attention_mask.device)
        offset = torch.zeros_like(rows)
        if layout in ("pack", "flat"):
            if layout == "flat":  # one bin as wide as every real token: no padding at all
                width = int(lengths.sum())
            bins, offsets = first_fit_decreasing(lengths.tolist(), width)
            if layout == "pack" and max(bins, default=0) + 1 == B:  # no two rows fit together: trim's rows are the same work
                return cls.build(attention_mask, labelled, "trim")
            rows, offset = torch.tensor(bins, device=rows.device), torch.tensor(offsets, device=rows.device)
        r, c = labelled.nonzero(as_tuple=True)
        num_rows = int(rows.max()) + 1 if B else 0
        return cls(layout, (B, T), rows, offset, num_rows, width, (r, c), (rows[r], offset[r] + c))

    @classmethod
    def _build_shared(cls, lengths: list[int], labelled: Tensor, input_ids: Tensor) -> RowLayout:
        """Prefix trees (``prefix_trees``) packed first-fit decreasing into rows as wide as the
        longest tree: [prefix][row a's rest][row b's rest]... Token c of a row sits at
        ``base + c`` inside the prefix (c < shared), else at ``offset + c``."""
        B, T = labelled.shape
        device = labelled.device
        trees = prefix_trees(input_ids, lengths)
        sizes = [shared + sum(lengths[m] - shared for m in members) for members, shared in trees]
        width = max(max(sizes, default=1), 1)
        bins, starts = first_fit_decreasing(sizes, width)
        bin_of, offset, shared_of, base, writes = ([0] * B for _ in range(5))
        for (members, shared), b, start in zip(trees, bins, starts):
            cursor = start + shared
            for m in members:
                bin_of[m], base[m], shared_of[m], offset[m] = b, start, shared, cursor - shared
                cursor += lengths[m] - shared
            writes[members[0]] = 1
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        bin_of, offset, shared, base = as_long(bin_of), as_long(offset), as_long(shared_of), as_long(base)
        r, c = labelled.nonzero(as_tuple=True)
        cols = torch.where(c < shared[r], base[r] + c, offset[r] + c)
        num_rows = max(bins, default=0) + 1 if B else 0
        return cls("share", (B, T), bin_of, offset, num_rows, width, (r, c), (bin_of[r], cols), shared, base,
                   as_long(writes).bool())

    def inputs(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> dict[str, Tensor]:
        """The model's keyword inputs: padded or trimmed rows as they are (position ids the rows'
        own, or their columns), packed rows with per-sample positions and document ids (and,
        layout "share", the prefix document each sample's tokens also see). Rows that already
        hold several documents (``pack: true`` data: `position_ids` restart at each) keep them
        apart as documents of their own."""
        if self.layout not in ("pack", "flat", "share"):
            out = {"input_ids": input_ids[:, :self.width], "attention_mask": attention_mask[:, :self.width]}
            if position_ids is not None:
                out["position_ids"] = position_ids[:, :self.width]
            return out
        r, c = attention_mask.nonzero(as_tuple=True)  # (N,) every real token
        documents_of = r + 1
        within = None if position_ids is None or self.layout == "share" else document_ids_from_positions(position_ids)
        if within is not None:  # (B, T) 0, 1, ... per document of a row: ids unique over the rows
            documents_of = r * self.shape[1] + within[r, c] + 1
        if self.layout == "share":
            in_prefix = c < self.shared[r]
            keep = ~in_prefix | self.writes_prefix[r]  # a shared prefix is written once
            r, c, in_prefix, documents_of = r[keep], c[keep], in_prefix[keep], documents_of[keep]
            # a prefix is document B + 1 + (its first row): unique, and apart from the rows' ids
            prefix_doc = self.shape[0] + 1 + self._first_row()
            documents_of = torch.where(in_prefix, prefix_doc[r], documents_of)
            cols = torch.where(in_prefix, self.base[r] + c, self.offset[r] + c)
        else:
            cols = self.offset[r] + c
        at = (self.bin_of[r], cols)
        shape = (self.num_rows, self.width)
        ids = input_ids.new_zeros(shape).index_put_(at, input_ids[r, c])
        mask = attention_mask.new_zeros(shape).index_put_(at, attention_mask.new_ones(len(r)))
        positions_of = c if position_ids is None or self.layout == "share" else position_ids[r, c]
        positions = torch.zeros(shape, dtype=torch.long, device=ids.device).index_put_(at, positions_of)
        documents = torch.zeros(shape, dtype=torch.long, device=ids.device).index_put_(at, documents_of)
        out = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "document_ids": documents}
        if self.layout == "share":
            sees = torch.where(in_prefix | (self.shared[r] == 0), 0, prefix_doc[r])
            out["prefix_ids"] = torch.zeros(shape, dtype=torch.long, device=ids.device).index_put_(at, sees)
        return out

    def place(self, values: Tensor, attention_mask: Tensor, fill: int = -1) -> Tensor:
        """A per-token field (B, T, ...) of the padded rows (routing replay's experts) in the model's
        input layout (R, W, ...), `fill` where no token sits; layout "share" takes a shared
        prefix's values from the row that writes it, as ``inputs`` does its tokens."""
        if self.layout not in ("pack", "flat", "share"):
            return values[:, :self.width]
        r, c = attention_mask.nonzero(as_tuple=True)  # (N,) every real token
        cols = self.offset[r] + c
        if self.layout == "share":
            in_prefix = c < self.shared[r]
            keep = ~in_prefix | self.writes_prefix[r]
            r, c, cols = r[keep], c[keep], torch.where(in_prefix, self.base[r] + c, cols)[keep]
        out = values.new_full((self.num_rows, self.width, *values.shape[2:]), fill)
        out[self.bin_of[r], cols] = values[r, c]
        return out

    def _first_row(self) -> Tensor:
        """(B,) the first row of each row's prefix tree (itself when it shares nothing)."""
        first = torch.arange(self.shape[0], device=self.bin_of.device)
        writer = torch.where(self.writes_prefix, first, 0)
        return torch.cummax(writer, dim=0).values  # rows of a tree are consecutive, its writer first

    def keep(self) -> Tensor | None:
        """Columns (K',) of the model's input where some labelled token sits, None when every one."""
        used = torch.zeros(self.width, dtype=torch.bool, device=self.dst[1].device)
        used[self.dst[1]] = True
        return None if bool(used.all()) else used.nonzero().squeeze(1)

    def gather(self, hidden: Tensor, keep: Tensor | None) -> Tensor:
        """hidden (R, K', ...) at `keep` columns -> (M, ...) at the labelled tokens."""
        cols = self.dst[1]
        if keep is not None:
            where = torch.full((self.width,), -1, dtype=torch.long, device=cols.device)
            where[keep] = torch.arange(len(keep), device=cols.device)
            cols = where[cols]
        # index_select over the flattened rows: its backward is index_add, faster than advanced indexing's
        return hidden.flatten(0, 1).index_select(0, self.dst[0] * hidden.size(1) + cols)

    def scatter(self, values: Tensor, idx: Tensor | None) -> Tensor:
        """values (M,) at the labelled tokens -> (B, K) at the padded rows' columns `idx` (all T
        when None), 0 elsewhere; differentiable in `values`."""
        B, T = self.shape
        r, c = self.src
        if idx is not None:
            where = torch.full((T,), -1, dtype=torch.long, device=c.device)
            where[idx] = torch.arange(len(idx), device=c.device)
            c = where[c]
        K = T if idx is None else len(idx)
        return values.new_zeros(B, K).index_put((r, c), values)


def several_documents(position_ids: Tensor | None, attention_mask: Tensor) -> bool:
    """Whether some row holds more than one document (``pack: true`` data): its positions restart
    inside its real tokens."""
    if position_ids is None:
        return False
    restarts = (position_ids[:, 1:] != position_ids[:, :-1] + 1) & (attention_mask[:, 1:] == 1)
    return bool(restarts.any())


def forward_rows(model: Any, batch: dict[str, Any], layout: str, labelled: Tensor | None = None,
                 head: Callable[[Tensor, nn.Module], Any] | None = None) -> tuple[Any, RowLayout]:
    """Run a batch of right-padded rows (its ``input_ids``, ``attention_mask`` and, when there,
    ``position_ids``) through `model` in `layout`: the one way every objective runs its rows, so
    each layout serves each objective. `labelled` (B, T) bool says where a result is wanted
    (default: where ``labels`` are set). With `head` (a causal LM): head(hidden (M, C) at the M
    labelled tokens, row by row in order, lm_head) runs inside the forward, on the last layer's
    labelled columns only; its result is ``out.head``. Without: the model's output as it is, in the
    layout's rows (R, W, ...); ``rows.gather(output, None)`` reads it at the labelled tokens.
    Values equal the padded path's whatever the layout (``tests/train/test_row_layouts.py``)."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    if layout == "share" and (getattr(getattr(unwrap_model(model), "config", None), "num_experts", 0)
                              or several_documents(batch.get("position_ids"), mask)):
        # MoE routing statistics count tokens: a shared prompt must count once per sample; and a
        # prefix tree has one document per row
        layout = "pack"
    if labelled is None:
        labelled = batch["labels"] != IGNORE_INDEX
    rows = RowLayout.build(mask, labelled, layout, ids)
    inputs = rows.inputs(ids, mask, batch.get("position_ids"))
    if "routing" in batch:  # routing_replay: the sampler's experts per token, placed like the tokens
        inputs["routing"] = rows.place(batch["routing"], mask)
    if head is None:
        return model(**inputs), rows
    keep = rows.keep()
    out = model(**inputs, logits_indices=keep, head=lambda hidden, lm_head: head(rows.gather(hidden, keep), lm_head))
    return out, rows
