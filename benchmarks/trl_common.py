"""What the TRL-side benchmarks share: step clocks and step memory, TRL's trainer configs and reward, and its timed generation.

`bench_rl.py` (step time on a fresh model) and `compare_trl.py` (step time, memory and accuracy
reached from an SFT'd model) run TRL's `GRPOTrainer`, `RLOOTrainer` and `DPOTrainer` on astrai's
records with the settings astrai's `OnlineLoop` and `Trainer` use; those settings are written
down once, here (`train_args` for what every TRL trainer shares, `rollout_args` for what the two
online ones share).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any


class StepClock:
    """Timestamps (wall, CPU) at each step end, plus the rollout seconds and tokens of each step."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = [(time.perf_counter(), time.process_time())]
        self.rollout_seconds: list[float] = []
        self.rollout_tokens: list[int] = []

    def start(self) -> None:
        self.stamps = [(time.perf_counter(), time.process_time())]

    def tick(self) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))

    @property
    def elapsed(self) -> float:
        return self.stamps[-1][0] - self.stamps[0][0]

    def summary(self) -> dict[str, float]:
        # the first step pays one-off costs (allocations, lazy inits) in both systems: skip it
        wall = [b[0] - a[0] for a, b in zip(self.stamps[1:], self.stamps[2:])]
        cpu = [b[1] - a[1] for a, b in zip(self.stamps[1:], self.stamps[2:])]
        roll_s, roll_t = self.rollout_seconds[1:], self.rollout_tokens[1:]
        out = {"step_s": statistics.median(wall) if wall else float("nan"),
               "cpu_s": statistics.median(cpu) if cpu else float("nan")}
        if self.rollout_seconds:
            out.update({"tokens_per_s": sum(roll_t) / max(sum(roll_s), 1e-9),
                        "rollout_share": sum(roll_s) / max(sum(wall), 1e-9),
                        "tokens_per_step": statistics.mean(roll_t) if roll_t else float("nan")})
            if roll_s:  # the rest of a step: log-probs, loss, backward, optimizer, bookkeeping
                out["rollout_s"] = statistics.mean(roll_s)
                out["train_s"] = out["step_s"] - out["rollout_s"]
        return out


def prompt_dataset(prompts: Path) -> Any:
    """astrai prompt records ({"messages", "answer"}) as TRL's conversational prompt dataset."""
    import datasets

    records = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    return datasets.Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in records])


