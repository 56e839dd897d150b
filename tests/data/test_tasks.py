"""Synthetic tasks: correct answers, determinism, held-out eval, file formats the pipeline reads."""

from __future__ import annotations

import json
import random

import pytest

from astrai.data.tasks import (
    SCORERS,
    TASKS,
    corrupt,
    generate_items,
    make_item,
    score,
    score_final_number,
    write_task_files,
    write_tool_task_files,
)


def _solve(question: str) -> str:
    if question.startswith("reverse "):
        return question.split()[1][::-1]
    if question.startswith("sort "):
        return "".join(sorted(question.split()[1]))
    for op, fn in (("+", int.__add__), ("-", int.__sub__), ("*", int.__mul__)):
        if op in question:
            a, b = question.split(op)
            return str(fn(int(a), int(b)))
    raise AssertionError(question)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("digits", [1, 3])
def test_answers_are_correct(task, digits):
    rng = random.Random(0)
    for _ in range(50):
        item = make_item(task, digits, rng)
        assert item.answer == _solve(item.question)
        assert item.text == f"{item.question}={item.answer}"
        assert item.messages[-1] == {"role": "assistant", "content": item.answer}
        if task in ("add", "sub", "mul"):
            assert all(len(x) <= digits for x in item.question.replace("+", " ").replace("-", " ")
                       .replace("*", " ").split())


def test_score_and_corrupt():
    assert score(" 19\n", "19") == 1.0
    assert score("18", "19") == 0.0 and score("19 apples", "19") == 0.0 and score("", "19") == 0.0
    rng = random.Random(0)
    for item in generate_items(100, TASKS, digits=2, seed=3):
        wrong = corrupt(item, rng)
        assert score(wrong, item.answer) == 0.0


def test_deterministic_and_distinct():
    a = generate_items(200, ["add", "reverse"], digits=2, seed=7)
    b = generate_items(200, ["add", "reverse"], digits=2, seed=7)
    assert a == b and a != generate_items(200, ["add", "reverse"], digits=2, seed=8)
    assert len({it.question for it in a}) == 200


def test_bad_task_arguments():
    with pytest.raises(ValueError, match="unknown task 'div'"):
        make_item("div", 2, random.Random(0))
    with pytest.raises(ValueError, match="cannot draw 500 distinct problems"):
        generate_items(500, ["add"], digits=1)


def test_task_files(tmp_path):
    paths = write_task_files(tmp_path, num_train=40, num_eval=10, tasks=["add", "sort"], digits=2, seed=1)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    assert len(rows["sft"]) == len(rows["dpo"]) == len(rows["prompts"]) == 40 and len(rows["eval"]) == 10
    eval_questions = {r["messages"][0]["content"] for r in rows["eval"]}
    train_text = "\n".join(r["text"] for r in rows["corpus"])
    assert all(r["messages"][0]["content"] not in eval_questions for r in rows["sft"])
    assert all(f"\n{q}=" not in f"\n{train_text}" for q in eval_questions)
    assert sum(len(r["text"].splitlines()) for r in rows["corpus"]) == 160
    for dpo, rm, prompt in zip(rows["dpo"], rows["rm"], rows["prompts"]):
        assert dpo["chosen"][0]["content"] == prompt["answer"] != dpo["rejected"][0]["content"]
        assert rm["chosen"][0]["content"] == prompt["answer"] != rm["rejected"][0]["content"]
        assert prompt["metadata"]["task"] in ("add", "sort")
    # reward-model pairs also reject degenerate replies (empty, trailing text): what PPO finds otherwise
    assert any(r["rejected"][0]["content"] == "" for r in rows["rm"])
    assert any(r["rejected"][0]["content"].startswith(r["chosen"][0]["content"]) for r in rows["rm"])
    # ... and arithmetic answers far from the right one, not only near misses
    numbers = [(int(r["chosen"][0]["content"]), int(r["rejected"][0]["content"])) for r in rows["rm"]
               if r["rejected"][0]["content"].isdigit() and r["chosen"][0]["content"].isdigit()]
    assert any(abs(right - wrong) > 10 for right, wrong in numbers)
    again = write_task_files(tmp_path / "again", num_train=40, num_eval=10, tasks=["add", "sort"], seed=1)
    assert all(again[k].read_text() == paths[k].read_text() for k in paths)


def test_tool_task_files(tmp_path):
    """The calculator example's files: a tool_share of the SFT conversations call `multiply` and
    answer with its result, the rest answer at once; every one offers the tool; eval is held out."""
    paths = write_tool_task_files(tmp_path, num_traces=200, tool_share=0.3, num_prompts=300, num_eval=20,
                                  digits=2, seed=3)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in paths.items()}
    assert len(rows["sft"]) == 200 and len(rows["prompts"]) == 300 and len(rows["eval"]) == 20
    calling = [r for r in rows["sft"] if len(r["messages"]) == 4]
    direct = [r for r in rows["sft"] if len(r["messages"]) == 2]
    assert len(calling) + len(direct) == 200 and 40 <= len(calling) <= 80  # 60 expected
    assert all(r["tools"][0]["function"]["name"] == "multiply" for r in rows["sft"])
    for r in calling:
        user, call, result, answer = r["messages"]
        assert call["content"].startswith("<tool_call>") and result["role"] == "tool"
        assert result["content"] == answer["content"] == _solve(user["content"])
    assert all(r["messages"][1]["content"] == _solve(r["messages"][0]["content"]) for r in direct)
    eval_questions = {r["messages"][0]["content"] for r in rows["eval"]}
    train_questions = {r["messages"][0]["content"] for r in rows["sft"] + rows["prompts"]}
    assert not eval_questions & train_questions
    assert all(r["answer"] == _solve(r["messages"][0]["content"]) for r in rows["prompts"] + rows["eval"])
    again = write_tool_task_files(tmp_path / "again", num_traces=200, tool_share=0.3, num_prompts=300,
                                  num_eval=20, digits=2, seed=3)
    assert all(again[k].read_text() == paths[k].read_text() for k in paths)
    with pytest.raises(ValueError, match="tool_share must be in"):
        write_tool_task_files(tmp_path / "bad", tool_share=1.5)


@pytest.mark.parametrize("completion, answer, expected", [
    ("12", "12", 1.0), ("7 + 5 = 12.", "12", 1.0), ("The answer is 12", "12", 1.0), ("12.0", "12", 1.0),
    ("-3", "-3", 1.0), ("12 or maybe 13", "12", 0.0), ("no number", "12", 0.0), ("", "12", 0.0),
    ("dcba", "dcba", 0.0),  # a non-numeric answer never matches by number
])
def test_final_number_scores_the_last_number(completion, answer, expected):
    assert score_final_number(completion, answer) == expected
    assert SCORERS["final_number"] is score_final_number and SCORERS["exact"] is score
