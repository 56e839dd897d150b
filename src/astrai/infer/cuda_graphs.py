"""CUDA graphs for decode steps (`EngineConfig.cuda_graphs`, off by default): one graph per
(batch-size bucket, context-width bucket), captured lazily on first use and replayed after.

A decode step on a GPU with a small model is bound by kernel launches, not by arithmetic: a
graph replays the whole forward pass (every layer, the paged attention, the lm head) as one
launch. A graph needs fixed shapes and fixed buffers, so a step's rows are padded up to the
next batch bucket (compiled.py's powers of two up to `max_num_seqs`) and its block tables up to
the next width bucket (powers of two of blocks, up to `max_model_len`). Everything a step
changes goes into one int64 input buffer (B, 2 + W): token id, position and block table of each
row, copied from pinned host memory in one transfer; slots and the decode mask are computed
inside the graph from it. Padding rows write their key and value into a scratch block that the
block manager never hands out (the runner allocates it) and attend to it alone, so they never
touch real sequences. A step outside the buckets, or one run with gradients, takes the eager
path. On CPU the same static forward runs eagerly (`capture=False`), which is how the suite
tests the padding and the input buffer without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from astrai.infer.compiled import decode_buckets
from astrai.model.paged_metadata import PagedAttentionMetadata

logger = logging.getLogger(__name__)


class _Graph:
    """One captured (or, with capture off, eagerly re-run) static decode forward."""

    def __init__(self, inp: Tensor, fn: Callable[[], Tensor], pool: Any = None) -> None:
        self.inp = inp  # (B, 2 + W) int64 static input
        self.fn = fn
        self.graph = None
        self.out: Tensor | None = None
        if pool is not None:
            self._capture(pool)

    def _capture(self, pool: Any) -> None:
        """Capture into the memory pool every graph of the engine shares (their replays never overlap)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture (allocator, cuBLAS handles)
            for _ in range(2):
                self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with _no_autocast_cache(), torch.cuda.graph(self.graph, pool=pool):
            self.out = self.fn()

    def replay(self) -> Tensor:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


@contextlib.contextmanager
def _no_autocast_cache():
    """Autocast's cache of cast weights must not be filled inside a capture (its tensors would be
    freed when the autocast region ends, under the graph's feet)."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


class CUDAGraphDecode:
    def __init__(self, model: nn.Module, kv_caches: list[tuple[Tensor, Tensor]], block_size: int,
                 scratch_block: int, batch_buckets: list[int], width_buckets: list[int],
                 capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.batch_buckets = batch_buckets
        self.width_buckets = width_buckets
        self.capture = capture
        self.device = kv_caches[0][0].device
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool: Any = None  # one memory pool for all graphs, made at the first capture
        self.num_replays = 0
        self.num_eager = 0  # decode steps outside the buckets (the runner ran them eagerly)

    @classmethod
    def for_engine(cls, model: nn.Module, kv_caches: list[tuple[Tensor, Tensor]], block_size: int,
                   scratch_block: int, max_num_seqs: int, max_model_len: int, capture: bool = True
                   ) -> CUDAGraphDecode:
        return cls(model, kv_caches, block_size, scratch_block, decode_buckets(max_num_seqs),
                   decode_buckets(-(-max_model_len // block_size)), capture)

    def run(self, input_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> Tensor | None:
        """Logits (n, V) of a decode step from its graph; None when the step is outside the buckets."""
        n = len(input_ids)
        w = -(-(max(positions) + 1) // self.block_size)
        b = next((x for x in self.batch_buckets if x >= n), None)
        wb = next((x for x in self.width_buckets if x >= w), None)
        if b is None or wb is None or torch.is_grad_enabled():
            self.num_eager += 1
            return None
        graph = self.graphs.get((b, wb))
        if graph is None:
            graph = self.graphs[(b, wb)] = self._make(b, wb)
        host = torch.empty(b, 2 + wb, dtype=torch.long, pin_memory=self.device.type == "cuda")
        host[:, :2] = 0
        host[:, 2:] = self.scratch_block  # padding rows (and table padding) point at the scratch block
        host[:n, 0] = torch.tensor(input_ids, dtype=torch.long)
        host[:n, 1] = torch.tensor(positions, dtype=torch.long)
        for row, table in enumerate(block_tables):
            host[row, 2 : 2 + min(len(table), wb)] = torch.tensor(table[:wb], dtype=torch.long)
        graph.inp.copy_(host, non_blocking=True)  # one transfer per step
        self.num_replays += 1
        return graph.replay()[:n].clone()  # the graph's output buffer is overwritten by the next replay

    def _make(self, b: int, wb: int) -> _Graph:
        inp = torch.zeros(b, 2 + wb, dtype=torch.long, device=self.device)
        inp[:, 2:] = self.scratch_block  # warm-up and capture run padding rows only: scratch writes
        logger.info("cuda graphs: %s decode graph for %d rows x %d blocks",
                    "capturing" if self.capture else "eager stand-in for", b, wb)
        if self.capture and self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return _Graph(inp, lambda: self._forward(inp, wb), self.pool if self.capture else None)

    def _forward(self, inp: Tensor, wb: int) -> Tensor:
        """The static decode forward: (B, 2 + W) inputs -> (B, V) logits, shapes fixed by the bucket."""
        bs, B, L = self.block_size, inp.size(0), wb * self.block_size
        ids, pos, blocks = inp[:, 0], inp[:, 1], inp[:, 2:]  # (B,), (B,), (B, W)
        slots = blocks.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs  # (B,)
        real = torch.arange(L, device=inp.device)[None, :] <= pos[:, None]  # (B, L) the context so far
        dtype = self.kv_caches[0][0].dtype
        mask = torch.zeros(B, 1, 1, L, dtype=dtype, device=inp.device).masked_fill(
            ~real[:, None, None], float("-inf"))
        meta = PagedAttentionMetadata(kv_caches=self.kv_caches, slot_mapping=slots,
                                      decode_token_idx=torch.arange(B, device=inp.device), decode_blocks=blocks,
                                      decode_mask=mask, prefills=[])
        return self.model(ids[None], position_ids=pos[None], attn_metadata=meta).logits[0]

    def describe(self) -> dict:
        return {"batch_buckets": self.batch_buckets, "width_buckets": self.width_buckets,
                "captured": sorted(self.graphs), "num_replays": self.num_replays, "num_eager": self.num_eager}
