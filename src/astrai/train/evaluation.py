"""Evaluation during training: held-out prompts answered by the episode runner on the live model.

``GenerationEval`` observes every loop (offline and online RL). At step 0, every
``eval_interval`` optimizer steps and at the last step it answers the prompt records of
``eval_data_path`` (this rank's share, records r, r + world, ...) through the same episode runner
as the rollouts (``rl/runner.py``), so a run with tools or an environment evaluates with them
(multi-turn episodes). The sampler is, for online RL, the rollout sampler itself (its KV pool, its
prefix cache keyed by policy version; under FSDP its unsharded replica, refreshed for the current
version); for the offline loops an in-process sampler of its own over the live module (under FSDP
over a replica refreshed before each evaluation). Like a rollout, an evaluation has the engine's KV
pool only while it generates. Each prompt gets one greedy episode, scored against its answer by
``eval_match`` (``score_completions``, the scoring of ``astrai eval --data``) and by the run's
rewards, and ``eval_num_samples`` sampled ones (the rollout sampling) with seeds from (random_seed,
step, prompt index[, sample, turn]): no training RNG is drawn and a resumed run logs the same
numbers at the same steps. The sums are reduced over ranks; rank 0 writes a ``split: eval`` row to
metrics.jsonl, and the values join the step's metrics, so early stopping (``early_stopping_metric
eval/accuracy``), the reporters and the end-of-run summary see them. ``answer`` is the evaluation
itself, also used by the tools demo.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from astrai.config import Config
from astrai.data.tasks import no_answers_warning, score_completions
from astrai.train import dist
from astrai.train.rl.engine_sampler import engine_runner
from astrai.train.rl.episode import Episode, episode_stats
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import Draw, EpisodeRunner
from astrai.train.traces import eval_records

SUMS = ("prompts", "correct", "greedy_reward", "samples", "sample_reward", "sample_correct", "tokens",
        "truncated", "skipped", "tool_episodes")


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt (Chen et al. 2021) from n samples of which c are right:
    1 - C(n - c, k) / C(n, k), the chance that k of the n drawn without replacement hold a right one."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def eval_seed(random_seed: int, step: int, prompt_index: int, *more: int) -> int:
    """A sampling seed per (run seed, step, eval prompt[, sample, turn]), apart from the rollouts' seeds."""
    # ints only: a str in the tuple would hash differently in every process (PYTHONHASHSEED)
    return hash((0xE7A1, random_seed, step, prompt_index, *more)) & ((1 << 63) - 1)


@dataclass
class Answers:
    """One draw's episodes (group_size per prompt, prompts in order), scored: the rewards (N,),
    their terms, and each final answer against the record's by the ``eval_match`` scorer."""

    episodes: list[Episode]
    rewards: Tensor
    terms: dict[str, Tensor]
    correct: list[float]

    @property
    def num_tokens(self) -> int:
        """Sampled tokens over every turn of every episode."""
        return sum(lp is not None for e in self.episodes for lp in e.logps)

    @property
    def num_truncated(self) -> int:
        return sum(e.truncated or e.finish_reason == "length" for e in self.episodes)

    def stats(self) -> dict[str, float]:
        """Multi-turn metrics of these episodes (tool use, turns, errors)."""
        return episode_stats(self.episodes, 0.0, 0.0)


def answer(runner: EpisodeRunner, records: list[dict[str, Any]], prompt_ids: list[list[int]], draws: list[Draw],
           policy_version: int, match: str = "exact") -> list[Answers]:
    """Every draw's episodes for `records` run together (one batch, turn by turn), then scored."""
    results = []
    with torch.no_grad():
        per_draw = runner.run(records, prompt_ids, draws, policy_version, logprobs=False)
    for draw, episodes in zip(draws, per_draw):
        total, terms = runner.score(episodes, draw.group_size)
        correct = score_completions([e.final_text for e in episodes], [e.record["answer"] for e in episodes], match)
        results.append(Answers(episodes, total, terms, correct))
    return results


