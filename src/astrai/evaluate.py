"""`astrai eval`: accuracy of a model on verifiable prompts, run through the engine.

Reads prompt records (`{"messages": [...], "answer": "..."}`, as written by
`astrai.data.tasks.write_task_files`), renders each with the model's chat template, generates
greedily in one batch with the inference engine, and scores each reply with a task verifier:
`--match exact` (default: the reply is the answer) or `--match final_number` (the last number in
the reply is the answer, for chat models that answer in sentences).
The demo uses `evaluate_model` before and after SFT.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astrai.data.tasks import SCORERS
from astrai.flags import ArgumentParser


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


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai eval", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model or checkpoint directory, or a run's ckpt_dir "
                        "(its newest complete checkpoint)")
    parser.add_argument("--data", required=True, help="JSONL prompt records with 'messages' and 'answer'")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N records")
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--match", choices=list(SCORERS), default="exact",
                        help="exact: the reply is the answer (default); final_number: its last number is")
    args = parser.parse_args(argv)
    from astrai.infer.llm import LLM

    try:
        from astrai.model.manifest import model_argument

        # a Hub id -> its cached snapshot directory; a run's ckpt_dir -> its newest checkpoint
        args.model = model_argument(args.model, "astrai eval")
        records = read_prompt_records(args.data, args.limit)
    except (OSError, ValueError) as err:
        print(f"astrai eval: {err}", file=sys.stderr)
        return 2
    result = evaluate_model(LLM(args.model), records, args.max_tokens, match=args.match)
    print(json.dumps({"match": args.match, "accuracy": result.accuracy, "num_correct": result.num_correct,
                      "num_total": result.num_total, "tokens_per_s": round(result.tokens_per_s, 1),
                      "samples": result.samples}, indent=2))
    return 0
