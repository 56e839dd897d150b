"""`astrai demo --algo tools`: a tiny model learns by online RL to call a calculator tool, on CPU.

Stages, each reused when a re-run finds it finished (as in `astrai demo`):
  data      2-digit multiplication (astrai.data.tasks.write_tool_task_files): SFT conversations
            that offer a `multiply` tool, 70% of them calling it and answering with its result,
            the rest answering at once; RL prompts; held-out eval prompts;
  tokenizer a byte-level BPE trained on the rendered conversations (the tool's schema included);
  sft       a tiny model trained from scratch on the conversations: it learns both ways of
            answering, and samples each about as often as it saw it; a model this small cannot
            multiply in its head, so only the tool way is right (it copies the tool's result);
  eval      held-out accuracy and tool-use rate of the SFT model: multi-turn episodes through the
            engine (the model's tool calls run, their results go back as `tool` messages), greedy
            and sampled (temperature 1, the rollouts' policy);
  rl-tools  online GRPO with the built-in environment `CalculatorEnv` (episodes of up to 3 turns,
            `exact_match` on the final answer): episodes that call the tool earn the reward, so the
            sampled policy's tool-use rate and accuracy rise (greedy decoding already calls the
            tool: the call is its single most likely first token); then the same eval;
and a markdown report (`report.md`) with the curves and the samples.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from astrai.demo_stages import plot_accuracy, rl_curves, run_stage, train_stage

ENVIRONMENT = "astrai.train.rl.environments:CalculatorEnv"
MODEL = {  # ~150k parameters; 3 layers: with 2, copying the tool's result emerged for some seeds only
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True,
}
# 2-digit factors (products up to 4 digits); 70% of the SFT conversations call the tool (at 50%, copying
# the result was not learned for some seeds)
TASK = {"digits": 2, "num_traces": 1000, "tool_share": 0.7, "num_prompts": 3000, "num_eval": 100}
VOCAB_SIZE = 440  # what BPE reaches on the rendered conversations (fewer are kept if it stops earlier)
# 3,000 SFT steps: copying the tool's result is learned abruptly, between steps 700 and 2,300 in 7
# measured runs; 2,000 left some runs short of it (docs/performance.md, "The calculator demo")
SFT = {"steps": 3000, "batch": 16, "max_seq_len": 256, "max_lr": 3e-3}
RL = {"steps": 40, "prompts": 32, "group_size": 8, "rollout_interval": 2, "max_tokens": 40, "max_turns": 3,
      "max_lr": 5e-4, "warmup_steps": 3}
EVAL = {"max_tokens": 40, "max_prompt_len": 160, "samples": 4}  # samples per prompt at temperature 1
# `--quick`: the test suite's shortened configuration (tests/test_demo_tools.py), what differs from the
# above: 1,500 SFT steps at a higher learning rate (copying the tool's result emerged between steps 700
# and 950 in the measured runs; 1,200 left one run short of it) and 10 RL steps of 16 prompts
QUICK = {"sft": {"steps": 1500, "max_lr": 1e-2}, "rl": {"steps": 10, "prompts": 16, "max_lr": 1e-3}}


def demo_settings(quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (SFT, RL) settings of a run: the demo's, or with `quick` the shortened ones."""
    return ({**SFT, **QUICK["sft"]}, {**RL, **QUICK["rl"]}) if quick else (SFT, RL)


def data_stage(data_dir: Path, seed: int) -> dict[str, Any]:
    from astrai.data.tasks import write_tool_task_files

    return {k: str(v) for k, v in write_tool_task_files(data_dir, seed=seed, **TASK).items()}


def tokenizer_stage(data_dir: Path, tok_dir: Path) -> dict[str, Any]:
    """BPE on the SFT conversations as the chat template renders them (the tool schema in the
    system turn), so the template's words and the schema's keys become tokens."""
    from astrai.data.tokenizer_training import train_tokenizer

    records = [json.loads(line) for line in (data_dir / "sft.jsonl").read_text().splitlines()[:300]]
    renderer = train_tokenizer(["multiply"], 300, None, chat_roles=True)  # any tokenizer renders the template
    texts = [renderer.render_chat(r["messages"], tools=r["tools"]) for r in records]
    tok = train_tokenizer(texts, VOCAB_SIZE, tok_dir, chat_roles=True)
    return {"vocab_size": tok.vocab_size}


