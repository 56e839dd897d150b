"""Online GRPO step time: astrai's OnlineLoop vs TRL's GRPOTrainer (and astrai online PPO vs GRPO).

Both systems train the same tiny Llama-shaped model (astrai writes it as an HF model directory;
TRL loads that directory as a transformers `LlamaForCausalLM`, same config and weights) on the
same arithmetic prompt records (`astrai.data.tasks`, chat-templated by the same ChatML template
with the generation prompt), in this process, with the same settings: prompts per step, group
size (completions per prompt), max new tokens, temperature 1 without top-k / top-p, AdamW at a
constant learning rate, gradient clipping at 1.0, beta (KL) 0, PPO clip 0.2, token-mean loss
(TRL's `dapo`), one optimizer step per generation, fp32, and an `exact_match` reward (the
completion equals the answer after strip). By default the model is freshly initialised: it
rarely emits the end token, so both systems generate the full `--max_tokens` per sample and do
the same amount of work per step.

Per system: seconds per optimizer step (median over the steps after the first, measured between
consecutive step ends, so everything a step costs is counted), process CPU seconds per step (the
robust figure on a shared machine), rollout tokens per second (new tokens / time inside the
generation call: astrai's `LLMEngine.run_batch`, TRL's `_generate_single_turn`), and the rollout
share of a step. One intra-op thread by default. The table ends with astrai/TRL ratios.

    .venv/bin/python benchmarks/bench_rl.py [--quick] [--steps N] [--prompts B] [--group_size G]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from trl_common import StepClock, exact_match, grpo_config, prompt_dataset, time_generation  # noqa: E402

MODEL = {  # the demo's model shape (~1M parameters); vocab_size comes from the tokenizer
    "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
}


def setup(tmp: Path, num_prompts: int, seed: int) -> tuple[Path, Path]:
    """Prompt records and a model directory (weights + tokenizer with its chat template)."""
    from astrai.data.tasks import write_task_files
    from astrai.data.tokenizer import train_tokenizer
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM

    files = write_task_files(tmp / "data", num_train=max(num_prompts, 256), num_eval=8, digits=2, seed=seed)
    corpus = [json.loads(line)["text"] for line in files["corpus"].read_text().splitlines()]
    tok = train_tokenizer(corpus + ["user assistant system"] * 5, 384)
    model = CausalLM(ModelConfig(vocab_size=tok.vocab_size, **MODEL), seed=seed)
    model_dir = tmp / "model"
    save_model(model, model_dir, tokenizer=tok)
    return files["prompts"], model_dir


def run_astrai(prompts: Path, model_dir: Path, out: Path, args: argparse.Namespace,
               train_type: str = "online_grpo") -> dict[str, float]:
    from astrai.config import load_config
    from astrai.train.rl.loop import OnlineLoop

    clock = StepClock()

    class Clock:
        requested_metrics = frozenset()

        def on_train_begin(self, loop: Any) -> None:
            clock.start()

        def after_optimizer_step(self, loop: Any) -> None:
            clock.tick()
            clock.rollout_seconds.append(loop.step_metrics["rollout_seconds"])
            clock.rollout_tokens.append(int(loop.step_metrics["rollout_tokens"]))

    flags = {"train_type": train_type, "data_path": prompts, "param_path": model_dir, "device": "cpu",
             "batch_per_device": args.prompts, "group_size": args.group_size, "rollout_max_tokens": args.max_tokens,
             "rollout_temperature": 1.0, "max_steps": args.steps, "n_epoch": 100, "max_lr": args.lr,
             "schedule": "constant", "max_grad_norm": 1.0, "kl_coef": 0.0, "clip_eps": 0.2,
             "rl_loss_agg": "token_mean", "random_seed": args.seed, "ckpt_dir": out / "ckpt", "ckpt_interval": 0,
             "log_dir": out, "progress": False}
    cfg = load_config(None, [item for k, v in flags.items() for item in (f"--{k}", str(v))])
    OnlineLoop(cfg, callbacks=[Clock()]).train()
    return clock.summary()


def run_trl(prompts: Path, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import GRPOTrainer

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock.start()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock.tick()

    config = grpo_config(out, steps=args.steps, prompts=args.prompts, group_size=args.group_size,
                         max_tokens=args.max_tokens, lr=args.lr, seed=args.seed)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=prompt_dataset(prompts),
                          processing_class=tokenizer, callbacks=[Clock()])
    time_generation(trainer, clock)
    trainer.train()
    return clock.summary()


def print_table(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    a, t = results["astrai"], results["TRL"]
    print(f"Online GRPO, {args.prompts} prompts x {args.group_size} completions, max {args.max_tokens} new tokens, "
          f"{args.steps} steps (median of steps 2..{args.steps}), {torch.get_num_threads()} thread(s), CPU fp32.\n")
    print("| metric | astrai | TRL GRPOTrainer | astrai / TRL |")
    print("|---|---|---|---|")
    rows = [("seconds per step", "step_s", "{:.3f}", True), ("CPU seconds per step", "cpu_s", "{:.3f}", True),
            ("rollout tokens/s", "tokens_per_s", "{:.0f}", False), ("rollout share of a step", "rollout_share",
                                                                     "{:.0%}", None),
            ("rollout tokens per step", "tokens_per_step", "{:.0f}", None),
            ("rollout seconds per step", "rollout_s", "{:.3f}", True),
            ("training seconds per step (the rest)", "train_s", "{:.3f}", True)]
    for label, key, fmt, lower_is_better in rows:
        ratio = a[key] / t[key] if t[key] else float("nan")
        note = ""
        if lower_is_better is True:
            note = f" ({1 / ratio:.1f}x faster)" if ratio < 1 else f" ({ratio:.1f}x slower)"
        elif lower_is_better is False:
            note = f" ({ratio:.1f}x)"
        print(f"| {label} | {fmt.format(a[key])} | {fmt.format(t[key])} | {ratio:.2f}{note} |")
    target = t["step_s"] / 3
    print(f"\nA step 3x faster than TRL's takes {target:.3f} s; astrai's training part alone takes "
          f"{a['train_s']:.3f} s and its rollout {a['rollout_s']:.3f} s.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps of 2 prompts (smoke test)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.prompts = 3, 2
    torch.set_num_threads(args.threads)
    try:
        import trl  # noqa: F401
    except ImportError as e:
        print(f"bench_rl: TRL is not installed ({e}); install the dev extra: pip install -e '.[dev]'",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        prompts, model_dir = setup(tmp, args.prompts * args.steps, args.seed)
        results = {"astrai": run_astrai(prompts, model_dir, tmp / "astrai", args),
                   "TRL": run_trl(prompts, model_dir, tmp / "trl", args)}
        ppo = run_astrai(prompts, model_dir, tmp / "ppo", args, train_type="online_ppo")
    print_table(results, args)
    print_ppo_table(results["astrai"], ppo)
    return 0


def print_ppo_table(grpo: dict[str, float], ppo: dict[str, float]) -> None:
    """online_ppo against online_grpo on the same workload: what the critic costs. (TRL 1.x no
    longer ships a PPO trainer, neither in trl nor in trl.experimental, so there is no TRL row.)"""
    print("\nOnline PPO (policy + critic) vs online GRPO, astrai, same workload.\n")
    print("| metric | online_grpo | online_ppo | ppo / grpo |")
    print("|---|---|---|---|")
    for label, key, fmt in (("seconds per step", "step_s", "{:.3f}"), ("CPU seconds per step", "cpu_s", "{:.3f}"),
                            ("rollout share of a step", "rollout_share", "{:.0%}")):
        ratio = ppo[key] / grpo[key] if grpo[key] else float("nan")
        print(f"| {label} | {fmt.format(grpo[key])} | {fmt.format(ppo[key])} | {ratio:.2f} |")
    # the rollout is the same work in both; the rest of a PPO step is policy + critic training
    train_grpo = grpo["step_s"] * (1 - grpo["rollout_share"])
    train_ppo = ppo["step_s"] * (1 - ppo["rollout_share"])
    print(f"| training part of a step (s) | {train_grpo:.3f} | {train_ppo:.3f} | "
          f"{train_ppo / max(train_grpo, 1e-9):.2f} |")
    print(f"\nThe critic's forward/backward and its optimizer take about "
          f"{max(train_ppo - train_grpo, 0) / max(ppo['step_s'], 1e-9):.0%} of a PPO step.")


if __name__ == "__main__":
    raise SystemExit(main())
