"""How a micro-batch of right-padded rows goes through the model: padded, trimmed, or packed.

Rollout rows (prompt + response) differ in length, and a micro-batch of them is padded to the
rollout's longest row: every layer's projections and MLP then run on padding. ``RowLayout`` maps
the rows to what the model runs on, and back: ``pad`` (as they come), ``trim`` (cut to the
micro-batch's longest row), ``pack`` (the rows' real tokens placed into as few rows of that width
as first-fit decreasing allows, position ids restarting at each sample and document ids keeping
attention inside it, as packed SFT does). The objective keeps working on its padded (B, K) tensors:
``RowLayout`` says where each labelled token sits in the model's input (``dst``), which of those
columns the last layer needs (``keep``), and scatters per-token results back (``scatter``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ROW_LAYOUTS = ("pad", "trim", "pack")


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

    @classmethod
    def build(cls, attention_mask: Tensor, labelled: Tensor, layout: str) -> RowLayout:
        """attention_mask (B, T), right-padded; labelled (B, T) bool: where a loss is taken."""
        if layout not in ROW_LAYOUTS:
            raise ValueError(f"row layout {layout!r} is unknown; choose one of {', '.join(ROW_LAYOUTS)}")
        B, T = attention_mask.shape
        lengths = attention_mask.sum(dim=1)  # (B,)
        width = T if layout == "pad" else max(int(lengths.max()), 1)
        rows = torch.arange(B, device=attention_mask.device)
        offset = torch.zeros_like(rows)
        if layout == "pack":
            bins, offsets = first_fit_decreasing(lengths.tolist(), width)
            rows, offset = torch.tensor(bins, device=rows.device), torch.tensor(offsets, device=rows.device)
        r, c = labelled.nonzero(as_tuple=True)
        num_rows = int(rows.max()) + 1 if B else 0
        return cls(layout, (B, T), rows, offset, num_rows, width, (r, c), (rows[r], offset[r] + c))

    def inputs(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        """The model's keyword inputs: padded or trimmed rows as they are (position ids = columns,
        as the padded path has them), packed rows with per-sample positions and document ids."""
        if self.layout != "pack":
            return {"input_ids": input_ids[:, :self.width], "attention_mask": attention_mask[:, :self.width]}
        r, c = attention_mask.nonzero(as_tuple=True)  # (N,) every real token
        at = (self.bin_of[r], self.offset[r] + c)
        shape = (self.num_rows, self.width)
        ids = input_ids.new_zeros(shape).index_put_(at, input_ids[r, c])
        mask = attention_mask.new_zeros(shape).index_put_(at, attention_mask.new_ones(len(r)))
        positions = torch.zeros(shape, dtype=torch.long, device=ids.device).index_put_(at, c)
        documents = torch.zeros(shape, dtype=torch.long, device=ids.device).index_put_(at, r + 1)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "document_ids": documents}

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
        return hidden[self.dst[0], cols]

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