def episode_eval(model_dir: Path, eval_path: Path, temperature: float, samples: int, seed: int = 0) -> dict[str, Any]:
    """Held-out multi-turn episodes with the calculator, through evaluation's path
    (``astrai.train.evaluation.answer``: the rollouts' episode runner, no training): exact-match
    accuracy of the final answer, the share of episodes that called the tool, and tool calls,
    errors and turns per episode. `samples` episodes per prompt, seeded as step 0's rollouts."""
    from astrai.config import RLConfig
    from astrai.data.tokenizer import load_tokenizer
    from astrai.model.hf import load_model
    from astrai.train.evaluation import answer
    from astrai.train.rl.engine_sampler import engine_runner
    from astrai.train.rl.rewards import RewardSet
    from astrai.train.rl.runner import Draw, rollout_seed

    records = [json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()]
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    cfg = RLConfig(group_size=samples, rollout_max_tokens=EVAL["max_tokens"], max_prompt_len=EVAL["max_prompt_len"],
                   rollout_temperature=temperature, environment=ENVIRONMENT, max_turns=RL["max_turns"],
                   rewards=["exact_match"])
    runner = engine_runner(model, tok, cfg, len(records) * samples, RewardSet(cfg, tokenizer=tok))
    draw = Draw(runner.sampling, samples, lambda i, *more: rollout_seed(seed, 0, i, *more))
    prompt_ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
    [result] = answer(runner, records, prompt_ids, [draw], policy_version=0)
    n = len(result.correct)
    stats = result.stats()
    return {"accuracy": round(sum(result.correct) / n, 4), "num_correct": int(sum(result.correct)), "num_total": n,
            "tool_use": round(stats["tool_use_rate"], 4),
            "tool_calls_per_episode": round(stats["tool_calls_per_episode"], 3),
            "tool_errors": int(stats["tool_errors"]), "turns_per_episode": round(stats["turns_per_episode"], 3),
            "samples": [{"prompt": r["messages"][-1]["content"], "answer": r["answer"], "completion": e.final_text}
                        for r, e in zip(records[:5], result.episodes[::samples][:5])]}


def evaluate_both(model_dir: Path, eval_path: Path, seed: int) -> dict[str, Any]:
    return {"greedy": episode_eval(model_dir, eval_path, 0.0, 1, seed),
            "sampled": episode_eval(model_dir, eval_path, 1.0, EVAL["samples"], seed)}


def sft_config(out: Path, tok_dir: Path, vocab_size: int, steps: int, seed: int,
               sft: dict[str, Any] = SFT) -> dict[str, Any]:
    return {
        "model": dict(MODEL, vocab_size=vocab_size),
        "data": {"train_type": "sft", "data_path": str(out / "data" / "sft.jsonl"), "tokenizer_path": str(tok_dir),
                 "max_seq_len": sft["max_seq_len"]},
        "train": {"max_steps": steps, "n_epoch": 1000, "batch_per_device": sft["batch"], "random_seed": seed},
        "optim": {"max_lr": sft["max_lr"], "schedule": "cosine", "warmup_ratio": 0.05, "min_lr_ratio": 0.1,
                  "weight_decay": 0.0},
        # an unfinished stage (no stage.json) reruns from scratch over what it left in its ckpt_dir
        "ckpt": {"ckpt_dir": str(out / "sft" / "ckpt"), "ckpt_interval": 0, "keep_last": 1, "overwrite_ckpt_dir": True},
        "log": {"log_dir": str(out / "sft"), "summary_hints": False},
    }


def rl_config(out: Path, tok_dir: Path, steps: int, seed: int, rl: dict[str, Any] = RL) -> dict[str, Any]:
    stage = out / "rl-tools"
    return {
        "data": {"train_type": "online_grpo", "data_path": str(out / "data" / "prompts.jsonl"),
                 "tokenizer_path": str(tok_dir)},
        "train": {"max_steps": steps, "n_epoch": 1000, "batch_per_device": rl["prompts"], "random_seed": seed,
                  "param_path": str(out / "sft" / "final")},
        "optim": {"max_lr": rl["max_lr"], "schedule": "constant", "warmup_steps": rl["warmup_steps"], "weight_decay": 0.0},
        "rl": {"group_size": rl["group_size"], "rollout_interval": rl["rollout_interval"],
               "rollout_max_tokens": rl["max_tokens"], "rollout_temperature": 1.0,
               "max_prompt_len": EVAL["max_prompt_len"], "kl_coef": 0.0, "rewards": ["exact_match"],
               "environment": ENVIRONMENT, "max_turns": rl["max_turns"]},
        "ckpt": {"ckpt_dir": str(stage / "ckpt"), "ckpt_interval": 0, "keep_last": 1, "overwrite_ckpt_dir": True},
        "log": {"log_dir": str(stage), "summary_hints": False},
    }


