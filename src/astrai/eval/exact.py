"""Exact-match evaluation (`astrai eval --data`): accuracy of a model on verifiable prompts.

Reads prompt records (`{"messages": [...], "answer": "..."}`, as written by
`astrai.data.tasks.write_task_files`), renders each with the model's chat template, generates
greedily in one batch with the inference engine, and scores each reply with a task verifier:
`--match exact` (default: the reply is the answer) or `--match final_number` (the last number in
the reply is the answer, for chat models that answer in sentences).
The demo uses `evaluate_model` before and after SFT.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai.data.tasks import score_completions


@dataclass
class EvalResult:
    accuracy: float
    num_correct: int
    num_total: int
    tokens_per_s: float
    samples: list[dict[str, Any]]  # the first few prompts with completion and answer
    num_skipped: int = 0  # prompts longer than the model's max_model_len: not generated, counted wrong


def read_json_line(path: str | Path, line_no: int, line: str) -> Any:
    """One JSONL line; a broken one is a ValueError naming the file and its line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno}); "
                         "fix or remove that line") from None


def text_lines(path: str | Path, strip_bom: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 file, line ends kept (a byte-order mark at its
    start is no data, unless `strip_bom` is False); a line that is not UTF-8 (a binary file) is a
    ValueError naming the file and line."""
    with Path(path).open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                yield line_no, raw.decode("utf-8-sig" if line_no == 1 and strip_bom else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start} "
                                 "of the line); give a UTF-8 text or JSONL file") from None


def read_prompt_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    records = []
    for line_no, line in text_lines(path):
        if not line.strip():
            continue
        record = read_json_line(path, line_no, line)
        if not isinstance(record, dict) or "messages" not in record or "answer" not in record:
            got = f"keys {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}"
            raise ValueError(f"{path}:{line_no}: an eval record needs 'messages' and 'answer', got {got}")
        records.append(record)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"{path} holds no eval records")
    return records


def prompts_fit(llm: Any, records: list[dict[str, Any]], source: str = "the eval records") -> list[bool]:
    """Whether each record's rendered prompt fits the engine's max_model_len (a stand-in LLM
    without an engine or tokenizer, as tests use, takes every prompt). A record the chat template
    refuses (an unknown role, a message that is no role dict) is a ValueError naming `source`
    (the file) and the record."""
    engine = getattr(llm, "engine", None)
    tok = getattr(engine, "tokenizer", None)
    if engine is None or tok is None:
        return [True] * len(records)
    fits = []
    for n, r in enumerate(records, 1):
        try:
            ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True)
        except Exception as e:  # jinja2's TemplateError and friends: the template rejected the messages
            message = " ".join(str(e).split()) or type(e).__name__
            raise ValueError(f"{source}: eval record {n} cannot be rendered by the model's chat template "
                             f"({message}); fix its 'messages'") from None
        fits.append(len(ids) < engine.max_model_len)
    return fits


def evaluate_model(llm: Any, records: list[dict[str, Any]], max_tokens: int = 16,
                   num_samples_kept: int = 5, match: str = "exact", source: str = "the eval records") -> EvalResult:
    """Greedy, batched generation over `records` with an `astrai.LLM`, scored by `SCORERS[match]`.
    A prompt the model cannot hold (max_model_len) is skipped and counted wrong, not an error.
    `source` names the records in errors (the file they came from)."""
    from astrai.infer.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    fits = prompts_fit(llm, records, source)
    start = time.perf_counter()
    kept = [r for r, fit in zip(records, fits) if fit]
    outputs = llm.chat([r["messages"] for r in kept], params) if kept else []
    elapsed = max(time.perf_counter() - start, 1e-9)
    completions = [out.outputs[0] for out in outputs]
    scores = score_completions([c.text for c in completions], [r["answer"] for r in kept], match)
    correct = int(sum(scores))
    generated = sum(len(c.token_ids) for c in completions)
    samples = [{"prompt": r["messages"][-1]["content"], "completion": c.text, "answer": r["answer"], "correct": bool(ok)}
               for r, c, ok in zip(kept[:num_samples_kept], completions, scores)]
    return EvalResult(correct / len(records), correct, len(records), generated / elapsed, samples,
                      num_skipped=fits.count(False))
