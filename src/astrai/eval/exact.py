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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai.data.tasks import SCORERS


@dataclass
class EvalResult:
    accuracy: float
    num_correct: int
    num_total: int
    tokens_per_s: float
    samples: list[dict[str, Any]]  # the first few prompts with completion and answer


def read_prompt_records(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    records = []
    with Path(path).open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "messages" not in record or "answer" not in record:
                raise ValueError(f"{path}:{line_no}: an eval record needs 'messages' and 'answer', "
                                 f"got keys {sorted(record)}")
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise ValueError(f"{path} holds no eval records")
    return records


def evaluate_model(llm: Any, records: list[dict[str, Any]], max_tokens: int = 16,
                   num_samples_kept: int = 5, match: str = "exact") -> EvalResult:
    """Greedy, batched generation over `records` with an `astrai.LLM`, scored by `SCORERS[match]`."""
    score = SCORERS[match]
    from astrai.infer.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([r["messages"] for r in records], params)
    elapsed = max(time.perf_counter() - start, 1e-9)
    correct, generated, samples = 0, 0, []
    for record, out in zip(records, outputs):
        completion = out.outputs[0]
        ok = score(completion.text, record["answer"])
        correct += int(ok)
        generated += len(completion.token_ids)
        if len(samples) < num_samples_kept:
            samples.append({"prompt": record["messages"][-1]["content"], "completion": completion.text,
                            "answer": record["answer"], "correct": bool(ok)})
    return EvalResult(correct / len(records), correct, len(records), generated / elapsed, samples)
