"""Evaluation during training: held-out prompts answered by generation on the live model.

``GenerationEval`` observes every loop (offline and online RL). At step 0, every
``eval_interval`` optimizer steps and at the last step it answers the prompt records of
``eval_data_path`` (this rank's share, records r, r + world, ...) through an engine over the live
weights: for online RL the rollout engine itself (its KV pool, its prefix cache keyed by policy
version; under FSDP its unsharded replica, refreshed for the current version); for the offline
loops an engine of its own over the live module (under FSDP over a replica refreshed before each
evaluation). Like a rollout, an evaluation has the engine's KV pool only while it generates (made
for its sequences, freed after; ``keep_kv_pool`` keeps it). Each prompt gets one greedy completion, scored against its answer by
``eval_match`` and by the run's rewards, and ``eval_num_samples`` sampled ones (rollout
temperature, top-p, top-k) with seeds from (random_seed, step, prompt index): no training RNG is
drawn and a resumed run logs the same numbers at the same steps. The sums are reduced over ranks;
rank 0 writes a ``split: eval`` row to metrics.jsonl, and the values join the step's metrics, so
early stopping (``early_stopping_metric eval/accuracy``), the reporters and the end-of-run summary
see them. Like the rollout runner, this is one of the two bridges from ``astrai.train`` to
``astrai.infer``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from astrai.data.tasks import SCORERS
from astrai.infer.engine import LLMEngine
from astrai.infer.sampling import SamplingParams
from astrai.train import dist
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.rollout import batch_engine, batch_kv_pool, unsharded_replica

SUMS = ("prompts", "correct", "greedy_reward", "samples", "sample_reward", "sample_correct", "tokens",
        "truncated", "skipped")


def eval_seed(random_seed: int, step: int, prompt_index: int) -> int:
    """A sampling seed per (run seed, step, eval prompt), apart from the rollouts' seeds."""
    # ints only: a str in the tuple would hash differently in every process (PYTHONHASHSEED)
    return hash((0xE7A1, random_seed, step, prompt_index)) & ((1 << 63) - 1)


