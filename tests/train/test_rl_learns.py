"""Online RL learns: GRPO, online DPO and PPO, through `astrai train`, on the arithmetic task.

A tiny model (2 layers, hidden 64) is SFT'd from scratch for 250 steps on 1-digit addition
chats (`astrai.data.tasks`); every test starts from that model (one module-scoped fixture) and
trains on the training prompts only. Held-out problems (the 40 sums of the 100 that no training
file holds) are scored two ways: greedy exact match (40 problems, steps of 2.5 points) and
*sampled* accuracy, 16 temperature-1 samples per problem with a fixed sampling seed (640
answers), which moves with the model's probability of the right answer rather than with a few
sums flipping.

Seeded runs take another path on another CPU (float rounding acts like another seed), so the
assertions rest on a spread measured across SEED 0-4 (SFT and RL seed alike) x 1 and 2 threads
(10 runs; 2 threads changed little on the dev machine). The tests run at SEED 0, THREADS 1.
Reward gain is `(last - first) / (1 - first)`, first and last the mean rollout reward of the
first and last 10 steps: the share of the room left that RL closed (the start varies, 0.23-0.70).
  SFT'd model:        greedy held-out 5.0% / 45% / 72.5% (min / mean / max), sampled 8.1% / 32.5%
                      / 45.9%; first rollout reward 0.23 / 0.51 / 0.70. A greedy held-out band
                      would fail at seed 1 (5.0%), so the start is checked on the reward.
  GRPO (150 steps):   reward gain 0.37 / 0.45 / 0.52 (raw +0.155 / +0.215 / +0.294); sampled
                      held-out +0.045 / +0.100 / +0.134; greedy held-out -10 / +4 / +10 points
                      (not asserted: at seed 2 it falls 72.5% -> 62.5% while sampled rises +0.098).
                      With max_lr 0: reward 0.469 -> 0.508 (gain 0.07), sampled held-out +0.000.
  online DPO (120 steps, lr 5e-4): reward gain 0.21 / 0.27 / 0.36 (raw +0.068 / +0.128 / +0.245),
                      seeds 0-4 at one thread, 0-2 at two (the same values); with max_lr 0 0.005.
  PPO (100 steps):    reward gain 0.27 / 0.33 / 0.37 (raw +0.110 / +0.150 / +0.241); explained
                      variance, mean of the last 10 steps, 0.27 / 0.32 / 0.40 (0 at the first step,
                      the head is zero); sampled held-out -0.009 / +0.066 / +0.122 and greedy
                      -10 / +2 / +10 points (neither asserted).
  GRPO with advantage_estimator rloo (150 steps, as GRPO): reward gain 0.33 / 0.46 / 0.52.
  GRPO with importance_sampling_level sequence (GSPO, 150 steps): reward gain 0.30 / 0.39 / 0.50.
                      Both at seeds 0-4 at one thread; with max_lr 0 the reward gains 0.087.
                      These two spreads are measured on the chunked lm head and packed rollout
                      micro-batches, the others on the rounding before them (the tests pass at
                      seed 0 on the current path; the earlier figures: docs/performance.md).
Margins, each about half the measured minimum and clear of the lr-0 run: GRPO reward gain 0.2
and sampled held-out +0.02; RLOO reward gain 0.16; GSPO reward gain 0.15; DPO reward gain 0.1;
PPO reward gain 0.15 and explained variance 0.15. About 150 s for the file at one thread on 2
idle cores. Large rollouts and a moderate learning rate matter: with 16 prompts per step, or a learning rate of 1e-3, the reward wanders instead of
rising; and the model partly memorises the 60 training sums, which is why greedy held-out
accuracy is no learning signal here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

import pytest
import torch
import yaml

from astrai.cli import main as astrai_main
from astrai.data.tasks import write_task_files
from astrai.data.tokenizer_training import train_tokenizer
from astrai.eval import SCORERS, evaluate_model, read_prompt_records
from astrai.train.publish import latest_checkpoint

pytestmark = pytest.mark.slow

SEED, THREADS = 0, 1  # the spread above was measured at SEED 0-4 x THREADS 1-2
MODEL = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": True}
RL = ["--batch_per_device", 64, "--group_size", 8, "--rollout_max_tokens", 8, "--max_prompt_len", 32,
      "--schedule", "constant", "--warmup_steps", 5, "--random_seed", SEED]
GRPO_REWARD_GAIN, GRPO_SAMPLED_HELD_OUT_GAIN = 0.2, 0.02
RLOO_REWARD_GAIN, GSPO_REWARD_GAIN = 0.16, 0.15
DPO_STEPS, DPO_REWARD_GAIN = 120, 0.1
PPO_STEPS, PPO_REWARD_GAIN, PPO_EXPLAINED_VARIANCE = 100, 0.15, 0.15
START_REWARD = (0.1, 0.85)  # the SFT'd model is right sometimes, wrong often: GRPO groups carry signal


@dataclass
class Task:
    prompts: Path
    eval_path: Path
    tokenizer: Path
    model: Path  # the SFT'd model (a checkpoint directory)
    accuracy: float  # its greedy held-out accuracy
    sampled: float  # its sampled held-out accuracy


def train(run_dir: Path, *flags) -> Path:
    """`astrai train` in-process; returns the final checkpoint directory."""
    args = [*flags, "--ckpt_dir", run_dir / "ckpt", "--log_dir", run_dir, "--ckpt_interval", 0, "--keep_last", 1,
            "--progress", "false", "--device", "cpu", "--n_epoch", 1000]
    assert astrai_main(["train", *map(str, args)]) == 0
    ckpt = latest_checkpoint(run_dir / "ckpt")
    assert ckpt is not None
    return ckpt


def accuracy(model_dir: Path, eval_path: Path) -> float:
    from astrai.infer.llm import LLM

    return evaluate_model(LLM(str(model_dir)), read_prompt_records(eval_path), max_tokens=8).accuracy


def sampled_accuracy(model_dir: Path, eval_path: Path, n: int = 16) -> float:
    """Exact match over `n` temperature-1 samples per problem, seeded per request: the expected
    accuracy, far finer than 40 greedy answers."""
    from astrai.infer.llm import LLM
    from astrai.infer.sampling import SamplingParams

    records = read_prompt_records(eval_path)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=n, seed=1234)
    outputs = LLM(str(model_dir)).chat([r["messages"] for r in records], params)
    right = [SCORERS["exact"](c.text, r["answer"]) for r, out in zip(records, outputs) for c in out.outputs]
    return sum(right) / len(right)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def reward_gain(rows: list[dict], name: str) -> float:
    """Share of the room left (1 - first) that the rollout reward closed, first and last 10 steps."""
    r = [m["reward_mean"] for m in rows if "reward_mean" in m]
    first, last = mean(r[:10]), mean(r[-10:])
    lo, hi = START_REWARD
    assert lo <= first <= hi, f"{name}: the SFT'd model's first rollout reward {first:.2f} leaves no room to learn"
    gain = (last - first) / (1 - first)
    print(f"{name} rollout reward {first:.3f} -> {last:.3f} (gain {gain:.3f} of the room left)")
    return gain


@pytest.fixture(scope="module", autouse=True)
def threads():
    # two threads on two shared, busy cores run these small matmuls several times slower
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    root = tmp_path_factory.mktemp("rl_learns")
    files = write_task_files(root / "data", num_train=2000, num_eval=40, tasks=("add",), digits=1, seed=0)
    texts = [json.loads(line)["text"] for line in files["corpus"].read_text().splitlines()]
    train_tokenizer(texts + ["user assistant system"] * 5, MODEL["vocab_size"], root / "tok")
    config = root / "sft.yaml"
    config.write_text(yaml.safe_dump({"model": MODEL}))
    model = train(root / "sft", "--config", config, "--train_type", "sft", "--data_path", files["sft"],
                  "--tokenizer_path", root / "tok", "--max_seq_len", 32, "--batch_per_device", 32,
                  "--max_steps", 250, "--max_lr", 3e-3, "--warmup_ratio", 0.05, "--random_seed", SEED)
    return Task(files["prompts"], files["eval"], root / "tok", model, accuracy(model, files["eval"]),
                sampled_accuracy(model, files["eval"]))


def test_online_grpo_raises_reward_and_held_out_accuracy(task, tmp_path):
    run = tmp_path / "grpo"
    model = train(run, "--train_type", "online_grpo", "--data_path", task.prompts, "--tokenizer_path", task.tokenizer,
                  "--param_path", task.model, "--max_steps", 150, "--rollout_interval", 2, "--max_lr", 5e-4, *RL)
    rows = metrics(run)
    assert len([m for m in rows if "reward_mean" in m]) == 150
    gain = reward_gain(rows, "GRPO")
    greedy, sampled = accuracy(model, task.eval_path), sampled_accuracy(model, task.eval_path)
    print(f"GRPO held-out accuracy: greedy {task.accuracy:.3f} -> {greedy:.3f}, sampled {task.sampled:.3f} -> {sampled:.3f}")
    assert gain >= GRPO_REWARD_GAIN, f"GRPO closed {gain:.2f} of the reward room left, expected {GRPO_REWARD_GAIN}"
    assert sampled >= task.sampled + GRPO_SAMPLED_HELD_OUT_GAIN, \
        f"GRPO sampled held-out accuracy went {task.sampled:.1%} -> {sampled:.1%}, expected +{GRPO_SAMPLED_HELD_OUT_GAIN:.0%}"


def test_online_grpo_with_async_steps_learns_within_the_synchronous_spread(task, tmp_path):
    """async_steps 1 (each rollout drawn by the weights one rollout behind, rl/pipeline.py) on the
    GRPO run above: the same margins, which sit at about half the synchronous runs' minimum (module
    docstring). Measured at seeds 0-2, one thread (min / mean / max): reward gain 0.37 / 0.43 / 0.49
    and sampled held-out +0.041 / +0.083 / +0.127, against the synchronous runs' 0.42 / 0.46 / 0.49
    and +0.102 / +0.126 / +0.164 at the same seeds: within the synchronous spread above (0.37-0.52,
    +0.045-+0.134) but for seed 2's sampled gain, 0.004 under it; the lag costs a little per step."""
    run = tmp_path / "grpo_async"
    model = train(run, "--train_type", "online_grpo", "--data_path", task.prompts, "--tokenizer_path", task.tokenizer,
                  "--param_path", task.model, "--max_steps", 150, "--rollout_interval", 2, "--max_lr", 5e-4, *RL,
                  "--async_steps", 1)
    rows = metrics(run)
    assert [m["policy_lag"] for m in rows[:4]] == [0, 1, 2, 3]  # a rollout 2 steps long, drawn one rollout behind
    gain = reward_gain(rows, "GRPO async_steps 1")
    sampled = sampled_accuracy(model, task.eval_path)
    print(f"GRPO async_steps 1 sampled held-out accuracy {task.sampled:.3f} -> {sampled:.3f}")
    assert gain >= GRPO_REWARD_GAIN, f"async GRPO closed {gain:.2f} of the reward room left, expected {GRPO_REWARD_GAIN}"
    assert sampled >= task.sampled + GRPO_SAMPLED_HELD_OUT_GAIN, \
        f"async GRPO sampled held-out accuracy went {task.sampled:.1%} -> {sampled:.1%}"


