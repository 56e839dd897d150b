"""TRL-style reward functions run unchanged: TRL's own `trl.rewards` functions and user ones in its convention.

A `module:function` whose signature names `completions` (or `prompts`, `completion_ids`) is called
once per rollout with keyword lists, as TRL's GRPOTrainer calls it: chat prompts as their messages
and one assistant message per completion, the completion token ids, and every other prompt-record
column (`answer`, `solution`, ...). `None` is no score: it adds 0 and is counted in `<name>_none`.
`async def` functions are awaited concurrently; the per-sample signature keeps working.
"""

from __future__ import annotations

import asyncio

import pytest

from astrai.config import RLConfig
from astrai.train.cli import main
from astrai.train.rl.rewards import RewardSet
from tests.train.resume_data import read_metrics, write_tokenizer
from tests.train.rl_runs import write_rl_run

THINK = "trl.rewards:think_format_reward"
ACCURACY = "trl.rewards:accuracy_reward"
CALLS: list[dict] = []


def chat(question: str, **columns) -> dict:
    return {"messages": [{"role": "user", "content": question}], "answer": None, **columns}


def score(names: list[str], completions: list[str], records: list[dict], weights: list[float] | None = None):
    rewards = RewardSet(RLConfig(rewards=names, reward_weights=weights))
    ids = [[7] * (i + 1) for i in range(len(completions))]
    return rewards(["p"] * len(completions), completions, records, [[1, *c] for c in ids], 1, completion_ids=ids)


def recording(prompts, completions, completion_ids, solution, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "solution": solution, **kwargs})
    return [None if s is None else float(len(c)) for s, c in zip(solution, completion_ids)]


def only_completions(completions):  # no **kwargs: given just what it names
    return [1.0] * len(completions)


def per_sample(prompt, completion, record):
    return 0.5


def test_trl_think_format_reward_runs_unchanged_on_chat_prompts():
    completions = ["<think>\nadd the tens\n</think>\n42", "42", "<think>unclosed 42", "<think>a</think><think>b</think>"]
    total, terms = score([THINK], completions, [chat("what is 40 + 2?")] * 4)
    assert terms[THINK].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert total.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert terms[f"{THINK}_none"].tolist() == [0.0] * 4


def test_trl_accuracy_reward_reads_the_solution_column_and_none_adds_zero_and_is_counted():
    pytest.importorskip("math_verify")
    records = [chat("1/3?", solution=r"$\frac{1}{3}$"), chat("1/3?", solution=r"$\frac{1}{3}$"),
               chat("?", solution="no maths here")]  # an unparseable gold solution: TRL's None
    completions = [r"so it is \boxed{\frac{1}{3}}", r"so it is \boxed{\frac{1}{2}}", r"\boxed{1}"]
    total, terms = score([ACCURACY, THINK], completions, records, weights=[2.0, 1.0])
    assert terms[ACCURACY].tolist() == [1.0, 0.0, 0.0]
    assert terms[f"{ACCURACY}_none"].tolist() == [0.0, 0.0, 1.0]
    assert total.tolist() == [2.0, 0.0, 0.0]


def test_the_arguments_are_trls_prompts_completions_ids_and_every_record_column():
    CALLS.clear()
    records = [chat("q0", solution="a", level=1), chat("q1", solution=None, level=2)]
    total, terms = score(["tests.train.test_trl_rewards:recording", "tests.train.test_trl_rewards:per_sample"],
                         ["c0", "c1"], records)
    assert len(CALLS) == 1  # once per rollout, not per sample
    call = CALLS[0]
    assert call["prompts"] == [r["messages"] for r in records]
    assert call["completions"] == [[{"role": "assistant", "content": "c0"}], [{"role": "assistant", "content": "c1"}]]
    assert call["completion_ids"] == [[7], [7, 7]]
    assert call["solution"] == ["a", None] and call["level"] == [1, 2] and call["answer"] == [None, None]
    assert "messages" not in call
    name = "tests.train.test_trl_rewards:recording"
    assert terms[name].tolist() == [1.0, 0.0] and terms[f"{name}_none"].tolist() == [0.0, 1.0]
    assert total.tolist() == [1.5, 0.5]  # the per-sample function still adds its 0.5; the None adds 0
    assert "tests.train.test_trl_rewards:per_sample_none" not in terms  # the old form returns no None


