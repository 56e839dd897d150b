"""The inference engine: requests in, tokens, text and log-probs out.

`LLMEngine` ties the parts together. It sizes its limits at start (sizing.py: longest
sequence, KV pool, step budgets); `add_request` checks a request against them and queues one
sequence for it; each `step()` is schedule (scheduler.py) -> run the model (runner.py) ->
sample (sampling.py) -> postprocess here: append the tokens, let each request apply its stop
tokens, stop strings and length limits (request.py), fork the n samples of a request after its
shared prefill, free finished sequences, and report the requests that changed. Its knobs are
`EngineConfig` (config.py); precision.py resolves the dtypes of its forward passes and KV pool
(`autocast_dtype`: a bf16 trainer's precision). `run_batch` drives the same loop synchronously
for RL rollouts, and `generate_all` (text or token-id prompts) is what the offline `LLM` of
llm.py calls. The engine runs the model it is given in place (a live
training module is switched to eval mode and no_grad for each step, then restored; a model in
eval mode runs under inference_mode); `set_policy_version` keys the prefix cache by weights
version, so KV of older weights is never reused. An idle engine can free its KV pool
(`release_kv_cache`, e.g. during a trainer's backward) and make it again at the size the next
batch needs (`reserve_kv_cache`; a request re-makes it otherwise). With `record_routing` (MoE
models) each finished sequence reads the experts of its tokens from the runner's routing pool
before its blocks are freed; its completion output carries them (RL's routing replay).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from astrai.infer.block_manager import BlockManager, kv_bytes_per_token
from astrai.infer.config import EngineConfig, make_engine_config
from astrai.infer.outputs import EngineStats, RequestMetrics, RequestOutput, TopLogprobs
from astrai.infer.precision import InferenceMode, dtype_name, resolve_precision
from astrai.infer.probe import check_tuning, measure_step_cost, tune_owned_model
from astrai.infer.request import Request
from astrai.infer.runner import ModelRunner
from astrai.infer.sampling import Sampler, SamplerOutput, SamplingParams, make_generator
from astrai.infer.scheduler import Scheduler, Sequence
from astrai.infer.sizing import (
    check_request,
    decode_view_bytes,
    num_kv_blocks,
    pool_blocks,
    resolve_max_model_len,
    token_budgets,
)
from astrai.model.matmul import set_cpu_matmul

DETOKENIZE_CONTEXT = 5  # tokens of left context when decoding a new token's text


class LLMEngine:
    def __init__(self, model: nn.Module, tokenizer: Any | None = None, config: EngineConfig | None = None,
                 **config_fields: Any) -> None:
        self.config = config = make_engine_config(config, config_fields)
        set_cpu_matmul(config.cpu_matmul)  # before the probes time a forward pass
        self.model = model
        self.tokenizer = tokenizer
        model_cfg = model.config
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = resolve_max_model_len(model_cfg, config.max_model_len)
        device = next(model.parameters()).device  # the engine runs the model where it is, never copies it
        if config.device and torch.device(config.device).type != device.type:
            raise ValueError(f"EngineConfig.device is {config.device!r} but the model is on {device}; "
                             f"move the model first or leave device unset")
        self.device = device
        self.weights_dtype = next(model.parameters()).dtype
        self.autocast_dtype, self.kv_cache_dtype = resolve_precision(config.autocast_dtype, config.kv_cache_dtype,
                                                                     self.weights_dtype)
        num_blocks = num_kv_blocks(
            model_cfg, self.kv_cache_dtype, device, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, kv_cache_tokens=config.kv_cache_tokens,
            kv_cache_memory_gb=config.kv_cache_memory_gb)
        self.probes: dict[str, Any] = {}  # what load-time probes measured and chose (describe())
        self._inference_mode = InferenceMode(model, device, self.autocast_dtype)
        threshold, batched = token_budgets(
            config.long_prefill_token_threshold, config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill, measure_chunk=self._measure_chunk)
        self.policy_version = 0
        self.initial_num_blocks = num_blocks  # reserve_kv_cache(None) makes this size again
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, batched, config.enable_chunked_prefill,
                                   threshold, config.max_request_kv_share)
        self.runner = ModelRunner(model, num_blocks, config.block_size, dtype=self.kv_cache_dtype, device=device,
                                  decode_view_bytes=decode_view_bytes(config.decode_view_memory_gb),
                                  paged_kernel=config.paged_kernel, cuda_graphs=config.cuda_graphs,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  record_routing=config.record_routing)
        if config.compile:
            self.probes["compile"] = self.runner.compile_decode(config.max_num_seqs, self.autocast_dtype)
        self.sampler = Sampler(make_generator(config.engine_seed, device))
        self._requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._batch_ids = itertools.count()
        self._lazy_text = False  # run_batch: decode text once at the end unless stop strings need it
        eos = model_cfg.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer is not None:
            eos_ids += list(getattr(tokenizer, "stop_token_ids", None) or [])
        self.eos_token_ids = frozenset(eos_ids)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **config_fields: Any) -> LLMEngine:
        from astrai.data.tokenizer import load_tokenizer
        from astrai.model.hf import load_model
        from astrai.model.hub import resolve_model_path

        model_dir = resolve_model_path(model_dir)  # a Hub id -> its cached snapshot; a local path as it is
        config = make_engine_config(None, config_fields)
        check_tuning(config.num_threads, config.linear_layout)  # before the (slow) load
        set_cpu_matmul(config.cpu_matmul)  # before the layout probe times the linears
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_model(model_dir, dtype=config.dtype, device=device, lora=config.lora)
        model.eval()
        probes = tune_owned_model(model, config.num_threads, config.linear_layout)
        tokenizer = load_tokenizer(model_dir) if (Path(model_dir) / "tokenizer.json").exists() else None
        engine = cls(model, tokenizer, config)
        engine.probes = {**probes, **engine.probes}
        return engine

    def _measure_chunk(self) -> int:
        """The prefill chunk from the model's timed forward passes (probe.py), recorded for describe()."""
        with self._inference_mode():
            cost = measure_step_cost(self.model, self.max_model_len)
        self.probes["step_cost"] = cost.as_dict()
        return cost.chunk

    def describe(self) -> dict[str, Any]:
        """The settings this engine runs with, including what load-time probes measured and chose
        (for a startup summary): scheduling budgets, KV pool, precision, threads, weight layout."""
        sched, cfg = self.scheduler, self.model.config
        return {
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "long_prefill_token_threshold": sched.long_prefill_token_threshold,
            "max_model_len": self.max_model_len,
            "kv_cache_tokens": self.block_manager.num_blocks * self.block_manager.block_size,
            "block_size": self.block_manager.block_size,
            "device": str(self.device),
            "dtype": dtype_name(self.weights_dtype),
            "autocast_dtype": dtype_name(self.autocast_dtype),
            "kv_cache_dtype": dtype_name(self.kv_cache_dtype),
            "kv_bytes_per_token": kv_bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                                     self.kv_cache_dtype),
            "torch_threads": torch.get_num_threads(),
            "probes": self.probes,
        }

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, with_logprobs: bool = True) -> None:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use; pick a unique id")
        prompt_text, prompt_ids = self._tokenize(prompt)
        check_request(prompt_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                      max_num_seqs=self.config.max_num_seqs, block_manager=self.block_manager)
        eos_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        req = Request(
            request_id, prompt_text, prompt_ids, params, RequestMetrics(arrival_time or time.time()),
            eos_ids=eos_ids, stop_ids=frozenset(set(params.stop_token_ids) | eos_ids), with_logprobs=with_logprobs,
        )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to detokenise; pass stop_token_ids instead")
        if not self.has_kv_cache:  # released: made again at its last size
            self._make_kv_cache(self.block_manager.num_blocks)
        self._requests[request_id] = req
        self.scheduler.add(self._new_sequence(req, 0))

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the engine a tokenizer")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, [int(t) for t in prompt]

    def _new_sequence(self, req: Request, index: int) -> Sequence:
        params = req.params
        gen = None
        if params.seed is not None:
            # sample i of a seeded request has its own stream; sample 0 uses the seed itself
            seed = params.seed if index == 0 else hash((params.seed, index)) & ((1 << 63) - 1)
            gen = make_generator(seed, self.device)
        seq = Sequence(next(self._seq_ids), req.request_id, index, req.prompt_token_ids, params,
                       req.metrics.arrival_time, gen, sorted(req.stop_ids))
        seq.prefix_offset = max(0, seq.num_prompt_tokens - DETOKENIZE_CONTEXT)
        req.seqs.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at once; unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        self._free_decode_view_when_idle()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        used = bm.num_blocks - bm.num_free_blocks
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks, kv_usage=used / bm.num_blocks,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate, num_preemptions=self.scheduler.num_preemptions,
        )

    def set_policy_version(self, version: int) -> None:
        """Declare new weights. Cached prefixes of older versions are dropped, and sequences in
        flight are recomputed from their tokens, so no KV of older weights is read again."""
        if version < self.policy_version:
            raise ValueError(
                f"policy_version must not decrease: engine is at {self.policy_version}, got {version}"
            )
        if version == self.policy_version:
            return
        self.scheduler.preempt_all()
        self.block_manager.set_policy_version(version)
        self.policy_version = version

    def load_weights(self, state_dict: dict[str, torch.Tensor], policy_version: int) -> None:
        """Copy `state_dict` (this model's names and shapes: a checkpoint of it) into the model in
        place (tensors keep their storage, so compiled graphs stay valid) and take `policy_version`;
        only while no request is in flight. Every cached prefix is dropped, so the version may also
        go back (a trainer resumed from an older checkpoint): no KV of other weights is read again."""
        self._check_idle("load_weights")
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
        if missing or unexpected:
            raise ValueError(f"the weights do not fit the served model: missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}; load a checkpoint of the same architecture")
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"the weights do not fit the served model: {name} has shape {tuple(tensor.shape)}, "
                                 f"the served model's {tuple(own[name].shape)}; load a checkpoint of the same "
                                 "architecture")
        with torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        self.block_manager.reset_prefix_cache()
        self.block_manager.set_policy_version(policy_version)
        self.policy_version = policy_version

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use are untouched); e.g. between benchmark runs."""
        self.block_manager.reset_prefix_cache()

    # -- the KV pool -----------------------------------------------------------------------------
    @property
    def has_kv_cache(self) -> bool:
        """Whether the KV pool's tensors exist (False after release_kv_cache, until remade)."""
        return self.runner.kv_caches is not None

    def release_kv_cache(self) -> None:
        """Free the KV pool: its tensors, the dense decode copy and CUDA graphs over it, and every
        cached prefix (vLLM's sleep, for the KV cache alone), e.g. while a trainer runs its backward
        pass. The next request makes it again at its last size; `reserve_kv_cache` at another."""
        self._check_idle("release_kv_cache")
        self.runner.release_kv_cache()
        self.block_manager.reset_prefix_cache()  # their KV is gone

    def reserve_kv_cache(self, num_tokens: int | None = None) -> None:
        """A KV pool with room for `num_tokens` token slots (in whole blocks; None: the size the
        engine started with): made afresh, with its own block manager and scheduler and no cached
        prefix, unless a pool of that size is in place already."""
        self._check_idle("reserve_kv_cache")
        num_blocks = self.initial_num_blocks if num_tokens is None else pool_blocks(num_tokens, self.config.block_size)
        if not self.has_kv_cache or num_blocks != self.block_manager.num_blocks:
            self._make_kv_cache(num_blocks)

    def _make_kv_cache(self, num_blocks: int) -> None:
        old, cfg = self.scheduler, self.config
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.block_manager.set_policy_version(self.policy_version)
        self.scheduler = Scheduler(self.block_manager, old.max_num_seqs, old.max_num_batched_tokens,
                                   old.enable_chunked_prefill, old.long_prefill_token_threshold,
                                   cfg.max_request_kv_share)
        self.scheduler.num_preemptions = old.num_preemptions
        self.runner.allocate_kv_cache(num_blocks)

    def _check_idle(self, what: str) -> None:
        if self._requests:
            raise RuntimeError(f"{what}: {len(self._requests)} request(s) in flight; let them finish or abort them")

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> sample -> postprocess step; the requests that changed."""
        return [req.output(self.policy_version) for req in self._step()]

    def _step(self) -> list[Request]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        now = time.time()
        with self._inference_mode():
            self.runner.copy_blocks(self.block_manager.pending_copies)
            self.block_manager.pending_copies.clear()
            step = self.runner.execute(sched.scheduled)
            if step.prompt_parts:
                step.record_prompt_logprobs(self.tokenizer)
        logits, to_sample = step.logits, step.to_sample
        for seq, num_new in sched.scheduled:
            seq.num_computed_tokens += num_new
            self.block_manager.commit(seq)
        for seq in sched.admitted:
            metrics = self._requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        if logits is None:
            return []
        rows, row_of = self._rows_with_forks(to_sample)
        if len(rows) != len(to_sample):
            logits = logits[torch.tensor(row_of, device=logits.device)]
        sampled = self.sampler.sample(logits, rows)
        changed = self._postprocess(rows, sampled)
        self._free_decode_view_when_idle()
        return changed

    def _free_decode_view_when_idle(self) -> None:
        if not self.scheduler.running and self.runner.decode_view is not None:
            self.runner.decode_view.invalidate()  # nothing decodes: free the dense copy

    def _rows_with_forks(self, to_sample: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """The sampling rows: each sequence, and after a request's prefill its n - 1 new siblings,
        which reuse the same logits row and share the prompt's KV blocks."""
        rows, row_of = [], []
        for i, seq in enumerate(to_sample):
            rows.append(seq)
            row_of.append(i)
            if seq.num_pending_forks:
                req = self._requests[seq.request_id]
                children = [self._new_sequence(req, k) for k in range(1, seq.num_pending_forks + 1)]
                self.scheduler.add_forks(seq, children)
                rows += children
                row_of += [i] * len(children)
        return rows, row_of

    def _postprocess(self, rows: list[Sequence], sampled: SamplerOutput) -> list[Request]:
        logprobs = sampled.logprobs.tolist()
        raw_logprobs = sampled.raw_logprobs.tolist()
        top = TopLogprobs(sampled, self.tokenizer) if sampled.top_ids is not None else None
        now = time.time()
        touched: dict[str, Request] = {}
        ended: list[Request] = []  # requests with a sequence that finished this step
        for i, (seq, token) in enumerate(zip(rows, sampled.token_ids)):
            req = self._requests[seq.request_id]
            seq.append_token(token)
            seq.cumulative_logprob += logprobs[i]
            if req.with_logprobs:
                if top is not None and seq.params.logprobs is not None:
                    seq.logprobs.append(top.entry(i, seq.params.logprobs, logprobs[i], raw=False))
                    seq.raw_logprobs.append(top.entry(i, seq.params.logprobs, raw_logprobs[i], raw=True))
                else:
                    seq.logprobs.append(logprobs[i])
                    seq.raw_logprobs.append(raw_logprobs[i])
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.check_stop(seq, token, self.tokenizer, self.max_model_len, self._lazy_text)
            if seq.finish_reason is not None:
                if self.runner.routing_pool is not None:  # read before its blocks are freed
                    seq.routing = self.runner.read_routing(seq.block_table, seq.num_computed_tokens)
                self.scheduler.finish(seq)
                ended.append(req)
            touched[req.request_id] = req
        for req in ended:
            if req.request_id in self._requests and req.finished:
                req.metrics.finished_time = now
                del self._requests[req.request_id]
        return list(touched.values())

    # -- synchronous batches (RL rollouts) ---------------------------------------------------------
    def run_batch(self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                  return_logprobs: bool = True) -> list[RequestOutput]:
        """Generate for every prompt on the caller's thread; outputs in prompt order. Other
        requests already in the engine advance too, but their outputs are not returned."""
        return self.generate_all(prompt_ids, params, with_logprobs=return_logprobs)

    def generate_all(self, prompts: list[str] | list[list[int]],
                     params: SamplingParams | list[SamplingParams] | None = None, *, with_logprobs: bool = True,
                     on_finish: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) on the caller's thread until all are
        finished; outputs in prompt order. `on_finish()` is called as each one finishes (a
        progress bar). On any error, including KeyboardInterrupt, the batch's requests are aborted."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        batch = next(self._batch_ids)
        ids = [f"batch-{batch}-{i}" for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        self._lazy_text = True  # nobody reads text before the end: decode it once then
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(rid, prompt, p, with_logprobs=with_logprobs)
            pending = set(ids)
            # one eval/no-grad switch for the whole batch, not one per step (a live policy in
            # training mode has many modules to toggle)
            with self._inference_mode():
                self._generate_pending(pending, results, on_finish)
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            self._lazy_text = False
        return [results[rid] for rid in ids]

    def _generate_pending(self, pending: set[str], results: dict[str, RequestOutput],
                          on_finish: Callable[[], None] | None) -> None:
        while pending:
            for req in self._step():
                if req.finished and req.request_id in pending:
                    results[req.request_id] = req.output(self.policy_version)
                    pending.discard(req.request_id)
                    if on_finish is not None:
                        on_finish()