@pytest.mark.parametrize("name, flags, margin", [
    ("RLOO", ["--advantage_estimator", "rloo"], RLOO_REWARD_GAIN),
    ("GSPO", ["--importance_sampling_level", "sequence"], GSPO_REWARD_GAIN),
])
def test_grpo_variants_raise_reward(task, tmp_path, name, flags, margin):
    run = tmp_path / name
    train(run, "--train_type", "online_grpo", "--data_path", task.prompts, "--tokenizer_path", task.tokenizer,
          "--param_path", task.model, "--max_steps", 150, "--rollout_interval", 2, "--max_lr", 5e-4, *RL, *flags)
    rows = metrics(run)
    assert len([m for m in rows if "reward_mean" in m]) == 150
    gain = reward_gain(rows, name)
    assert gain >= margin, f"{name} closed {gain:.2f} of the reward room left, expected {margin}"


def test_online_dpo_raises_reward(task, tmp_path):
    run = tmp_path / "dpo"
    train(run, "--train_type", "online_dpo", "--data_path", task.prompts, "--tokenizer_path", task.tokenizer,
          "--param_path", task.model, "--max_steps", DPO_STEPS, "--group_size", 4, "--max_lr", 5e-4, *RL)
    rows = metrics(run)
    assert len([m for m in rows if "reward_mean" in m]) == DPO_STEPS
    gain = reward_gain(rows, "online DPO")
    assert gain >= DPO_REWARD_GAIN, f"online DPO closed {gain:.2f} of the reward room left, expected {DPO_REWARD_GAIN}"


