"""SFT -> reward model -> PPO on the demo's task, one pair set per row: the table of docs/performance.md
("Distillation and reward models on the demo's task").

Builds the demo's SFT model (`astrai.demo.sft_stages`, reused when done), writes four reward-model
pair sets (`dpo.jsonl`: correct vs a near miss; `rm.jsonl`: vs a near miss, a degenerate reply or
any other number of the answer range; on-policy: the SFT model's own wrong samples of each
training sum, mixed 1:1 with `rm.jsonl`;
exhaustive: every wrong number 0-19, plus half as many `rm.jsonl` pairs), trains a reward model on
each as `configs/reward_model.yaml`, then runs `configs/ppo_reward_model.yaml` on each with
`exact_match` logged beside it (weight 0), every run its own process on one thread, side by side.
Prints one row per pair set: the reward model's held-out pair accuracy, PPO's held-out greedy
accuracy at its start and end, and the rollouts' exact match over the first and last 25 steps.

    python benchmarks/bench_reward_pipeline.py --out out/bench_rm     # 8 min on 2 idle cores, 3 on 16
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]


def wrong_samples(sft: Path, prompts: Path, n: int = 16) -> list[dict]:
    """Pairs from the SFT model's own samples (temperature 1) of each distinct training prompt:
    each wrong reply rejected against the reference (the classic pipeline's labelling step)."""
    from astrai.infer.llm import LLM
    from astrai.infer.sampling import SamplingParams

    records = {}
    for line in prompts.read_text().splitlines():
        r = json.loads(line)
        records.setdefault(r["messages"][0]["content"], r)
    outputs = LLM(str(sft)).chat([r["messages"] for r in records.values()],
                                 SamplingParams(temperature=1.0, max_tokens=8, n=n, seed=7))
    return [pair(r, c.text) for r, o in zip(records.values(), outputs) for c in o.outputs
            if c.text.strip() != r["answer"]]


def pair(record: dict, rejected: str) -> dict:
    return {"prompt": record["messages"], "chosen": [{"role": "assistant", "content": record["answer"]}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def pair_sets(data: Path, sft: Path) -> dict[str, Path]:
    rm = [json.loads(line) for line in (data / "rm.jsonl").read_text().splitlines()]
    onp = wrong_samples(sft, data / "prompts.jsonl")
    distinct = {json.loads(line)["messages"][0]["content"]: json.loads(line)
                for line in (data / "prompts.jsonl").read_text().splitlines()}
    exh = [pair(r, str(w)) for r in distinct.values() for w in range(20) if str(w) != r["answer"]]
    rng = random.Random(0)
    sets = {"onpolicy": onp + rm[:len(onp)], "exhaustive": exh + rm[:len(exh) // 2]}
    paths = {"dpo": data / "dpo.jsonl", "rm": data / "rm.jsonl"}
    for name, rows in sets.items():
        rng.shuffle(rows)
        paths[name] = data / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def run_all(commands: dict[str, list], logs: Path) -> None:
    """Each command an `astrai train` process of its own, all at once; fails on the first error."""
    procs = {}
    for name, args in commands.items():
        with open(logs / f"{name}.log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, "-m", "astrai", "train", *map(str, args)],
                                           stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    for name, p in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"{name} failed; see {logs / f'{name}.log'}")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/bench_rm")
    parser.add_argument("--scale", type=float, default=1.0, help="steps of every stage x this (smoke: 0.05)")
    args = parser.parse_args(argv)
    from astrai.demo import sft_stages

    out = Path(args.out).resolve()
    stages = sft_stages(out, scale=args.scale, seed=0, log=lambda *a: None)
    data, tok, sft = out / "data", out / "tokenizer", out / "sft" / "final"
    common = ["--tokenizer_path", tok, "--param_path", sft, "--device", "cpu", "--num_threads", 1,
              "--progress", "false", "--summary_hints", "false", "--overwrite_ckpt_dir", "true"]
    rm_steps, ppo_steps = max(20, int(600 * args.scale)), max(10, int(300 * args.scale))
    paths = pair_sets(data, sft)
    run_all({f"rm_{k}": ["--config", ROOT / "configs/reward_model.yaml", "--data_path", p, *common,
                         "--max_steps", rm_steps, "--val_interval", max(10, rm_steps // 6),
                         "--ckpt_dir", out / f"rm_{k}/ckpt", "--log_dir", out / f"rm_{k}"]
             for k, p in paths.items()}, out)
    run_all({f"ppo_{k}": ["--config", ROOT / "configs/ppo_reward_model.yaml", "--data_path", data / "prompts.jsonl",
                          "--eval_data_path", data / "eval.jsonl", *common, "--max_steps", ppo_steps,
                          "--eval_interval", max(5, ppo_steps // 6),
                          "--rewards", f"[{out / f'rm_{k}/ckpt'}, exact_match]", "--reward_weights", "[1.0, 0.0]",
                          "--critic_model_path", out / f"rm_{k}/ckpt",
                          "--ckpt_dir", out / f"ppo_{k}/ckpt", "--log_dir", out / f"ppo_{k}"]
             for k in paths}, out)
    print(f"SFT held-out accuracy {stages['eval']['sft']['accuracy']:.1%}")
    print("| pairs | RM held-out pairs | PPO held-out accuracy | rollout exact match |")
    print("|---|---|---|---|")
    for k in paths:
        val = [m["val/accuracy"] for m in metrics(out / f"rm_{k}") if "val/accuracy" in m]
        ppo = metrics(out / f"ppo_{k}")
        acc = [m["eval/accuracy"] for m in ppo if "eval/accuracy" in m]
        em = [m["rewards/exact_match"] for m in ppo if "rewards/exact_match" in m]
        print(f"| {k} | {val[-1]:.0%} | {acc[0]:.1%} -> {acc[-1]:.1%} | {mean(em[:25]):.2f} -> {mean(em[-25:]):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
