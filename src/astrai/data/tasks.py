"""Synthetic verifiable tasks: arithmetic and letter puzzles with exact reference answers.

These feed the demo, the tests and the RL reward functions. Each problem has a short question
("12+7", "reverse abcd") and an answer ("19", "dcba"). The same problems appear in two forms:
plain-text equations ("12+7=19") for a pre-training corpus, and ChatML chats whose assistant
reply is just the answer for SFT, DPO (correct vs corrupted answer) and RL prompts. A model
pre-trained on the text form learns the chat form quickly in SFT, which makes the accuracy
jump measured by `score` easy to see. Everything is deterministic given a seed.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.data.tool_calls import function_schema

TASKS = ("add", "sub", "mul", "reverse", "sort")
_OPERATORS = {"add": "+", "sub": "-", "mul": "*"}


@dataclass(frozen=True)
class TaskItem:
    """One problem: its question text, reference answer and metadata (task, digits)."""

    task: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """Plain-text form for the pre-training corpus, e.g. "12+7=19"."""
        return f"{self.question}={self.answer}"

    @property
    def prompt_messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}]

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.prompt_messages + [{"role": "assistant", "content": self.answer}]


def _number(rng: random.Random, digits: int) -> int:
    # Up to `digits` digits, so small numbers appear too and carries are well mixed.
    return rng.randrange(0, 10**digits)


def make_item(task: str, digits: int, rng: random.Random) -> TaskItem:
    """Draw one problem of `task`; `digits` is the operand size (letters for string tasks)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    meta = {"task": task, "digits": digits}
    if task in _OPERATORS:
        a, b = _number(rng, digits), _number(rng, digits)
        if task == "sub" and a < b:  # keep answers non-negative: one less thing to learn
            a, b = b, a
        value = {"add": a + b, "sub": a - b, "mul": a * b}[task]
        return TaskItem(task, f"{a}{_OPERATORS[task]}{b}", str(value), meta)
    if task in ("reverse", "sort"):
        letters = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, digits + 2)))
        answer = letters[::-1] if task == "reverse" else "".join(sorted(letters))
        return TaskItem(task, f"{task} {letters}", answer, meta)
    raise ValueError(f"unknown task '{task}'; expected one of {', '.join(TASKS)}")


def generate_items(num: int, tasks: Iterable[str] = ("add",), digits: int = 2, seed: int = 0,
                   exclude: Iterable[str] = ()) -> list[TaskItem]:
    """`num` distinct problems cycling through `tasks`, none whose question is in `exclude`."""
    tasks = list(tasks)
    rng = random.Random(seed)
    seen = set(exclude)
    items: list[TaskItem] = []
    attempts = 0
    while len(items) < num:
        item = make_item(tasks[len(items) % len(tasks)], digits, rng)
        attempts += 1
        if attempts > 50 * num + 1000:
            raise ValueError(f"cannot draw {num} distinct problems of {tasks} with digits={digits}; "
                             "raise digits or ask for fewer items")
        if item.question in seen:
            continue
        seen.add(item.question)
        items.append(item)
    return items