def exact_match(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """astrai's `exact_match` reward in TRL's reward-function form."""
    from astrai.data.tasks import score

    # conversational prompts give conversational completions: [{"role": "assistant", "content": ...}]
    return [score(c[0]["content"] if isinstance(c, list) else c, a) for c, a in zip(completions, answer)]


def train_args(out: Path, *, steps: int, lr: float, warmup_steps: int = 0, seed: int = 0,
               checkpointing: bool = False) -> dict[str, Any]:
    """TrainingArguments every TRL trainer here shares, matching astrai's defaults: CPU fp32, AdamW
    (0.9, 0.95) without weight decay at a constant rate after linear warmup, clipping at 1.0, one
    micro-batch per step, no activation checkpointing unless `checkpointing` (TRL turns it on by
    default, astrai's `gradient_checkpointing` is off), no saves, no logging in the timed steps."""
    return {
        "output_dir": str(out), "use_cpu": True, "bf16": False, "seed": seed, "report_to": "none",
        "save_strategy": "no", "logging_steps": max(steps, 1), "disable_tqdm": True, "max_steps": steps,
        "learning_rate": lr, "lr_scheduler_type": "constant_with_warmup" if warmup_steps else "constant",
        "warmup_steps": warmup_steps, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
        "max_grad_norm": 1.0, "gradient_accumulation_steps": 1, "dataloader_num_workers": 0,
        _checkpointing_field(): checkpointing,
    }


def _checkpointing_field() -> str:
    """transformers renamed `gradient_checkpointing` to `activation_checkpointing` (5.2x); the
    peer runs with whichever this install has (a GPU image may hold an older one)."""
    from dataclasses import fields

    from transformers import TrainingArguments

    names = {f.name for f in fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def rollout_args(*, prompts: int, group_size: int, max_tokens: int) -> dict[str, Any]:
    """What GRPOConfig and RLOOConfig share, matching astrai's online loop: `prompts` x `group_size`
    completions per step at temperature 1 without top-k/top-p, beta (KL) 0 so no reference model,
    PPO clip 0.2, one optimizer step per generation (so the ratio is 1 and the clip idle), no dropout."""
    return dict(
        per_device_train_batch_size=prompts * group_size, num_generations=group_size,
        max_completion_length=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, num_iterations=1, disable_dropout=True,
    )


def grpo_config(out: Path, *, steps: int, prompts: int, group_size: int, max_tokens: int, lr: float,
                warmup_steps: int = 0, seed: int = 0, checkpointing: bool = False, min_tokens: int = 0) -> Any:
    """TRL's GRPOConfig matching astrai's `online_grpo`: `train_args` and `rollout_args`, token-mean
    loss (`dapo`), group-std advantages (astrai's `scale_rewards: group`). `min_tokens` > 0 forbids
    the end tokens before that many new tokens (`min_new_tokens`, as astrai's `min_tokens`)."""
    from trl import GRPOConfig

    extra = {"generation_kwargs": {"min_new_tokens": min_tokens}} if min_tokens else {}
    return GRPOConfig(**train_args(out, steps=steps, lr=lr, warmup_steps=warmup_steps, seed=seed,
                                   checkpointing=checkpointing),
                      **rollout_args(prompts=prompts, group_size=group_size, max_tokens=max_tokens),
                      loss_type="dapo", scale_rewards="group", **extra)


def rloo_config(out: Path, *, steps: int, prompts: int, group_size: int, max_tokens: int, lr: float,
                warmup_steps: int = 0, seed: int = 0) -> Any:
    """TRL's RLOOConfig matching astrai's `online_grpo` with `advantage_estimator: rloo`: `train_args`
    and `rollout_args`, leave-one-out advantages r_i - mean_{j != i} r_j without normalisation
    (`normalize_advantages=False`, astrai's RLOO has no std scaling).

    What stays different: RLOOConfig has no `loss_type`. TRL's RLOO loss is per sequence (the
    ratio is exp of the summed token log-ratio, the loss the mean over sequences), so each token
    weighs 1/num_sequences; astrai's `token_mean` weighs each 1/num_tokens. On-policy (ratio 1)
    the gradients point the same way and differ in scale by the mean completion length, which
    AdamW mostly absorbs (clipping at 1.0 does not). TRL's RLOO also runs one extra no-grad forward
    per step for the old log-probs, where its GRPO skips it at one step per generation."""
    from trl import RLOOConfig

    return RLOOConfig(**train_args(out, steps=steps, lr=lr, warmup_steps=warmup_steps, seed=seed),
                      **rollout_args(prompts=prompts, group_size=group_size, max_tokens=max_tokens),
                      normalize_advantages=False)


def dpo_config(out: Path, *, steps: int, pairs: int, lr: float, warmup_steps: int = 0, seed: int = 0,
               max_length: int = 32) -> Any:
    """TRL's DPOConfig matching astrai's `dpo`: `train_args`, `pairs` pairs per step, beta 0.1,
    sigmoid loss, pairs cut at `max_length` tokens (astrai's `max_seq_len`)."""
    from trl import DPOConfig

    return DPOConfig(**train_args(out, steps=steps, lr=lr, warmup_steps=warmup_steps, seed=seed),
                     per_device_train_batch_size=pairs, beta=0.1, loss_type="sigmoid", max_length=max_length)


def time_generation(trainer: Any, clock: StepClock) -> None:
    """Time TRL's generation call (`_generate_single_turn`) like astrai's `LLMEngine.run_batch`.
    GRPOTrainer's returns (completion_ids, logprobs), RLOOTrainer's the completion_ids alone."""
    generate = trainer._generate_single_turn

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = generate(*a, **k)
        clock.rollout_seconds.append(time.perf_counter() - start)
        completion_ids = out[0] if isinstance(out, tuple) else out
        clock.rollout_tokens.append(sum(len(c) for c in completion_ids))
        return out

    trainer._generate_single_turn = timed_generate


def current_rss_mb() -> float:
    """This process's resident memory now (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field} line")


class StepMemory:
    """Peak resident memory of the training steps alone: `start` (at train begin, model and
    optimizer loaded) resets the kernel's high-water mark (writing 5 to /proc/self/clear_refs,
    Linux >= 4.0) and records the RSS then; `tick` (at each step end) reads the high-water mark,
    so what loading peaked at, or a save after the last step, is not counted. Where the reset is
    refused, the peak falls back to the process's whole-life `ru_maxrss`."""

    def __init__(self) -> None:
        self.base_mb = self.peak_mb = 0.0
        self.reset_ok = False

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False
        self.base_mb = current_rss_mb()

    def tick(self) -> None:
        peak = _status_mb("VmHWM") if self.reset_ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.peak_mb = max(self.peak_mb, peak)

    def summary(self) -> dict[str, float]:
        return {"peak_rss_mb": self.peak_mb, "step_rss_mb": self.peak_mb - self.base_mb, "load_rss_mb": self.base_mb}
