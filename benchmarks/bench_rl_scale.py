"""One online-GRPO training step at SmolLM2-135M's shape: the full-logits path vs the chunked lm
head, and padded vs sorted vs packed micro-batches.

The model is random (hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocabulary 49,152,
tied embeddings: SmolLM2-135M's shape, nothing downloaded); the rollout is synthetic: 8 prompts
x 4 samples, prompts of 24-64 tokens and responses of 1-64 tokens (seeded), right-padded as
``Rollout`` holds them. A step is the objective's forward and backward over every micro-batch
(no optimizer: the lever under test is the loss's memory and time); the rollout's first step,
so the trainer's old log-probs are computed in it too, as online GRPO's first step does.

Each setting runs in a fresh subprocess (peak resident memory is per process: ``ru_maxrss``),
``--steps`` steps, and reports the median seconds and process CPU seconds per step (the robust
figure on a shared machine) and the peak RSS minus the RSS after building model and rollout
(what the step adds). Settings:
  old    the path before: full logits at the labelled columns, log-softmax on them, padded rows
  pad    chunked lm head at the labelled tokens, padded rows
  sort   chunked head, samples sorted by length into micro-batches, each trimmed to its longest
  pack   chunked head, rows packed padding-free (first-fit decreasing, document ids)
  share  pack, and each group's common prompt computed once (the default layout)
``--shared_prompts`` gives the 4 samples of each prompt the same prompt tokens, as a GRPO
rollout has them (without it every sample's prompt is its own, and ``share`` finds nothing).
``--kv_pool keep|release`` adds the rollout engine of that rollout (32 sequences at its padded
length, ``rollout.batch_engine``) to the process before the base RSS is read: ``keep`` holds its
KV pool through the steps (``keep_kv_pool: true``), ``release`` frees it and, after each step,
times making it again and freeing it (``kv_remake_s``), as the rollout runner does per rollout.

    .venv/bin/python benchmarks/bench_rl_scale.py [--settings old,pad,sort,pack] [--repeats 2]
        [--micro 2] [--entropy] [--chunk ELEMENTS] [--layers 30] [--tiny] [--kv_pool keep|release]
        [--shared_prompts]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOL = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
        "tie_word_embeddings": True}
TINY = {"vocab_size": 384, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": True}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import astrai.model.chunked_head as chunked_head
    from astrai.config import load_config
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM
    from astrai.train.objectives import OBJECTIVES
    from tests.train.test_packed_rollouts import make_rollout, old_logps, shared_prompt_rollout

    if args.chunk:
        chunked_head.LOGITS_CHUNK_ELEMENTS = args.chunk
    shape = dict(TINY if args.tiny else SMOL, num_hidden_layers=args.layers or (TINY if args.tiny else SMOL)["num_hidden_layers"])
    model = CausalLM(ModelConfig(**shape), seed=0)
    cfg = load_config(None, ["--train_type", "online_grpo"])
    objective = OBJECTIVES["online_grpo"](cfg, model)
    objective.requested_metrics = frozenset({"entropy"}) if args.entropy else frozenset()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(24, 65, (32,), generator=gen).tolist()
    responses = torch.randint(1, 65, (32,), generator=gen).tolist()
    if args.shared_prompts:  # each group of 4 samples starts with its first sample's prompt
        rollout = shared_prompt_rollout([prompts[i - i % 4] for i in range(32)], responses, seed=0)
    else:
        rollout = make_rollout(prompts, responses, seed=0)
    rollout.input_ids.clamp_(max=shape["vocab_size"] - 1)
    rollout.labels = torch.where(rollout.labels >= 0, rollout.labels.clamp(max=shape["vocab_size"] - 1), -100)
    objective.prepare(rollout)
    base = current_rss_mb()
    engine, remake = kv_pool_engine(model, rollout, args.kv_pool), []
    if args.setting == "old":
        objective.logps = old_logps(cfg.rl)
        objective.layout = "pad"
    else:
        objective.layout = args.setting
    seconds, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        for batch in objective.batches(rollout, args.micro):
            objective(model, batch).loss.backward()
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        model.zero_grad(set_to_none=True)
        if args.kv_pool == "release":  # the next rollout's pool, made and freed again
            t0 = time.perf_counter()
            engine.reserve_kv_cache(engine.initial_num_blocks * engine.config.block_size)
            engine.release_kv_cache()
            remake.append(time.perf_counter() - t0)
    extra = {"kv_remake_s": statistics.median(remake)} if remake else {}
    return {**extra, "setting": args.setting, "s_per_step": statistics.median(seconds[1:] or seconds),
            "cpu_s_per_step": statistics.median(cpu[1:] or cpu),
            "peak_rss_mb": rss_mb(), "step_rss_mb": rss_mb() - base,
            "tokens": int(rollout.attention_mask.sum()), "padded": int(rollout.attention_mask.numel())}


def kv_pool_engine(model, rollout, kv_pool: str):
    """The rollout's engine for --kv_pool (None without): room for every row at the rollout's length."""
    if kv_pool == "none":
        return None
    from astrai.train.rl.engine_sampler import batch_engine

    N, T = rollout.input_ids.shape
    engine = batch_engine(model, None, N, T, bf16=False)
    if kv_pool == "release":
        engine.release_kv_cache()
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", default="old,pad,sort,pack,share")
    p.add_argument("--shared_prompts", action="store_true", help="samples of a group share their prompt")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per setting, interleaved")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step (grad_accum_steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--entropy", action="store_true", help="also compute the entropy metric")
    p.add_argument("--chunk", type=int, default=0, help="LOGITS_CHUNK_ELEMENTS override")
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="bench_rl's tiny model shape instead")
    p.add_argument("--kv_pool", choices=["none", "keep", "release"], default="none",
                   help="the rollout engine's KV pool held through the steps, or freed and timed re-made")
    p.add_argument("--setting", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.setting:
        print(json.dumps(child(args)))
        return
    results: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for setting in args.settings.split(","):
            cmd = [sys.executable, __file__, "--setting", setting, *sys.argv[1:]]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results.setdefault(setting, []).append(json.loads(line))
    keys = ("s_per_step", "cpu_s_per_step", "peak_rss_mb", "step_rss_mb")
    print(f"{'setting':8} {'s/step':>8} {'CPU s/step':>11} {'peak RSS MB':>12} {'step adds MB':>13}"
          f"  (median of {args.repeats})")
    for setting, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        print(f"{setting:8} {med['s_per_step']:8.2f} {med['cpu_s_per_step']:11.2f} {med['peak_rss_mb']:12.0f} "
              f"{med['step_rss_mb']:13.0f}")
    first = next(iter(results.values()))[0]
    if "kv_remake_s" in first:
        remake = statistics.median(r["kv_remake_s"] for rows in results.values() for r in rows)
        print(f"KV pool made again and freed: {remake:.3f} s per rollout")
    print(f"rollout: {first['tokens']} real tokens in {first['padded']} padded positions")


if __name__ == "__main__":
    main()
