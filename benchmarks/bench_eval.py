"""lm-eval tasks in-process on astrai's engine vs lm-eval's own `hf` backend, same model.

A 200-question multiple-choice task (two-digit additions from `astrai.data.tasks`, four numeric
choices, accuracy) written as a local task YAML over a generated JSONL, run through
`lm_eval.simple_evaluate` once with `AstraiLM` (astrai.eval.harness) and once with lm-eval's
`HFLM` on the same model directory; zero-shot and 5-shot (where the choices of a question share
a long context, which astrai prefills once and serves from its prefix cache). Both models are
loaded and warmed up (one small untimed run each) before the clock starts; seconds are the median of interleaved repeats. The table also
says whether the accuracies are identical and the largest per-request log-likelihood gap.

    .venv/bin/python benchmarks/bench_eval.py [--quick] [--model DIR]   # e.g. --model .cache/smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TASK_YAML = """task: bench_arith_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
"""
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def write_task(folder: Path, num: int, seed: int = 0) -> None:
    """`num` additions with the answer and three near misses, in a shuffled order."""
    from astrai.data.tasks import generate_items

    rng = random.Random(seed)
    rows = []
    for item in generate_items(num, tasks=("add",), digits=2, seed=seed):
        value = int(item.answer)
        choices = [value, value + 1, value + 10, max(0, value - 1) if value else value + 2]
        rng.shuffle(choices)
        rows.append({"question": item.question, "choices": [str(c) for c in choices], "label": choices.index(value)})
    (folder / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "arith.yaml").write_text(TASK_YAML.format(data=folder / "arith.jsonl"))


def tiny_model(folder: Path) -> Path:
    """A random model with a byte-level BPE trained on arithmetic text."""
    from astrai.data.tokenizer_training import train_tokenizer
    from astrai.model import CausalLM, ModelConfig
    from astrai.model.hf import save_model

    texts = [f"Question: {a}+{b}\nAnswer: {a + b}" for a in range(100) for b in range(0, 100, 7)]
    tok = train_tokenizer(texts, 512)
    config = ModelConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         **TINY)
    return save_model(CausalLM(config, seed=0), folder / "model", tokenizer=tok)


def run(model, manager, fewshot: int, limit: int | None) -> tuple[float, float, dict]:
    """Seconds of the whole simple_evaluate call, seconds inside the model's loglikelihood, results."""
    import lm_eval

    inner = [0.0]
    loglikelihood = model.loglikelihood

    def timed(requests, *a, **k):
        t = time.perf_counter()
        try:
            return loglikelihood(requests, *a, **k)
        finally:
            inner[0] += time.perf_counter() - t

    model.loglikelihood = timed
    try:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=model, tasks=["bench_arith_mc"], task_manager=manager,
                                      num_fewshot=fewshot, limit=limit, log_samples=True, bootstrap_iters=0)
        return time.perf_counter() - start, inner[0], out
    finally:
        del model.loglikelihood


def loglikelihoods(out: dict) -> list[float]:
    return [r[0] for s in out["samples"]["bench_arith_mc"] for r in s["filtered_resps"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 questions, one repeat (smoke test)")
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny random model)")
    parser.add_argument("--batch_size", type=int, default=32, help="requests per batch, both backends")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per row (default 3; --quick 1)")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from astrai.eval.harness import AstraiLM

    num, repeats = (40, 1) if args.quick else (200, args.repeats or 3)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder, 200)
        model_dir = Path(args.model) if args.model else tiny_model(folder)
        manager = TaskManager(include_path=str(folder), include_defaults=False)
        device = "cuda" if __import__("torch").cuda.is_available() else "cpu"
        ours = AstraiLM(pretrained=str(model_dir), batch_size=args.batch_size)
        peer = HFLM(pretrained=str(model_dir), device=device, dtype="float32", batch_size=args.batch_size)
        print(f"model: {model_dir if args.model else 'tiny random (' + str(TINY) + ')'}; {num} questions x 4 "
              f"choices; batch {args.batch_size}; device {device}; median of {repeats}\n")
        print("| task | astrai s (model) | lm-eval hf s (model) | speed-up, whole (model) | same acc | max |dlogp| |")
        print("|---|---|---|---|---|---|")
        for fewshot in (0, 5):
            times: dict[str, list[float]] = {"astrai": [], "hf": []}
            inner: dict[str, list[float]] = {"astrai": [], "hf": []}
            outs = {}
            for model in (ours, peer):  # untimed: the first run pays for datasets, templates, warm caches
                run(model, manager, fewshot, 8)
            for _ in range(repeats):
                for name, model in (("astrai", ours), ("hf", peer)):
                    seconds, model_s, outs[name] = run(model, manager, fewshot, num)
                    times[name].append(seconds)
                    inner[name].append(model_s)
            a, h = statistics.median(times["astrai"]), statistics.median(times["hf"])
            ma, mh = statistics.median(inner["astrai"]), statistics.median(inner["hf"])
            acc = [outs[n]["results"]["bench_arith_mc"]["acc,none"] for n in ("astrai", "hf")]
            gap = max(abs(x - y) for x, y in zip(loglikelihoods(outs["astrai"]), loglikelihoods(outs["hf"])))
            print(f"| {fewshot}-shot MC, acc {acc[0]:.3f} | {a:.2f} ({ma:.2f}) | {h:.2f} ({mh:.2f}) | "
                  f"{h / a:.2f}x ({mh / ma:.2f}x) | "
                  f"{'yes' if acc[0] == acc[1] else 'NO'} | {gap:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
