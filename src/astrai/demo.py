"""`astrai demo`: the quickstart, end to end on CPU with no downloads.

Stages, each reused when a re-run finds it finished (a `stage.json` marker):
  data      synthetic arithmetic problems (astrai.data.tasks): a plain-text corpus of equations,
            ChatML SFT records and held-out eval prompts;
  tokenizer a byte-level BPE tokenizer trained on that text;
  pretrain  a tiny model pre-trained (train_type seq) on the equations;
  sft       the pre-trained model fine-tuned (train_type sft) on the chat records, briefly, so
            that it adds correctly only part of the time;
  eval      exact-match accuracy of both models on held-out problems, greedy and batched
            through the inference engine;
  rl-<algo> the SFT model improved by online RL on its own samples of the training prompts
            (online GRPO by default; `--algo ppo | online_dpo`), rewarded by `exact_match`,
            then scored on the same held-out problems;
and finally a markdown report with plots of the training curves and of the accuracy per stage.
`--algo tools` runs another demo instead: a calculator tool learned by multi-turn online RL
(`astrai.demo_tools`, in out/demo-tools).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from astrai.demo_stages import plot_accuracy, plot_against_time, rl_curves, run_stage, train_stage
from astrai.flags import ArgumentParser

MODEL = {  # ~100k parameters: small enough for hundreds of RL steps on 2 CPU cores
    "vocab_size": 276,  # all BPE reaches on the task corpus (asking more only warns); replaced by the trained size
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
# The task: 1-digit addition; 40 of its 100 problems are held out, never trained on
TASK = {"digits": 1, "num_train": 2000, "num_eval": 40, "num_corpus": 8000}
# (optimizer steps, batch) per stage at --scale 1; --scale multiplies the steps
BUDGET_MINUTES = 8.0  # what the old --minutes flag meant by scale 1 (it was a step budget, not a clock)
# Pre-training is kept short: longer, the model memorises the 60 training sums from the corpus and
# RL then sharpens those at the expense of the held-out ones (measured: 200 steps gave SFT 55% but
# GRPO 35%; 40 steps give SFT 35% and GRPO 52.5%)
PRETRAIN = {"steps": 40, "batch": 16, "max_seq_len": 128, "max_lr": 3e-3}
# SFT stops early on purpose: the model adds right only part of the time, so RL has room to help
SFT = {"steps": 250, "batch": 32, "max_seq_len": 32, "max_lr": 3e-3}
# Online RL: large rollouts and a moderate constant rate (smaller batches or higher rates wander;
# see tests/train/test_rl_learns.py); each rollout is used for `rollout_interval` steps
RL = {"steps": 300, "prompts": 64, "rollout_interval": 2, "max_tokens": 8, "warmup_steps": 5}
ALGOS = {  # --algo -> (train_type, group size, learning rate)
    "grpo": ("online_grpo", 8, 5e-4),
    "ppo": ("online_ppo", 8, 5e-4),
    "online_dpo": ("online_dpo", 4, 2e-4),
}
def stage_config(kind: str, out: Path, data: Path, tok: Path, steps: int, spec: dict[str, Any],
                 model: dict[str, Any] | None, param_path: Path | None, seed: int) -> dict[str, Any]:
    stage = out / kind
    config: dict[str, Any] = {
        "data": {"train_type": "seq" if kind == "pretrain" else "sft", "data_path": str(data),
                 "tokenizer_path": str(tok), "max_seq_len": spec["max_seq_len"]},
        "train": {"max_steps": steps, "n_epoch": 1000, "batch_per_device": spec["batch"],
                  "random_seed": seed, "param_path": str(param_path) if param_path else None},
        "optim": {"max_lr": spec["max_lr"], "schedule": "cosine", "warmup_ratio": 0.05,
                  "min_lr_ratio": 0.1, "weight_decay": 0.0},
        # an unfinished stage (no stage.json) reruns from scratch over what it left in its ckpt_dir
        "ckpt": {"ckpt_dir": str(stage / "ckpt"), "ckpt_interval": 0, "keep_last": 1, "overwrite_ckpt_dir": True},
        "log": {"log_dir": str(stage), "summary_hints": False},
    }
    if model is not None:
        config["model"] = model
    return config


def rl_config(out: Path, algo: str, data: Path, tok: Path, steps: int, param_path: Path,
              seed: int) -> dict[str, Any]:
    train_type, group_size, lr = ALGOS[algo]
    stage = out / f"rl-{algo}"
    return {
        "data": {"train_type": train_type, "data_path": str(data), "tokenizer_path": str(tok)},
        "train": {"max_steps": steps, "n_epoch": 1000, "batch_per_device": RL["prompts"], "random_seed": seed,
                  "param_path": str(param_path)},
        "optim": {"max_lr": lr, "schedule": "constant", "warmup_steps": RL["warmup_steps"], "weight_decay": 0.0},
        "rl": {"group_size": group_size, "rollout_interval": RL["rollout_interval"],
               "rollout_max_tokens": RL["max_tokens"], "rollout_temperature": 1.0, "max_prompt_len": 32,
               "kl_coef": 0.0, "rewards": ["exact_match"]},
        # an unfinished stage (no stage.json) reruns from scratch over what it left in its ckpt_dir
        "ckpt": {"ckpt_dir": str(stage / "ckpt"), "ckpt_interval": 0, "keep_last": 1, "overwrite_ckpt_dir": True},
        "log": {"log_dir": str(stage), "summary_hints": False},
    }


def rl_stage(stage_dir: Path, config: dict[str, Any], eval_path: Path) -> dict[str, Any]:
    info = train_stage(stage_dir, config)
    info.update(rl_curves(stage_dir / "metrics.jsonl"))
    info["eval"] = evaluate(stage_dir / "final", eval_path, TASK["num_eval"])
    return info


def evaluate(model_dir: Path, eval_path: Path, limit: int) -> dict[str, Any]:
    from astrai.eval import evaluate_model, read_prompt_records
    from astrai.infer.llm import LLM

    result = evaluate_model(LLM(str(model_dir)), read_prompt_records(eval_path, limit), max_tokens=8)
    return {"accuracy": result.accuracy, "num_correct": result.num_correct, "num_total": result.num_total,
            "tokens_per_s": round(result.tokens_per_s, 1), "samples": result.samples}


def write_report(out: Path, stages: dict[str, dict[str, Any]], scale: float, algo: str) -> Path:
    rl_name = f"rl-{algo}"
    before, sft, rl = stages["eval"]["pretrained"], stages["eval"]["sft"], stages[rl_name]
    after = rl["eval"]
    lines = [
        "# astrai demo report", "",
        f"Task: {TASK['digits']}-digit addition, exact match on {sft['num_total']} held-out problems "
        f"(greedy, batched through the engine). RL: {ALGOS[algo][0]}. Steps: --scale {scale:g} "
        f"(multiplies every stage's steps; 1 is the default; the run time is Total below).", "",
        "![accuracy per stage](accuracy.png)", "",
        "| model | accuracy | correct |", "|---|---|---|",
        f"| pre-trained | {before['accuracy']:.1%} | {before['num_correct']}/{before['num_total']} |",
        f"| after SFT | {sft['accuracy']:.1%} | {sft['num_correct']}/{sft['num_total']} |",
        f"| after RL ({algo}) | {after['accuracy']:.1%} | {after['num_correct']}/{after['num_total']} |", "",
        "| stage | seconds | steps | loss first -> last | train tokens/s |", "|---|---|---|---|---|",
    ]
    for name in ("data", "tokenizer", "pretrain", "sft", "eval", rl_name):
        s = stages[name]
        loss = f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}" if "final_loss" in s else ""
        lines.append(f"| {name} | {s.get('seconds', '')} | {s.get('steps', '')} | {loss} | "
                     f"{s.get('tokens_per_s', '')} |")
    total = sum(s.get("seconds", 0.0) for s in stages.values())
    lines += ["", f"Total: {total / 60:.1f} min (stages reused from an earlier run count their first time).", ""]
    if "reward_first" in rl:
        k = rl["curve_window"]
        lines += [f"RL rollouts (means of the first and last {k} steps): reward {rl['reward_first']:.3f} -> "
                  f"{rl['reward_last']:.3f}, response length {rl['length_first']:.2f} -> {rl['length_last']:.2f} "
                  f"tokens; rollout generation {rl['rollout_tokens_per_s']} tokens/s (median over rollouts).", "",
                  f"![reward]({rl_name}/plots/reward_mean.png) "
                  f"![response length]({rl_name}/plots/response_length_mean.png)", ""]
    lines += [f"Generation throughput during eval: {sft['tokens_per_s']} tokens/s.", "",
              f"Samples after RL ({algo}):", ""]
    lines += [f"- `{s['prompt']}` -> `{s['completion']}` (answer {s['answer']})" for s in after["samples"]]
    lines += ["", f"Training curves: `pretrain/plots/`, `sft/plots/`, `{rl_name}/plots/` (reward_mean, "
              "response_length_mean, rollout_tokens_per_s, ...).", "",
              f"Run pages (curves, the RL samples, config, checkpoints; one HTML file each, no server): "
              f"[pretrain](pretrain/report.html), [sft](sft/report.html), [{rl_name}]({rl_name}/report.html).", "",
              f"Serve the result: `astrai serve --model {out / rl_name / 'final'}`", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output folder (default out/demo; out/demo-tools for --algo tools)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies every stage's training steps (default 1: the documented run; each stage "
                             "keeps a floor of steps)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="deprecated: it was a step budget, not a clock; --minutes M is --scale M/8")
    parser.add_argument("--algo", choices=[*ALGOS, "tools"], default="grpo",
                        help="the RL stage: online GRPO (default), PPO with a critic, or online DPO; `tools`: "
                             "another demo, a calculator tool learned by multi-turn online GRPO")
    parser.add_argument("--quick", action="store_true",
                        help="with --algo tools: the shortened configuration the test suite runs (fewer SFT and RL "
                             "steps at a higher SFT learning rate; smaller gains than the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async_steps", type=int, default=0,
                        help="also run the RL stage with rollouts drawn this many steps ahead on a second thread "
                             "(rl.async_steps); the report plots both reward curves against wall-clock time")
    parser.add_argument("--num_threads", "--threads", type=int, default=1, dest="threads",
                        help="torch intra-op threads (default 1: this tiny model runs fastest, and the same, on one)")
    args = parser.parse_args(argv)
    args.out = args.out or ("out/demo-tools" if args.algo == "tools" else "out/demo")
    if args.minutes is not None:
        if args.minutes <= 0:
            parser.error(f"--minutes must be positive, got {args.minutes}")
        args.scale = args.minutes / BUDGET_MINUTES
        print(f"astrai demo: --minutes is a step budget, not a clock, and is deprecated; "
              f"use --scale {args.scale:g} (the same steps)", file=sys.stderr)
    if args.scale <= 0:
        parser.error(f"--scale must be positive, got {args.scale:g}")
    if args.quick and args.algo != "tools":
        parser.error(f"--quick is a setting of --algo tools, not of --algo {args.algo}; drop --quick or add --algo tools")
    if args.async_steps < 0 or (args.async_steps and args.algo == "tools"):
        parser.error(f"--async_steps must be >= 0 and goes with --algo grpo, ppo or online_dpo, got {args.async_steps} "
                     f"with --algo {args.algo}")
    if args.threads < 1:
        parser.error(f"--num_threads must be >= 1, got {args.threads}")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.algo == "tools":
            from astrai.demo_tools import run_tools_demo

            return run_tools_demo(args)
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def sft_stages(out: Path, scale: float = 1.0, seed: int = 0, log: Any = print) -> dict[str, dict[str, Any]]:
    """The stages before RL (data, tokenizer, pre-training, SFT, their held-out eval), each reused
    when done: the SFT'd model is `out/sft/final`, its prompts `out/data/prompts.jsonl`.
    benchmarks/compare_trl.py starts from the same model."""
    from astrai.data.tasks import write_task_files
    from astrai.data.tokenizer_training import train_tokenizer

    data_dir, tok_dir = out / "data", out / "tokenizer"
    stages: dict[str, dict[str, Any]] = {}
    stages["data"] = run_stage("data", data_dir, lambda: {
        k: str(v) for k, v in write_task_files(data_dir, tasks=("add",), seed=seed, **TASK).items()}, log)

    def tokenizer_stage() -> dict[str, Any]:
        corpus = [json.loads(line)["text"] for line in (data_dir / "corpus.jsonl").read_text().splitlines()]
        # chat_roles: the role names become tokens, as `astrai tokenizer train --chat_roles` makes them
        tok = train_tokenizer(corpus, MODEL["vocab_size"], tok_dir, chat_roles=True)
        return {"vocab_size": tok.vocab_size}

    stages["tokenizer"] = run_stage("tokenizer", tok_dir, tokenizer_stage, log)
    model = dict(MODEL, vocab_size=stages["tokenizer"]["vocab_size"])
    pre_cfg = stage_config("pretrain", out, data_dir / "corpus.jsonl", tok_dir,
                           max(20, int(PRETRAIN["steps"] * scale)), PRETRAIN, model, None, seed)
    stages["pretrain"] = run_stage("pretrain", out / "pretrain", lambda: train_stage(out / "pretrain", pre_cfg), log)
    sft_cfg = stage_config("sft", out, data_dir / "sft.jsonl", tok_dir, max(20, int(SFT["steps"] * scale)),
                           SFT, None, out / "pretrain" / "final", seed)
    stages["sft"] = run_stage("sft", out / "sft", lambda: train_stage(out / "sft", sft_cfg), log)
    stages["eval"] = run_stage("eval", out / "eval", lambda: {
        "pretrained": evaluate(out / "pretrain" / "final", data_dir / "eval.jsonl", TASK["num_eval"]),
        "sft": evaluate(out / "sft" / "final", data_dir / "eval.jsonl", TASK["num_eval"])}, log)
    return stages


def _run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    scale = args.scale

    def log(msg: str) -> None:
        print(msg, flush=True)

    stages = sft_stages(out, scale, args.seed, log)
    data_dir, tok_dir = out / "data", out / "tokenizer"
    rl_name = f"rl-{args.algo}"
    rl_cfg = rl_config(out, args.algo, data_dir / "prompts.jsonl", tok_dir, max(10, int(RL["steps"] * scale)),
                       out / "sft" / "final", args.seed)
    stages[rl_name] = run_stage(rl_name, out / rl_name,
                                lambda: rl_stage(out / rl_name, rl_cfg, data_dir / "eval.jsonl"), log)

    if args.async_steps:  # the same RL stage with its rollouts drawn ahead, for the wall-clock comparison
        async_name = f"{rl_name}-async{args.async_steps}"
        async_cfg = rl_config(out, args.algo, data_dir / "prompts.jsonl", tok_dir, rl_cfg["train"]["max_steps"],
                              out / "sft" / "final", args.seed)
        async_cfg["rl"]["async_steps"] = args.async_steps
        async_cfg["rl"]["max_policy_lag"] = (args.async_steps + 1) * RL["rollout_interval"] - 1
        for section, key in (("ckpt", "ckpt_dir"), ("log", "log_dir")):
            async_cfg[section][key] = async_cfg[section][key].replace(rl_name, async_name)
        stages[async_name] = run_stage(async_name, out / async_name,
                                       lambda: rl_stage(out / async_name, async_cfg, data_dir / "eval.jsonl"), log)
        plot_against_time(out, {f"{rl_name} (synchronous)": out / rl_name / "metrics.jsonl",
                                f"{async_name} (async_steps {args.async_steps})": out / async_name / "metrics.jsonl"})

    accuracies = {"pre-trained": stages["eval"]["pretrained"]["accuracy"], "SFT": stages["eval"]["sft"]["accuracy"],
                  f"RL ({args.algo})": stages[rl_name]["eval"]["accuracy"]}
    plot_accuracy(out, accuracies)
    report = write_report(out, stages, args.scale, args.algo)
    if args.async_steps:
        a, b = stages[rl_name], stages[async_name]
        with report.open("a") as f:
            f.write(f"\n## async_steps {args.async_steps}\n\nThe same RL stage with its rollouts drawn "
                    f"{args.async_steps} step(s) ahead on a second thread: {b['seconds']} s against {a['seconds']} s "
                    f"synchronous; held-out accuracy {b['eval']['accuracy']:.1%} against {a['eval']['accuracy']:.1%}; "
                    f"reward {b.get('reward_first', 0):.3f} -> {b.get('reward_last', 0):.3f} against "
                    f"{a.get('reward_first', 0):.3f} -> {a.get('reward_last', 0):.3f}.\n\n"
                    "![reward against wall-clock time](reward_mean_vs_time.png)\n")
    log("\naccuracy: " + " -> ".join(f"{k} {v:.1%}" for k, v in accuracies.items()))
    log(f"report: {report}")
    log(f"serve it: astrai serve --model {out / rl_name / 'final'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
