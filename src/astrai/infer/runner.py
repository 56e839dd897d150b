"""The model runner: turns one scheduled step into a forward pass over the paged KV cache.

It owns the KV cache tensors (made through `model.allocate_kv_cache`; `release_kv_cache` frees
them and everything built over them, `allocate_kv_cache` makes a pool of another size). For each step
it lays the scheduled tokens of all sequences back to back in one flat row, builds their
positions and the `PagedAttentionMetadata` (how many new tokens each sequence has, its context
length and block table), applies the block manager's pending copy-on-write block copies, and
runs the model, asking only for the logits of the last token of each sequence that completes
its computation this step (those are the ones the sampler turns into new tokens), plus, for a
sequence that wants prompt log-probs, the logits of its prompt positions in this step's chunk.
Decode-only steps can replay CUDA graphs (cuda_graphs.py; a scratch KV block past the block
manager's pool serves their padding rows) and read KV in place through the varlen kernel
(`paged_kernel="varlen"`); both are CUDA-only and off by default. Host-built index tensors go
to the device from pinned memory when the device is CUDA. The dtypes it runs in (the KV pool's,
and the autocast that compiled decode warms up under) come from precision.py. With
`record_routing` (MoE models, for RL's routing replay) a routing pool lies beside the KV pool:
per cache slot, the experts every MoE layer chose for the token whose KV sits there, written by
the same slot mapping, so a prefix served from the cache brings the routing that computed it,
and `read_routing` gathers a sequence's from its block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from astrai.infer.compiled import CompiledDecode
from astrai.infer.cuda_graphs import CUDAGraphDecode
from astrai.infer.outputs import logprob_entry
from astrai.infer.precision import forward_precision
from astrai.infer.sampling import top_alternatives
from astrai.infer.scheduler import Sequence
from astrai.model.kernels import paged_varlen_supported, to_device
from astrai.model.paged_metadata import DecodeKVView, PagedAttentionMetadata


@dataclass
class StepLogits:
    """What one forward pass hands back to the engine."""

    logits: Tensor | None  # (S, V) at the last token of each sequence in `to_sample`
    to_sample: list[Sequence]
    # prompt log-probs: (P, V) logits and, per sequence, (seq, first prompt token index, rows);
    # row j of a part predicts prompt token `first + j`
    prompt_logits: Tensor | None = None
    prompt_parts: list[tuple[Sequence, int, int]] = field(default_factory=list)

    def record_prompt_logprobs(self, tokenizer: Any) -> None:
        """Append {prompt token: Logprob} (+ the k most likely alternatives) under the raw model."""
        row = 0
        for seq, first, num_rows in self.prompt_parts:
            targets = seq.prompt_token_ids[first : first + num_rows]
            k = seq.params.prompt_logprobs
            logits = self.prompt_logits[row : row + num_rows].float()  # (R, V); row j predicts targets[j]
            row += num_rows
            found = top_alternatives(logits, torch.tensor(targets, device=logits.device), k)
            ids, lps, ranks, chosen = (t.tolist() for t in found)
            seq.prompt_logprobs.extend(logprob_entry(tokenizer, token, chosen[j], ranks[j], ids[j], lps[j], k)
                                       for j, token in enumerate(targets))


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        decode_view_bytes: int = 0,
        paged_kernel: str = "gather",
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        record_routing: bool = False,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        for name, on in (("paged_kernel='varlen'", paged_kernel == "varlen"), ("cuda_graphs", cuda_graphs)):
            if on and self.device.type != "cuda":
                raise ValueError(f"{name} needs a CUDA device but the model is on {self.device}; leave it off "
                                 f"on {self.device.type} (the default path is the tested one there)")
        if paged_kernel == "varlen" and not paged_varlen_supported():
            raise ValueError(f"paged_kernel='varlen' needs a torch whose varlen_attn reads a block table "
                             f"(seqused_k, block_table); torch {torch.__version__} has none: upgrade torch "
                             f"or leave paged_kernel at 'gather'")
        self.paged_kernel = paged_kernel
        self.dtype = dtype
        # decode steps read a kept dense copy of their context instead of gathering it every step
        # (not with the varlen kernel, which reads the paged cache in place)
        use_view = decode_view_bytes > 0 and paged_kernel == "gather"
        self.decode_view = DecodeKVView(decode_view_bytes) if use_view else None
        self.compiled: CompiledDecode | None = None  # EngineConfig.compile: decode steps' MLPs compiled
        self.graphs: CUDAGraphDecode | None = None
        self.graph_setup: tuple[int, int, bool] | None = None  # (max_num_seqs, max_model_len, capture)
        self.max_model_len = max_model_len
        self.kv_caches: list[tuple[Tensor, Tensor]] | None = None  # None: released
        self.routing_shape = routing_shape(model) if record_routing else None  # (MoE layers, k)
        self.routing_pool: Tensor | None = None  # (slots, MoE layers, k) int16, with record_routing
        if record_routing and cuda_graphs:
            raise ValueError("record_routing needs eager decode steps (a replayed CUDA graph reports no experts); "
                             "leave cuda_graphs off")
        if cuda_graphs:
            self.graph_setup = (max_num_seqs, max_model_len, True)
        self.allocate_kv_cache(num_blocks)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """(Re)make the KV pool: `num_blocks` blocks, plus a scratch block for the padding rows of
        CUDA graphs when they are on. What was built over an old pool goes first: its decode copy,
        and its graphs, whose captures hold the old tensors' addresses (new ones are captured
        lazily over the new pool, as at the start)."""
        self.release_kv_cache()
        self.num_blocks = num_blocks
        scratch = 1 if self.graph_setup is not None else 0
        # plain tensors even when made under a caller's inference_mode: a live policy's steps
        # (no_grad) write into them, which an inference tensor refuses
        with torch.inference_mode(False):
            self.kv_caches = self.model.allocate_kv_cache(num_blocks + scratch, self.block_size, dtype=self.dtype,
                                                          device=self.device)
            if self.routing_shape is not None:
                self.routing_pool = torch.full(((num_blocks + scratch) * self.block_size, *self.routing_shape), -1,
                                               dtype=torch.int16, device=self.device)
        if self.graph_setup is not None:
            self.graphs = CUDAGraphDecode.for_engine(self.model, self.kv_caches, self.block_size, num_blocks,
                                                     *self.graph_setup)

    def release_kv_cache(self) -> None:
        """Drop the KV pool and all that holds its tensors (the dense decode copy, the CUDA graphs
        and their memory pool), so its memory is free until `allocate_kv_cache`."""
        self.kv_caches = None
        self.routing_pool = None
        self.graphs = None
        if self.decode_view is not None:
            self.decode_view.invalidate()

    def use_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> CUDAGraphDecode:
        """Decode steps replay CUDA graphs (capture=False: the same static forward, eagerly, as on
        CPU in tests). The KV pool is made again with one scratch block past the block manager's
        for padding rows; call before the first step."""
        self.graph_setup = (max_num_seqs, max_model_len, capture)
        self.allocate_kv_cache(self.num_blocks)
        return self.graphs

    def compile_decode(self, max_num_seqs: int, autocast_dtype: torch.dtype | None) -> dict:
        """EngineConfig.compile: decode steps' MLPs under torch.compile, warmed up now; what it made."""
        self.compiled = CompiledDecode(self.model, max_num_seqs)
        # warmed up in the steps' precision; under autocast the compiled MLP rounds differently
        # from eager bf16 (measured: log-probs ~1.5x further from the eager bf16 forward)
        with forward_precision(self.device, autocast_dtype):
            self.compiled.warm_up()
        return self.compiled.describe()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block src into dst in every layer's cache."""
        if not copies:
            return
        if self.decode_view is not None:
            self.decode_view.invalidate()  # (copies only duplicate blocks; rebuilding is the safe side)
        src, dst = to_device(torch.tensor(copies, dtype=torch.long).T.contiguous(), self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
        if self.routing_pool is not None:
            pool = self.routing_pool.view(-1, self.block_size, *self.routing_shape)  # (blocks, block_size, L, k)
            pool[dst] = pool[src]

    def read_routing(self, block_table: list[int], num_tokens: int) -> Tensor:
        """(num_tokens, MoE layers, k) int16 on the CPU: the experts of a sequence's first
        `num_tokens` tokens, from the slots its block table names (record_routing)."""
        pos = torch.arange(num_tokens)
        slots = torch.tensor(block_table, dtype=torch.long)[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.routing_pool[to_device(slots, self.device)].cpu()

    def execute(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        """Run one step: logits of the sequences that reach their last token this step (in
        `to_sample` order; none: logits None), and of prompt positions whose log-probs are wanted."""
        if all(n == 1 and seq.num_computed_tokens == len(seq.token_ids) - 1 for seq, n in scheduled):
            return self._execute_decode([seq for seq, _ in scheduled])
        return self._execute_mixed(scheduled)

    def _execute_mixed(self, scheduled: list[tuple[Sequence, int]]) -> StepLogits:
        """Any mix of prefill chunks and decodes."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, block_tables = [], [], []
        logits_indices: list[int] = []
        seq_ids: list[int] = []
        to_sample: list[Sequence] = []
        prompt_indices: list[int] = []
        prompt_parts: list[tuple[Sequence, int, int]] = []
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            end = start + num_new
            if seq.needs_prompt_logprobs:
                # position p predicts token p + 1; prompt tokens still without a log-prob only
                first = max(start, len(seq.prompt_logprobs) - 1)
                last = min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    offset = len(input_ids) - start
                    prompt_indices.extend(range(offset + first, offset + last))
                    prompt_parts.append((seq, first + 1, last - first))
            if num_new == 1:  # decode: skip the slice and range objects
                input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
            query_lens.append(num_new)
            context_lens.append(end)
            block_tables.append(seq.block_table)
            seq_ids.append(seq.seq_id)
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                to_sample.append(seq)
        self._set_reach([seq for seq, _ in scheduled])
        # a step of partial prefill chunks without prompt log-probs asks for no logits at all
        logits = self._forward(input_ids, positions, query_lens, context_lens, block_tables, seq_ids,
                               logits_indices + prompt_indices)  # (S + P, V)
        S = len(logits_indices)
        return StepLogits(logits[:S] if S else None, to_sample,
                          logits[S:] if prompt_indices else None, prompt_parts)

    def _execute_decode(self, seqs: list[Sequence]) -> StepLogits:
        """The steady state: every sequence feeds its last token and samples the next one."""
        positions = [seq.num_computed_tokens for seq in seqs]
        if self.graphs is not None:
            logits = self.graphs.run([seq.token_ids[-1] for seq in seqs], positions, [seq.block_table for seq in seqs])
            if logits is not None:
                if self.decode_view is not None:
                    self.decode_view.invalidate()  # the graph wrote KV the kept copy has not seen
                return StepLogits(logits, seqs)
        if self.compiled is not None:
            self.compiled.active = True
        self._set_reach(seqs)
        try:
            logits = self._forward([seq.token_ids[-1] for seq in seqs], positions, [1] * len(seqs),
                                   [p + 1 for p in positions], [seq.block_table for seq in seqs],
                                   [seq.seq_id for seq in seqs], None)
        finally:
            if self.compiled is not None:
                self.compiled.active = False
        return StepLogits(logits, seqs)

    def _set_reach(self, seqs: list[Sequence]) -> None:
        """Tell the decode copy how far this step's sequences can grow (prompt + max_tokens, or
        max_model_len): a rebuild then gathers no spare room that no sequence can use."""
        if self.decode_view is not None:
            self.decode_view.reach = max((self.max_model_len if seq.params.max_tokens is None else
                                          seq.num_prompt_tokens + seq.params.max_tokens for seq in seqs), default=None)

    def _forward(self, input_ids: list[int], positions: list[int], query_lens: list[int], context_lens: list[int],
                 block_tables: list[list[int]], seq_ids: list[int], logits_indices: list[int] | None) -> Tensor:
        """Logits (len(logits_indices), V) of one flat batch; all positions when logits_indices is None."""
        meta = PagedAttentionMetadata.build(
            query_lens, context_lens, block_tables, self.block_size, self.kv_caches, self.device,
            seq_ids, self.decode_view, self.paged_kernel,
        )
        ids, pos = to_device(torch.tensor([input_ids, positions], dtype=torch.long), self.device)[:, None]  # (1, N)
        idx = None if logits_indices is None else to_device(torch.tensor(logits_indices, dtype=torch.long), self.device)
        record = self.routing_pool is not None
        try:
            out = self.model(ids, position_ids=pos, attn_metadata=meta, logits_indices=idx, return_routing=record)
            logits = out.logits[0]
            if record:  # each token's experts into its KV slot
                self.routing_pool[meta.slot_mapping] = out.routing[0].to(torch.int16)
        except BaseException:
            if self.decode_view is not None:
                self.decode_view.invalidate()
            raise
        if self.decode_view is not None:
            self.decode_view.commit()
        return logits


def routing_shape(model: nn.Module) -> tuple[int, int]:
    """(MoE layers, experts per token) of a model whose routing the engine records; a model
    without MoE layers is refused (it has no routing to record)."""
    cfg = model.config
    num_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    if not num_moe:
        raise ValueError("record_routing is for mixture-of-experts models, but this model has no MoE layer "
                         "(num_experts is 0); leave record_routing off")
    return num_moe, cfg.num_experts_per_tok