def test_records_without_messages_give_plain_strings_and_a_missing_column_names_itself():
    CALLS.clear()
    _, terms = score(["tests.train.test_trl_rewards:recording", "tests.train.test_trl_rewards:only_completions"],
                     ["c0"], [{"solution": "s"}])
    assert CALLS[0]["prompts"] == ["p"] and CALLS[0]["completions"] == ["c0"]
    assert terms["tests.train.test_trl_rewards:only_completions"].tolist() == [1.0]
    with pytest.raises(ValueError, match=r"needs the column 'solution' in every prompt record.*have answer, level"):
        score(["tests.train.test_trl_rewards:recording"], ["c0"], [chat("q", level=1)])
    with pytest.raises(ValueError, match="pass completion_ids="):
        RewardSet(RLConfig(rewards=[THINK]))(["p"], ["c"], [chat("q")], [[1]], 1)


BARRIER: asyncio.Barrier | None = None


async def judge_a(completions, **kwargs):
    await asyncio.wait_for(BARRIER.wait(), 60)  # passes only while judge_b waits too: run together
    return [1.0] * len(completions)


async def judge_b(completions, **kwargs):
    await asyncio.wait_for(BARRIER.wait(), 60)
    return [None] * len(completions)


async def judge_per_sample(prompt, completion, record):
    await asyncio.wait_for(BARRIER.wait(), 60)
    return 0.25


def test_async_reward_functions_are_awaited_concurrently():
    global BARRIER
    BARRIER = asyncio.Barrier(4)  # both batched judges and the two samples of the per-sample one
    mod = "tests.train.test_trl_rewards:"
    total, terms = score([mod + "judge_a", mod + "judge_b", mod + "judge_per_sample"], ["x", "y"], [chat("q")] * 2)
    assert total.tolist() == [1.25, 1.25]
    assert terms[mod + "judge_b_none"].tolist() == [1.0, 1.0]


def test_online_grpo_runs_trl_rewards_with_the_rollouts_columns_and_token_ids(tmp_path):
    """`--rewards trl.rewards:think_format_reward,trl.rewards:accuracy_reward` on prompts with a
    `solution` column; a recording reward sees TRL's arguments, its completion ids the sampled ones."""
    pytest.importorskip("math_verify")
    CALLS.clear()
    tok_dir = write_tokenizer(tmp_path / "tok")
    records = [{"messages": [{"role": "user", "content": f"what is {i} + 1?"}], "solution": f"${i + 1}$"}
               for i in range(4)]
    config = write_rl_run(tmp_path / "run", tok_dir, num_prompts=4, records=records)
    rec = "tests.train.test_trl_rewards:recording"
    assert main(["--config", str(config), "--max_steps", "1", "--rewards", f"{THINK},{ACCURACY},{rec}"]) == 0
    (metrics,) = read_metrics(tmp_path / "run")
    for name in (THINK, ACCURACY):
        assert 0.0 <= metrics[f"rewards/{name}"] <= 1.0
        assert metrics[f"rewards/{name}_none"] == 0.0  # every solution parsed: the column reached it
    (call,) = CALLS  # one rollout of 4 prompts x group_size 4
    assert len(call["completions"]) == 16 and sorted(set(call["solution"])) == ["$1$", "$2$", "$3$", "$4$"]
    for prompt, solution in zip(call["prompts"], call["solution"]):  # each sample with its own prompt's column
        assert prompt == records[int(solution.strip("$")) - 1]["messages"]
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in call["completions"])
    # the recording reward scores each completion by its number of ids: the sampled response lengths
    assert metrics[f"rewards/{rec}"] == pytest.approx(metrics["response_length_mean"])