class GenerationEval:
    """Scores held-out prompts by generation every ``eval_interval`` steps (module docstring)."""

    def __init__(self, config: Any):
        from astrai.data.datasets import build_dataset

        self.config = cfg = config
        self.interval, self.num_samples = cfg.train.eval_interval, cfg.train.eval_num_samples
        self.score = SCORERS[cfg.train.eval_match]
        self.path = Path(cfg.log.log_dir) / "metrics.jsonl"
        self.build_dataset = build_dataset
        self.records: list[dict[str, Any]] = []
        self.engine: LLMEngine | None = None
        self.replica: torch.nn.Module | None = None
        self.seconds = 0.0  # all evaluations of this process so far (the summary reports it)
        self.last: dict[str, float] = {}

    def on_train_begin(self, trainer: Any) -> None:
        cfg = self.config
        if trainer.tokenizer is None:
            raise ValueError("eval_data_path needs a tokenizer to render its prompts; set --tokenizer_path")
        data = self.build_dataset("prompt", cfg.data.eval_data_path, trainer.tokenizer, 1 << 30)
        if len(data) == 0:
            raise ValueError(f"eval_data_path {cfg.data.eval_data_path!r} holds no prompt records; give records "
                             "with 'messages' (or 'instruction') and 'answer', or set --eval_interval 0")
        rank, world = trainer.dist.rank, trainer.dist.world_size
        self.records = [data[i] for i in range(rank, len(data), world)]
        self.rewards = RewardSet(cfg.rl, trainer.device, tokenizer=trainer.tokenizer)
        self.tokenizer = trainer.tokenizer
        too_long = sum(len(data[i]["prompt_ids"]) > cfg.rl.max_prompt_len for i in range(len(data)))
        if too_long == len(data):
            raise ValueError(f"every eval prompt of {cfg.data.eval_data_path!r} is longer than max_prompt_len="
                             f"{cfg.rl.max_prompt_len}; raise --max_prompt_len or shorten the prompts")
        if too_long and trainer.is_main:
            print(f"warning: {too_long} of {len(data)} eval prompts are longer than max_prompt_len="
                  f"{cfg.rl.max_prompt_len}; each evaluation skips and counts them (eval/skipped_prompts)",
                  file=sys.stderr)
        if trainer.ctx.step == 0:
            self._evaluate(trainer, 0, epoch=0)

    def after_optimizer_step(self, trainer: Any) -> None:
        step = trainer.ctx.step
        if step % self.interval == 0 or step == trainer.total_steps:
            self._evaluate(trainer, step, epoch=trainer.step_metrics.get("epoch", trainer.ctx.epoch))

    def on_train_end(self, trainer: Any) -> None:
        if self.engine is not None:  # the offline engine's KV pool is freed with the run
            self.engine = self.replica = None

    # ---------------------------------------------------------------------------- one evaluation

    def _evaluate(self, trainer: Any, step: int, epoch: int) -> None:
        start = time.perf_counter()
        engine = self._engine(trainer)
        sums = self._answer(engine, step)
        totals = dict(zip(SUMS, dist.all_reduce_sum(torch.tensor([sums[k] for k in SUMS], dtype=torch.float64,
                                                                 device=trainer.device)).tolist()))
        seconds = time.perf_counter() - start
        self.seconds += seconds
        metrics = summarise(totals, seconds)
        self.last = {"step": step, **metrics}
        trainer.step_metrics = {**getattr(trainer, "step_metrics", {}), **metrics}
        if trainer.is_main:
            with self.path.open("a") as f:
                f.write(json.dumps({"split": "eval", "step": step, "epoch": epoch, **metrics}) + "\n")

    def _engine(self, trainer: Any) -> LLMEngine:
        """The engine over the current weights, its prefix cache on the current policy version."""
        version = trainer.ctx.policy_version
        runner = getattr(trainer, "runner", None)
        if runner is not None:  # online RL: the rollout engine (the loop published this version to it)
            runner.refresh_replica(version)  # FSDP: a collective; every rank evaluates at the same step
            runner.set_policy_version(version)
            return runner.engine
        if self.engine is None:
            self.engine = self._offline_engine(trainer)
        if self.replica is not None:
            dist.copy_full_weights(trainer.raw_model, self.replica)
        self.engine.set_policy_version(version)
        return self.engine

    def _offline_engine(self, trainer: Any) -> LLMEngine:
        rl = self.config.rl
        model = trainer.raw_model
        if dist.is_fsdp(model):  # a sharded forward is a collective: ranks would wait on each other
            self.replica = model = unsharded_replica(model)
        max_len = rl.max_prompt_len + rl.rollout_max_tokens
        num_seqs = max(1, min(64, len(self.records) * (1 + self.num_samples)))
        engine = batch_engine(model, trainer.tokenizer, num_seqs, max_len, self.config.train.bf16)
        if not rl.keep_kv_pool:
            engine.release_kv_cache()  # made for each evaluation (batch_kv_pool)
        return engine

    def _answer(self, engine: LLMEngine, step: int) -> dict[str, float]:
        """Greedy and sampled completions for this rank's records, scored; the sums of SUMS."""
        rl, seed = self.config.rl, self.config.train.random_seed
        sums = dict.fromkeys(SUMS, 0.0)
        kept = [r for r in self.records if len(r["prompt_ids"]) <= rl.max_prompt_len]
        sums["skipped"] = float(len(self.records) - len(kept))
        if not kept:
            return sums
        prompts = [list(r["prompt_ids"]) for r in kept]
        params = [SamplingParams(temperature=0.0, max_tokens=rl.rollout_max_tokens)] * len(kept)
        if self.num_samples:
            params = params + [SamplingParams(temperature=rl.rollout_temperature, top_p=rl.rollout_top_p,
                                              top_k=rl.rollout_top_k, max_tokens=rl.rollout_max_tokens,
                                              n=self.num_samples, seed=eval_seed(seed, step, i))
                               for i in range(len(kept))]
        longest = max(len(p) for p in prompts) + rl.rollout_max_tokens
        with batch_kv_pool(engine, len(kept) * (1 + self.num_samples), longest, keep=rl.keep_kv_pool):
            outputs = engine.run_batch(prompts + (prompts if self.num_samples else []), params,
                                       return_logprobs=False)
        greedy, sampled = outputs[:len(kept)], outputs[len(kept):]
        records = [{"messages": r["messages"], "answer": r["answer"], **dict(r.get("metadata") or {})} for r in kept]
        answers = [g.outputs[0] for g in greedy]
        sums["prompts"] = float(len(kept))
        sums["correct"] = float(sum(self.score(c.text, r["answer"]) for c, r in zip(answers, records)))
        sums["greedy_reward"] = self._reward_sum(prompts, answers, records, 1)
        for out in sampled or greedy:  # response length and truncation: the samples, else the greedy answers
            sums["tokens"] += sum(len(c.token_ids) for c in out.outputs)
            sums["truncated"] += sum(c.finish_reason == "length" for c in out.outputs)
        if sampled:
            completions = [c for out in sampled for c in out.outputs]
            per_sample = [r for r in records for _ in range(self.num_samples)]
            repeated = [p for p in prompts for _ in range(self.num_samples)]
            sums["samples"] = float(len(completions))
            sums["sample_reward"] = self._reward_sum(repeated, completions, per_sample, self.num_samples)
            sums["sample_correct"] = float(sum(self.score(c.text, r["answer"]) for c, r in zip(completions, per_sample)))
        return sums

    def _reward_sum(self, prompts: list[list[int]], completions: list[Any], records: list[dict[str, Any]],
                    group_size: int) -> float:
        total, _ = self.rewards([self.tokenizer.decode(p) for p in prompts], [c.text for c in completions], records,
                                [p + list(c.token_ids) for p, c in zip(prompts, completions)], group_size,
                                completion_ids=[list(c.token_ids) for c in completions])
        return float(total.double().sum())


def summarise(t: dict[str, float], seconds: float) -> dict[str, float]:
    """The ``eval/`` metrics from the sums over ranks."""
    prompts, samples = max(t["prompts"], 1.0), max(t["samples"], 1.0)
    completions = t["samples"] or t["prompts"]
    out = {"eval/accuracy": t["correct"] / prompts, "eval/greedy_reward_mean": t["greedy_reward"] / prompts}
    if t["samples"]:
        out.update({"eval/reward_mean": t["sample_reward"] / samples, "eval/sampled_accuracy": t["sample_correct"] / samples})
    out.update({"eval/response_length": t["tokens"] / max(completions, 1.0),
                "eval/truncated_fraction": t["truncated"] / max(completions, 1.0),
                "eval/num_prompts": t["prompts"], "eval/skipped_prompts": t["skipped"], "eval/seconds": seconds})
    return out