def run_tools_demo(args: argparse.Namespace) -> int:
    """`astrai demo --algo tools` (args: out, scale, seed, quick; threads are set by the caller)."""
    out, scale = Path(args.out), args.scale
    sft_settings, rl_settings = demo_settings(args.quick)
    data_dir, tok_dir = out / "data", out / "tokenizer"

    def log(msg: str) -> None:
        print(msg, flush=True)

    stages: dict[str, dict[str, Any]] = {}
    stages["data"] = run_stage("data", data_dir, lambda: data_stage(data_dir, args.seed), log)
    stages["tokenizer"] = run_stage("tokenizer", tok_dir, lambda: tokenizer_stage(data_dir, tok_dir), log)
    sft = sft_config(out, tok_dir, stages["tokenizer"]["vocab_size"], max(50, int(sft_settings["steps"] * scale)),
                     args.seed, sft_settings)
    stages["sft"] = run_stage("sft", out / "sft", lambda: train_stage(out / "sft", sft), log)
    eval_path = data_dir / "eval.jsonl"
    stages["eval"] = run_stage("eval", out / "eval", lambda: evaluate_both(out / "sft" / "final", eval_path, args.seed),
                               log)
    rl = rl_config(out, tok_dir, max(10, int(rl_settings["steps"] * scale)), args.seed, rl_settings)

    def rl_stage() -> dict[str, Any]:
        info = train_stage(out / "rl-tools", rl)
        info.update(rl_curves(out / "rl-tools" / "metrics.jsonl"))
        info["eval"] = evaluate_both(out / "rl-tools" / "final", eval_path, args.seed)
        return info

    stages["rl-tools"] = run_stage("rl-tools", out / "rl-tools", rl_stage, log)
    before, after = stages["eval"], stages["rl-tools"]["eval"]
    plot_accuracy(out, {"SFT": before["greedy"]["accuracy"], "RL (tools)": after["greedy"]["accuracy"]})
    report = write_report(out, stages, args.scale, args.quick)
    log("\n" + summary_line(before, after))
    log(f"report: {report}")
    log(f"serve it: astrai serve --model {out / 'rl-tools' / 'final'}")
    return 0


def summary_line(before: dict[str, Any], after: dict[str, Any]) -> str:
    g0, g1, s0, s1 = before["greedy"], after["greedy"], before["sampled"], after["sampled"]
    return (f"held-out accuracy (greedy): SFT {g0['accuracy']:.1%} -> RL {g1['accuracy']:.1%}; tool use "
            f"{g0['tool_use']:.0%} -> {g1['tool_use']:.0%}. Sampled (temperature 1): accuracy {s0['accuracy']:.1%} -> "
            f"{s1['accuracy']:.1%}, tool use {s0['tool_use']:.0%} -> {s1['tool_use']:.0%}")


def write_report(out: Path, stages: dict[str, dict[str, Any]], scale: float, quick: bool = False) -> Path:
    before, rl = stages["eval"], stages["rl-tools"]
    after = rl["eval"]
    n = before["greedy"]["num_total"]
    lines = [
        "# astrai demo report: a calculator tool", "",
        f"Task: {TASK['digits']}-digit multiplication with a `multiply` tool, exact match of the final answer on {n} "
        f"held-out problems, multi-turn episodes of up to {RL['max_turns']} turns through the engine. SFT on "
        f"{TASK['num_traces']} conversations, {TASK['tool_share']:.0%} of them calling the tool; RL: online GRPO with "
        f"`{ENVIRONMENT}`. Steps: --scale {scale:g} (default 1)"
        f"{'; --quick: the shortened configuration of the test suite' if quick else ''}.", "",
        "![accuracy per stage](accuracy.png)", "",
        "| model | decoding | accuracy | tool use | tool calls / episode | tool errors |", "|---|---|---|---|---|---|",
    ]
    for name, result in (("after SFT", before), ("after RL", after)):
        for mode in ("greedy", "sampled"):
            r = result[mode]
            label = "greedy" if mode == "greedy" else f"temperature 1, {EVAL['samples']} per problem"
            lines.append(f"| {name} | {label} | {r['accuracy']:.1%} ({r['num_correct']}/{r['num_total']}) | "
                         f"{r['tool_use']:.0%} | {r['tool_calls_per_episode']:.2f} | {r['tool_errors']} |")
    lines += ["", "| stage | seconds | steps | loss first -> last |", "|---|---|---|---|"]
    for name in ("data", "tokenizer", "sft", "eval", "rl-tools"):
        s = stages[name]
        loss = f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}" if "final_loss" in s else ""
        lines.append(f"| {name} | {s.get('seconds', '')} | {s.get('steps', '')} | {loss} |")
    total = sum(s.get("seconds", 0.0) for s in stages.values())
    lines += ["", f"Total: {total / 60:.1f} min (stages reused from an earlier run count their first time).", ""]
    if "reward_first" in rl:
        lines += [f"RL rollouts (means of the first and last {rl['curve_window']} steps): reward {rl['reward_first']:.3f} "
                  f"-> {rl['reward_last']:.3f}, tool use {rl.get('tool_use_first', 0):.0%} -> "
                  f"{rl.get('tool_use_last', 0):.0%}.", "",
                  "![reward](rl-tools/plots/reward_mean.png) ![tool use](rl-tools/plots/tool_use_rate.png)", ""]
    lines += ["Greedy answers after RL:", ""]
    lines += [f"- `{s['prompt']}` -> `{s['completion']}` (answer {s['answer']})" for s in after["greedy"]["samples"]]
    lines += ["", "Run pages (curves, the RL samples with their tool calls, config, checkpoints; one HTML file each, no "
              "server): [sft](sft/report.html), [rl-tools](rl-tools/report.html).", "",
              f"Serve the result: `astrai serve --model {out / 'rl-tools' / 'final'}`", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