def score(completion: str, answer: str) -> float:
    """1.0 when the completion is exactly the answer (ignoring surrounding whitespace), else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score_final_number(completion: str, answer: str) -> float:
    """1.0 when the last number in the completion equals the numeric answer ("7 + 5 = 12." for "12"),
    else 0.0: the verifier for chat models that answer in sentences. Non-numeric answers never match."""
    found = _NUMBER.findall(completion)
    try:
        return 1.0 if found and float(found[-1]) == float(str(answer).strip()) else 0.0
    except ValueError:
        return 0.0


# `astrai eval --match` and the rewards of the same names
SCORERS = {"exact": score, "final_number": score_final_number}


def score_completions(completions: list[str], answers: list[Any], match: str = "exact") -> list[float]:
    """Each completion against its answer by ``SCORERS[match]``: the one scoring of exact-match
    evaluation (``astrai eval --data``) and of evaluation during training."""
    scorer = SCORERS[match]
    return [scorer(c, a) for c, a in zip(completions, answers)]


def no_answers_warning(answers: list[Any], source: str) -> str | None:
    """The warning for records none of whose answers can be scored (every one empty, blank or
    null): evaluation would report 0 (or a match of empty replies) and mean nothing. None when
    some answer is there. Said by ``astrai eval --data`` and by evaluation during training."""
    if any(a is not None and str(a).strip() for a in answers):
        return None
    return (f"warning: every 'answer' of the {len(answers)} records of {source} is empty or null, so no reply can "
            "be scored; give each record its reference answer")


def corrupt(item: TaskItem, rng: random.Random) -> str:
    """A plausible wrong answer (for DPO rejected replies): off by a little, or letters swapped."""
    if item.task in _OPERATORS:
        value = int(item.answer)
        wrong = value + rng.choice([-10, -2, -1, 1, 2, 10])
        return str(wrong if wrong >= 0 else value + 1)
    letters = list(item.answer)
    if len(set(letters)) == 1:
        return item.answer + letters[0]
    while "".join(letters) == item.answer:
        i, j = rng.sample(range(len(letters)), 2)
        letters[i], letters[j] = letters[j], letters[i]
    return "".join(letters)


def degenerate(item: TaskItem, rng: random.Random) -> str:
    """A malformed reply that a policy drifts to under a learned reward (for reward-model rejected
    replies): empty, the answer with more after it, the question echoed, or a stray symbol."""
    return rng.choice(["", item.answer + item.answer, item.answer + "=", item.question, rng.choice("+-=")])


def _write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def corpus_records(items: list[TaskItem], per_doc: int = 8) -> list[dict[str, str]]:
    """Pre-training documents of `per_doc` equations, one per line: {"text": "12+7=19\\n3+4=7"}."""
    return [{"text": "\n".join(it.text for it in items[i:i + per_doc])} for i in range(0, len(items), per_doc)]


def sft_record(item: TaskItem) -> dict[str, Any]:
    return {"messages": item.messages}


def dpo_record(item: TaskItem, rng: random.Random) -> dict[str, Any]:
    # TRL's conversational preference format: prompt messages, chosen/rejected assistant turns.
    return {"prompt": item.prompt_messages,
            "chosen": [{"role": "assistant", "content": item.answer}],
            "rejected": [{"role": "assistant", "content": corrupt(item, rng)}]}


def any_wrong_number(item: TaskItem, rng: random.Random) -> str:
    """A wrong answer drawn uniformly from every number the task's answers range over (0 to the
    largest sum, difference or product of `digits`-digit operands): what a policy can reply."""
    top = 10 ** item.metadata["digits"] - 1
    largest = {"add": 2 * top, "sub": top, "mul": top * top}[item.task]
    wrong = rng.randrange(largest)
    return str(wrong if wrong < int(item.answer) else wrong + 1)


def reward_record(item: TaskItem, rng: random.Random) -> dict[str, Any]:
    """A reward model's preference pair: the answer chosen over a rejected reply that covers what
    PPO can reach, not only near misses: a corrupted answer (as `dpo_record`) a quarter of the
    time, a `degenerate` reply (empty, trailing text) a quarter, and for arithmetic, half the time,
    any other number of the answer range (a reward model shown only near misses over-scores far
    ones, and PPO finds them; docs/performance.md)."""
    draw = rng.random()
    if draw < 0.25:
        wrong = degenerate(item, rng)
    elif draw < 0.5 or item.task not in _OPERATORS:
        wrong = corrupt(item, rng)
    else:
        wrong = any_wrong_number(item, rng)
    return {"prompt": item.prompt_messages,
            "chosen": [{"role": "assistant", "content": item.answer}],
            "rejected": [{"role": "assistant", "content": wrong}]}


def prompt_record(item: TaskItem) -> dict[str, Any]:
    return {"messages": item.prompt_messages, "answer": item.answer, "metadata": dict(item.metadata)}


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def tool_trace_record(item: TaskItem) -> dict[str, Any]:
    """An SFT record of a tool-using answer to a `mul` problem, in the form a multi-turn rollout
    samples it: the assistant calls `multiply`, reads the `tool` result and answers with it;
    `tools` holds the schema the chat template shows (the calculator environment's tool)."""
    if item.task != "mul":
        raise ValueError(f"tool traces are for mul problems, got a {item.task!r} problem {item.question!r}")
    a, b = (int(x) for x in item.question.split("*"))
    call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
    return {"messages": [*item.prompt_messages, {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                         {"role": "tool", "name": "multiply", "content": str(multiply(a, b))},
                         {"role": "assistant", "content": item.answer}],
            "tools": [function_schema(multiply)]}


def write_tool_task_files(out_dir: str | Path, num_traces: int = 1000, tool_share: float = 1.0,
                          num_prompts: int = 3000, num_eval: int = 100, digits: int = 3,
                          seed: int = 0) -> dict[str, Path]:
    """The calculator example's files: sft.jsonl (`num_traces` conversations offering the
    `multiply` tool, a `tool_share` of them calling it as `tool_trace_record` writes, the rest
    answering at once), prompts.jsonl (online RL prompts) and eval.jsonl (held out from both)."""
    if not 0.0 <= tool_share <= 1.0:
        raise ValueError(f"tool_share must be in [0, 1], got {tool_share}")
    out = Path(out_dir)
    eval_items = generate_items(num_eval, ["mul"], digits, seed=seed + 1)
    train_items = generate_items(max(num_traces, num_prompts), ["mul"], digits, seed=seed,
                                 exclude={it.question for it in eval_items})
    rng = random.Random(seed + 2)
    traces = []
    for item in train_items[:num_traces]:
        trace = tool_trace_record(item)
        if rng.random() >= tool_share:  # the same tools offered, answered without them
            trace["messages"] = item.messages
        traces.append(trace)
    return {"sft": _write_jsonl(out / "sft.jsonl", traces),
            "prompts": _write_jsonl(out / "prompts.jsonl", (prompt_record(it) for it in train_items[:num_prompts])),
            "eval": _write_jsonl(out / "eval.jsonl", (prompt_record(it) for it in eval_items))}


def write_task_files(out_dir: str | Path, num_train: int = 2000, num_eval: int = 200,
                     tasks: Iterable[str] = ("add",), digits: int = 2, seed: int = 0,
                     num_corpus: int | None = None) -> dict[str, Path]:
    """Write corpus.jsonl, sft.jsonl, dpo.jsonl, rm.jsonl (reward-model pairs), prompts.jsonl
    (train) and eval.jsonl (held out).

    The eval problems never appear in any training file. `num_corpus` (default 4x num_train)
    is the number of equations in the pre-training corpus; the SFT problems are among them.
    """
    tasks = list(tasks)
    out = Path(out_dir)
    eval_items = generate_items(num_eval, tasks, digits, seed=seed + 1)
    held_out = {it.question for it in eval_items}
    num_corpus = 4 * num_train if num_corpus is None else num_corpus
    train_items = generate_items(max(num_train, num_corpus), tasks, digits, seed=seed, exclude=held_out) \
        if _capacity(tasks, digits) > max(num_train, num_corpus) + num_eval else \
        _with_repeats(max(num_train, num_corpus), tasks, digits, seed, held_out)
    sft_items = train_items[:num_train]
    rng, rm_rng = random.Random(seed + 2), random.Random(seed + 3)  # rm's own draws: dpo.jsonl stays as it was
    return {
        "corpus": _write_jsonl(out / "corpus.jsonl", corpus_records(train_items[:num_corpus])),
        "sft": _write_jsonl(out / "sft.jsonl", (sft_record(it) for it in sft_items)),
        "dpo": _write_jsonl(out / "dpo.jsonl", (dpo_record(it, rng) for it in sft_items)),
        "rm": _write_jsonl(out / "rm.jsonl", (reward_record(it, rm_rng) for it in sft_items)),
        "prompts": _write_jsonl(out / "prompts.jsonl", (prompt_record(it) for it in sft_items)),
        "eval": _write_jsonl(out / "eval.jsonl", (prompt_record(it) for it in eval_items)),
    }


def _capacity(tasks: list[str], digits: int) -> int:
    # Rough count of distinct questions, to decide whether problems must repeat.
    per_task = {"add": 100**digits, "sub": 100**digits // 2, "mul": 100**digits,
                "reverse": 26 ** (digits + 2), "sort": 26 ** (digits + 2)}
    return sum(per_task[t] for t in tasks) // 2


def _with_repeats(num: int, tasks: list[str], digits: int, seed: int, held_out: set[str]) -> list[TaskItem]:
    # Small problem spaces (1-digit arithmetic): draw with repeats, still never an eval question.
    rng = random.Random(seed)
    items: list[TaskItem] = []
    while len(items) < num:
        item = make_item(tasks[len(items) % len(tasks)], digits, rng)
        if item.question not in held_out:
            items.append(item)
    return items
