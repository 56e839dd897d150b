"""MoE routing replay under bf16 autocast: how often the sampler and the trainer route a token to
different experts, and online GRPO's ``sampler_logp_diff`` with and without ``routing_replay``.

The policy is a small random mixture-of-experts model (hidden 64, 4 layers, all MoE, by default 64
experts, top 8, initializer_range 0.1, so that experts differ; nothing downloaded), trained with
``bf16: true``: the rollout engine runs under bf16
autocast over a bf16 KV pool, the trainer under bf16 autocast over the fp32 master weights, the
same arithmetic in another order. Two figures per seed:
  disagree   the share of (token, MoE layer) whose set of top-k experts differs between the
             engine's forward that sampled the rollout and the trainer's forward on the same rows
             (the first rollout of the run's weights; Megatron-LM #4168 reports ~10% per forward)
  diff       ``sampler_logp_diff`` (mean |trainer - sampler| log-prob of the sampled tokens) of
             each step of an ``astrai train`` run, ``routing_replay`` false and true, the same
             seed (so the first rollout's tokens are the same in both)
Each run is a fresh ``astrai train`` process on the add task of ``astrai.data.tasks``; the table
gives the mean over steps per seed and over everything.

    .venv/bin/python benchmarks/bench_routing_replay.py [--seeds 0,1,2] [--steps 4] [--experts 64]
        [--top_k 8] [--init_std 0.1] [--threads 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def model_fields(args: argparse.Namespace) -> dict:
    return {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "num_experts": args.experts, "num_experts_per_tok": args.top_k, "moe_intermediate_size": 64,
            "norm_topk_prob": True, "initializer_range": args.init_std}


def write_inputs(root: Path) -> tuple[Path, Path]:
    """A tokenizer for the add task and 64 prompt records."""
    from astrai.data.tasks import corpus_records, generate_items, prompt_record
    from astrai.data.tokenizer_training import train_tokenizer

    items = generate_items(200, ["add"], digits=2, seed=0)
    tok_dir = root / "tok"
    train_tokenizer([r["text"] for r in corpus_records(items)] + ["user assistant system"] * 5, 276, tok_dir)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(prompt_record(it)) + "\n"
                               for it in generate_items(64, ["add"], digits=2, seed=1)))
    return tok_dir, prompts


def train_run(root: Path, tok_dir: Path, prompts: Path, args: argparse.Namespace, seed: int, replay: bool) -> list[float]:
    """``sampler_logp_diff`` of every step of one bf16 online GRPO run."""
    run = root / f"seed{seed}_{'replay' if replay else 'own'}"
    cfg = {"model": model_fields(args),
           "data": {"train_type": "online_grpo", "data_path": str(prompts), "tokenizer_path": str(tok_dir)},
           "train": {"max_steps": args.steps, "batch_per_device": 8, "device": args.device, "random_seed": seed,
                     "bf16": True},
           "optim": {"max_lr": 1e-3, "warmup_steps": 0},
           "rl": {"group_size": 4, "rollout_max_tokens": 16, "rewards": ["exact_match", "format"],
                  "routing_replay": replay},
           "ckpt": {"ckpt_dir": str(run / "ckpt"), "ckpt_interval": 0},
           "log": {"log_dir": str(run / "log"), "progress": False, "trace_samples": 0}}
    run.mkdir(parents=True)
    (run / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", "astrai", "train", "--config", str(run / "run.yaml"),
                           "--num_threads", str(args.threads)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run {run.name} failed:\n{done.stderr[-3000:]}")
    lines = (run / "log" / "metrics.jsonl").read_text().splitlines()
    return [m["sampler_logp_diff"] for m in map(json.loads, lines) if "sampler_logp_diff" in m]


def disagreement(tok_dir: Path, prompts: Path, args: argparse.Namespace, seed: int) -> float:
    """The share of (token, MoE layer) whose top-k set differs between the bf16 engine that sampled
    a rollout of the initial weights and the trainer's bf16 forward on its rows."""
    import torch

    from astrai.data.tokenizer import load_tokenizer
    from astrai.infer.sampling import SamplingParams
    from astrai.model import CausalLM, ModelConfig
    from astrai.train.rl.engine_sampler import batch_engine

    torch.set_num_threads(args.threads)
    model = CausalLM(ModelConfig(**model_fields(args)), seed=seed).to(args.device)
    tok = load_tokenizer(tok_dir)
    records = [json.loads(line) for line in prompts.read_text().splitlines()[:8]]
    ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
    engine = batch_engine(model, tok, 32, 256, bf16=True, record_routing=True)
    outs = engine.run_batch(ids, SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=seed))
    differ = total = 0
    with torch.no_grad(), torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16):
        for prompt, out in zip(ids, outs):
            for c in out.outputs:
                row = prompt + c.token_ids
                own = model(torch.tensor([row[:len(c.routing)]], device=args.device),
                            return_routing=True).routing[0].cpu()  # (T, L, k)
                same = (own.sort(-1).values == c.routing.long().sort(-1).values).all(-1)  # (T, L)
                differ += int((~same).sum())
                total += same.numel()
    return differ / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the same runs on a GPU")
    p.add_argument("--init_std", type=float, default=0.1,
                   help="initializer_range of the random policy (0.02, the default init: experts that barely differ)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok_dir, prompts = write_inputs(root)
        for seed in seeds:
            own = train_run(root, tok_dir, prompts, args, seed, replay=False)
            replay = train_run(root, tok_dir, prompts, args, seed, replay=True)
            rows.append((seed, disagreement(tok_dir, prompts, args, seed), own, replay))
    print(f"MoE: {args.experts} experts, top {args.top_k}, 4 layers, init std {args.init_std}, bf16 autocast, "
          f"{args.steps} steps, {args.device}, {args.threads} thread(s)\n")
    print("| seed | experts that differ (first rollout) | sampler_logp_diff, own routing | with routing_replay | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for seed, frac, own, replay in rows:
        a, b = statistics.mean(own), statistics.mean(replay)
        print(f"| {seed} | {100 * frac:.1f}% | {a:.2e} | {b:.2e} | {a / b:.1f}x |")
    a = statistics.mean(d for r in rows for d in r[2])
    b = statistics.mean(d for r in rows for d in r[3])
    print(f"| all | {100 * statistics.mean(r[1] for r in rows):.1f}% | {a:.2e} | {b:.2e} | {a / b:.1f}x |")
    print("\nper step (own -> replay): " + "; ".join(
        f"seed {s}: " + ", ".join(f"{x:.1e}->{y:.1e}" for x, y in zip(own, rep)) for s, _, own, rep in rows))


if __name__ == "__main__":
    main()
