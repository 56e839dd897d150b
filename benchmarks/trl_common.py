"""What the TRL-side benchmarks share: step clocks, TRL's GRPO config and reward, and its timed generation.

`bench_rl.py` (step time on a fresh model) and `compare_trl.py` (step time, memory and accuracy
reached from an SFT'd model) run TRL's `GRPOTrainer` on astrai's prompt records with the
settings astrai's `OnlineLoop` uses; those settings are written down once, here.
"""

from __future__ import annotations

import json
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


def grpo_config(out: Path, *, steps: int, prompts: int, group_size: int, max_tokens: int, lr: float,
                warmup_steps: int = 0, seed: int = 0) -> Any:
    """TRL's GRPOConfig matching astrai's online_grpo settings: temperature 1 without top-k/top-p,
    AdamW (0.9, 0.95) at a constant rate after linear warmup, clipping at 1.0, beta (KL) 0, PPO clip
    0.2, token-mean loss (`dapo`), group-std advantages, one optimizer step per generation, fp32."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, seed=seed, report_to="none", save_strategy="no",
        logging_steps=max(steps, 1), disable_tqdm=True, max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant_with_warmup" if warmup_steps else "constant", warmup_steps=warmup_steps,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        per_device_train_batch_size=prompts * group_size, gradient_accumulation_steps=1,
        num_generations=group_size, max_completion_length=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", num_iterations=1,
        dataloader_num_workers=0, disable_dropout=True,
    )


def time_generation(trainer: Any, clock: StepClock) -> None:
    """Time TRL's generation call (`_generate_single_turn`) like astrai's `LLMEngine.run_batch`."""
    generate = trainer._generate_single_turn

    def timed_generate(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        completion_ids, logprobs = generate(*a, **k)
        clock.rollout_seconds.append(time.perf_counter() - start)
        clock.rollout_tokens.append(sum(len(c) for c in completion_ids))
        return completion_ids, logprobs

    trainer._generate_single_turn = timed_generate