def test_online_ppo_raises_reward_and_the_critic_explains_returns(task, tmp_path):
    run = tmp_path / "ppo"
    model = train(run, "--train_type", "online_ppo", "--data_path", task.prompts, "--tokenizer_path", task.tokenizer,
                  "--param_path", task.model, "--max_steps", PPO_STEPS, "--group_size", 4, "--max_lr", 5e-4,
                  "--critic_lr", 1e-3, "--rollout_interval", 2, *RL)
    rows = metrics(run)
    gain = reward_gain(rows, "PPO")
    ev = [m["explained_variance"] for m in rows if "explained_variance" in m]
    print(f"PPO explained variance {ev[0]:.3f} -> {mean(ev[-10:]):.3f} (mean of the last 10 steps)")
    print(f"PPO held-out accuracy: greedy {task.accuracy:.3f} -> {accuracy(model, task.eval_path):.3f}, "
          f"sampled {task.sampled:.3f} -> {sampled_accuracy(model, task.eval_path):.3f} (not asserted: see above)")
    assert ev[0] <= 0.0 + 1e-6  # the zero-initialised head explains nothing at first
    assert mean(ev[-10:]) >= PPO_EXPLAINED_VARIANCE, f"the critic explains little of the returns: {ev[-10:]}"
    assert gain >= PPO_REWARD_GAIN, f"PPO closed {gain:.2f} of the reward room left, expected {PPO_REWARD_GAIN}"