class GenerationEval:
    """Scores held-out prompts by generation every ``eval_interval`` steps (module docstring)."""

    def __init__(self, config: Config, traces: Any = None):
        self.config = cfg = config
        self.traces = traces  # a TraceLog (train/traces.py): the episodes are written there too
        self.answers: list[tuple[str, Answers]] = []  # the last evaluation's draws, until traced
        self.interval, self.num_samples = cfg.train.eval_interval, cfg.train.eval_num_samples
        self.sum_keys = (*SUMS, *(f"pass@{k}" for k in cfg.train.eval_pass_k))  # summed over prompts and ranks
        self.path = Path(cfg.log.log_dir) / "metrics.jsonl"
        self.records: list[dict[str, Any]] = []
        self.runner: EpisodeRunner | None = None
        self.seconds = 0.0  # all evaluations of this process so far (the summary reports it)
        self.last: dict[str, float] = {}

    def on_train_begin(self, trainer: Any) -> None:
        from astrai.data.datasets import build_dataset

        cfg = self.config
        if trainer.tokenizer is None:
            raise ValueError("eval_data_path needs a tokenizer to render its prompts; set --tokenizer_path")
        data = build_dataset("prompt", cfg.data.eval_data_path, trainer.tokenizer, 1 << 30)
        if len(data) == 0:
            raise ValueError(f"eval_data_path {cfg.data.eval_data_path!r} holds no prompt records; give records "
                             "with 'messages' (or 'instruction') and 'answer', or set --eval_interval 0")
        rank, world = trainer.dist.rank, trainer.dist.world_size
        self.records = [data[i] for i in range(rank, len(data), world)]
        warning = no_answers_warning([data[i]["answer"] for i in range(len(data))], f"eval_data_path {cfg.data.eval_data_path!r}")
        if warning is not None and trainer.is_main:
            print(warning, file=sys.stderr)
        self.rewards = RewardSet(cfg.rl, trainer.device, tokenizer=trainer.tokenizer)
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
        self.runner = None  # the offline sampler's engine and KV pool are freed with the run

    # ---------------------------------------------------------------------------- one evaluation

    def _evaluate(self, trainer: Any, step: int, epoch: int) -> None:
        start = time.perf_counter()
        sums = self._answer(self._runner(trainer), step, trainer.ctx.policy_version)
        if self.traces is not None and trainer.is_main:
            for draw, answers in self.answers:
                self.traces.write(eval_records(step, trainer.ctx.policy_version, draw, answers,
                                               self.config.log.trace_samples, trainer.tokenizer))
        self.answers = []
        totals = dict(zip(self.sum_keys, dist.all_reduce_sum(torch.tensor([sums[k] for k in self.sum_keys],
                                                                          dtype=torch.float64,
                                                                          device=trainer.device)).tolist()))
        seconds = time.perf_counter() - start
        self.seconds += seconds
        metrics = summarise(totals, seconds, self.runner.multi_turn)
        self.last = {"step": step, **metrics}
        trainer.step_metrics = {**getattr(trainer, "step_metrics", {}), **metrics}
        if trainer.is_main:
            with self.path.open("a") as f:
                f.write(json.dumps({"split": "eval", "step": step, "epoch": epoch, **metrics}) + "\n")

    def _runner(self, trainer: Any) -> EpisodeRunner:
        """The runner over the current weights, its sampler's prefix cache on the current policy version."""
        version = trainer.ctx.policy_version
        if self.runner is None:
            sampler = getattr(trainer, "rollout_sampler", None)
            if sampler is not None:  # online RL: the rollout sampler (the loop published this version to it)
                self.runner = EpisodeRunner(sampler, trainer.tokenizer, self.config.rl, self.rewards,
                                            self.config.rl.max_prompt_len)
            else:
                num_seqs = max(1, min(64, len(self.records) * (1 + self.num_samples)))
                self.runner = engine_runner(trainer.raw_model, trainer.tokenizer, self.config.rl, num_seqs,
                                            self.rewards, bf16=self.config.train.bf16)
        self.runner.sampler.sync_weights(version)  # FSDP: a collective; every rank evaluates at the same step
        self.runner.sampler.set_policy_version(version)
        return self.runner

    def _answer(self, runner: EpisodeRunner, step: int, policy_version: int) -> dict[str, float]:
        """Greedy and sampled episodes for this rank's records, scored; the sums of SUMS."""
        rl, seed = self.config.rl, self.config.train.random_seed
        sums = dict.fromkeys(self.sum_keys, 0.0)
        kept = [r for r in self.records if len(r["prompt_ids"]) <= rl.max_prompt_len]
        sums["skipped"] = float(len(self.records) - len(kept))
        if not kept:
            return sums
        records = [{"messages": r["messages"], "answer": r["answer"], **dict(r.get("metadata") or {})} for r in kept]
        draws = [Draw(runner.sampling.greedy(), 1, lambda i, *more: None)]
        if self.num_samples:
            draws.append(Draw(runner.sampling, self.num_samples, lambda i, *more: eval_seed(seed, step, i, *more)))
        greedy, *sampled = answer(runner, records, [list(r["prompt_ids"]) for r in kept], draws, policy_version,
                                  self.config.train.eval_match)
        self.answers = [("greedy", greedy), *[("sampled", s) for s in sampled]]
        sums["prompts"] = float(len(kept))
        sums["correct"] = float(sum(greedy.correct))
        sums["greedy_reward"] = float(greedy.rewards.double().sum())
        shown = sampled[0] if sampled else greedy  # response length, truncation, tool use: the samples, else greedy
        sums["tokens"] = float(shown.num_tokens)
        sums["truncated"] = float(shown.num_truncated)
        sums["tool_episodes"] = float(sum(e.num_tool_calls > 0 for e in shown.episodes))
        if sampled:
            sums["samples"] = float(len(sampled[0].episodes))
            sums["sample_reward"] = float(sampled[0].rewards.double().sum())
            sums["sample_correct"] = float(sum(sampled[0].correct))
            n = self.num_samples  # a prompt's samples are contiguous
            per_prompt = [int(sum(sampled[0].correct[i:i + n])) for i in range(0, len(sampled[0].correct), n)]
            for k in self.config.train.eval_pass_k:
                sums[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in per_prompt)
        return sums


def summarise(t: dict[str, float], seconds: float, multi_turn: bool = False) -> dict[str, float]:
    """The ``eval/`` metrics from the sums over ranks."""
    prompts, samples = max(t["prompts"], 1.0), max(t["samples"], 1.0)
    completions = t["samples"] or t["prompts"]
    out = {"eval/accuracy": t["correct"] / prompts, "eval/greedy_reward_mean": t["greedy_reward"] / prompts}
    if t["samples"]:
        out.update({"eval/reward_mean": t["sample_reward"] / samples, "eval/sampled_accuracy": t["sample_correct"] / samples})
    out.update({"eval/response_length": t["tokens"] / max(completions, 1.0),
                "eval/truncated_fraction": t["truncated"] / max(completions, 1.0),
                "eval/num_prompts": t["prompts"], "eval/skipped_prompts": t["skipped"], "eval/seconds": seconds})
    if multi_turn:
        out["eval/tool_use_rate"] = t["tool_episodes"] / max(completions, 1.0)
    out.update({f"eval/{key}": value / prompts for key, value in t.items() if key.startswith("pass@")})
    return out
