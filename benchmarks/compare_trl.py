"""astrai vs TRL on one workload: online GRPO (GRPOTrainer), online RLOO (RLOOTrainer) and offline DPO
(DPOTrainer), side by side.

The workload is the demo's (`astrai demo`): a tiny Llama-shaped model (2 layers, hidden 64) is
pre-trained briefly and SFT'd by astrai on 1-digit addition chats (`astrai.data.tasks`), which
leaves its greedy held-out accuracy well below 100%; that model directory (HF format) is the
start of every run. TRL's settings are in `trl_common` (`grpo_config`, `rloo_config`,
`dpo_config`); neither side checkpoints activations.
GRPO: the same training prompts, prompts per step, group size, max new tokens, temperature 1,
`exact_match` reward, AdamW at a constant rate after the same warmup, clipping 1.0, no KL,
token-mean loss, group-std advantages, one optimizer step per rollout.
RLOO: the GRPO settings with leave-one-out advantages r_i - mean_{j != i} r_j, not scaled
(astrai `--advantage_estimator rloo`; TRL `beta=0.0`, `normalize_advantages=False`). TRL's RLOO
loss is per sequence (each token weighs 1/num_sequences) where astrai's is token-mean (1/num_tokens):
the same direction on-policy, a scale that differs by the mean completion length (see
`trl_common.rloo_config`).
DPO: the same (chosen = the answer, rejected = a near miss) pairs, pairs per step, beta 0.1,
sigmoid loss, learning rate and steps.

Each run is its own subprocess (one intra-op thread by default), so its peak memory is its own:
peak RSS of the process and its rise during training (peak minus the peak before the first step).
Per run: seconds per step (median, first step skipped), rollout tokens/s (GRPO: new tokens / time
inside the generation call), and held-out greedy exact-match accuracy, scored by the same
evaluator (`astrai.eval`) on problems no run trains on, (a) after the same number of steps
and (b) after the same wall-clock budget: TRL runs first and its training time for the steps is
the budget; astrai's run stops at whichever comes later, the steps or the budget, and keeps a
snapshot at each (snapshot time is not counted). Prints a markdown table, a column per run.

    .venv/bin/python benchmarks/compare_trl.py [--quick] [--runs grpo,rloo,dpo] [--steps N] [--prompts B]
        [--group_size G]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from trl_common import (  # noqa: E402
    StepClock,
    dpo_config,
    exact_match,
    grpo_config,
    prompt_dataset,
    rloo_config,
    time_generation,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PAIRS = ("grpo", "rloo", "dpo")  # a run is f"{system}_{pair}"; TRL runs first: its time is the budget
ONLINE = ("grpo", "rloo")
TRL_TRAINERS = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer", "dpo": "DPOTrainer"}


def peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    return kb / (1024 * 1024) if sys.platform == "darwin" else kb / 1024


def prepare(work: Path, args: argparse.Namespace) -> Path:
    """Task files, tokenizer and the SFT'd start model: the demo's stages before RL (`astrai demo`
    pre-trains briefly, then SFTs to well below 100% held-out, so RL has room to improve)."""
    from astrai.demo import sft_stages

    with (work / "prepare.log").open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        sft_stages(work / "demo", scale=args.sft_scale, seed=args.seed, log=print)
    shutil.copytree(work / "demo" / "sft" / "final", work / "start")
    shutil.copytree(work / "demo" / "data", work / "data")
    return work / "start"


class Run:
    """Clock, snapshots and stop rule of one worker: a snapshot at `steps` and at the budget."""

    def __init__(self, work: Path, name: str, steps: int, budget_s: float):
        self.out, self.steps, self.budget_s = work / name, steps, budget_s
        self.clock, self.paused, self.snapshots = StepClock(), 0.0, {}
        self.rss_before = 0.0

    def begin(self) -> None:
        self.rss_before = peak_rss_mb()
        self.clock.start()

    def elapsed(self) -> float:
        return self.clock.elapsed - self.paused

    def step_end(self, step: int, save: Any) -> bool:
        """Record the step; save snapshots (not timed); True when the run should stop."""
        self.clock.tick()
        marks = [m for m in ("steps", "budget") if m not in self.snapshots and
                 (step >= self.steps if m == "steps" or self.budget_s <= 0 else self.elapsed() >= self.budget_s)]
        if marks:
            start = time.perf_counter()
            path = self.out / f"snapshot_{step}"
            if not path.exists():
                save(path)
            self.paused += time.perf_counter() - start
            for m in marks:
                self.snapshots[m] = {"step": step, "path": str(path), "seconds": round(self.elapsed(), 2)}
        return "steps" in self.snapshots and "budget" in self.snapshots

    def result(self) -> dict[str, Any]:
        peak = peak_rss_mb()
        return {**self.clock.summary(), "peak_rss_mb": peak, "rss_rise_mb": peak - self.rss_before,
                "train_seconds": round(self.elapsed(), 2), "snapshots": self.snapshots}


def pair_of(name: str) -> str:
    return name.split("_")[1]


def astrai_flags(start: Path, work: Path, name: str, args: argparse.Namespace) -> list[str]:
    grpo = pair_of(name) in ONLINE  # rloo is online_grpo with another advantage estimator
    flags = {"train_type": "online_grpo" if grpo else "dpo", "param_path": start, "device": "cpu",
             "data_path": work / "data" / ("prompts.jsonl" if grpo else "dpo.jsonl"),
             "batch_per_device": args.prompts if grpo else args.pairs, "max_steps": 100_000, "n_epoch": 100_000,
             "max_lr": args.lr if grpo else args.dpo_lr, "schedule": "constant", "warmup_steps": args.warmup,
             "max_grad_norm": 1.0, "weight_decay": 0.0, "random_seed": args.seed,
             "ckpt_dir": work / name / "ckpt", "ckpt_interval": 0, "keep_last": 1, "log_dir": work / name,
             "progress": False}
    if grpo:
        flags.update(group_size=args.group_size, rollout_max_tokens=args.max_tokens, rollout_temperature=1.0,
                     rollout_interval=1, kl_coef=0.0, clip_eps=0.2, rl_loss_agg="token_mean", max_prompt_len=32,
                     advantage_estimator=pair_of(name))
    else:
        flags.update(beta=0.1, loss_type="sigmoid", max_seq_len=32)
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def worker_astrai(start: Path, work: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    from astrai.config import load_config
    from astrai.model.hf import save_model
    from astrai.train.rl.loop import OnlineLoop
    from astrai.train.trainer import Trainer

    run = Run(work, name, args.steps, args.budget_s)
    grpo = pair_of(name) in ONLINE

    class Hook:
        requested_metrics = frozenset()

        def on_train_begin(self, loop: Any) -> None:
            run.begin()

        def after_optimizer_step(self, loop: Any) -> None:
            if grpo:
                run.clock.rollout_seconds.append(loop.step_metrics.get("rollout_seconds", 0.0))
                run.clock.rollout_tokens.append(int(loop.step_metrics.get("rollout_tokens", 0)))
            if run.step_end(loop.ctx.step, lambda p: save_model(loop.raw_model, p, tokenizer=loop.tokenizer)):
                loop.ctx.request_stop("compare_trl: steps and budget reached")

    cfg = load_config(None, astrai_flags(start, work, name, args))
    (OnlineLoop if grpo else Trainer)(cfg, callbacks=[Hook()]).train()
    return run.result()


def worker_trl(start: Path, work: Path, name: str, args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback

    run = Run(work, name, args.steps, args.budget_s)
    pair = pair_of(name)

    def save(model: Any, path: Path) -> None:
        model.save_pretrained(path)
        for f in TOKENIZER_FILES:  # astrai's own tokenizer files, so both sides are scored alike
            shutil.copy2(start / f, path / f)

    class Hook(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            run.begin()

        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **k: Any) -> None:
            if run.step_end(state.global_step, lambda p: save(model, p)):
                control.should_training_stop = True

    model = LlamaForCausalLM.from_pretrained(start, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(start)
    if pair in ONLINE:
        from trl import GRPOTrainer, RLOOTrainer

        make_config, trainer_cls = (grpo_config, GRPOTrainer) if pair == "grpo" else (rloo_config, RLOOTrainer)
        config = make_config(run.out, steps=100_000, prompts=args.prompts, group_size=args.group_size,
                             max_tokens=args.max_tokens, lr=args.lr, warmup_steps=args.warmup, seed=args.seed)
        trainer = trainer_cls(model=model, reward_funcs=exact_match, args=config,
                              train_dataset=prompt_dataset(work / "data" / "prompts.jsonl"),
                              processing_class=tokenizer, callbacks=[Hook()])
        time_generation(trainer, run.clock)
    else:
        from trl import DPOTrainer

        pairs = [json.loads(line) for line in (work / "data" / "dpo.jsonl").read_text().splitlines()]
        config = dpo_config(run.out, steps=100_000, pairs=args.pairs, lr=args.dpo_lr, warmup_steps=args.warmup,
                            seed=args.seed, max_length=32)
        trainer = DPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(pairs),
                             processing_class=tokenizer, callbacks=[Hook()])
    trainer.train()
    return run.result()


def accuracy(model_dir: str, eval_path: Path) -> float:
    from astrai.eval import evaluate_model, read_prompt_records
    from astrai.infer.llm import LLM

    return evaluate_model(LLM(model_dir), read_prompt_records(eval_path), max_tokens=8).accuracy


def fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(results: dict[str, dict[str, Any]], start_acc: float, num_eval: int, args: argparse.Namespace) -> str:
    online = f"{args.prompts} prompts x {args.group_size} completions, max {args.max_tokens} new tokens, lr {args.lr}"
    parts = {"grpo": f"GRPO: {online}, group-std advantages",
             "rloo": f"RLOO: {online}, unscaled leave-one-out advantages",
             "dpo": f"DPO: {args.pairs} pairs, beta 0.1, lr {args.dpo_lr}"}
    order = [f"{system}_{pair}" for pair in args.runs for system in ("astrai", "trl")]
    names = [f"astrai {pair_of(n).upper()}" if n.startswith("astrai") else f"TRL {TRL_TRAINERS[pair_of(n)]}"
             for n in order]
    lines = [f"Start: the demo's 2-layer, hidden-64 model, pre-trained and SFT'd on 1-digit addition; held-out "
             f"greedy exact match {start_acc:.1%} on {num_eval} problems. "
             + "; ".join(parts[p] for p in args.runs)
             + f". {args.steps} steps each; {args.threads} thread(s), CPU fp32.", "",
             "| metric | " + " | ".join(names) + " |", "|---" * (len(order) + 1) + "|"]

    def row(label: str, get: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(get(results[n]) for n in order) + " |")

    row("seconds per step", lambda r: fmt(r.get("step_s"), ".3f"))
    row("rollout tokens/s", lambda r: fmt(r.get("tokens_per_s"), ".0f"))
    row("peak RSS (MB)", lambda r: fmt(r.get("peak_rss_mb"), ".0f"))
    row("RSS rise in training (MB)", lambda r: fmt(r.get("rss_rise_mb"), ".0f"))
    row(f"held-out accuracy after {args.steps} steps", lambda r: fmt(r["snapshots"]["steps"]["accuracy"], ".1%"))
    row("training seconds for those steps", lambda r: fmt(r["snapshots"]["steps"]["seconds"], ".1f"))
    for pair in args.runs:
        budget = results[f"trl_{pair}"]["snapshots"]["steps"]["seconds"]
        lines.append(f"| {pair.upper()} budget {budget:.1f} s: steps done | " + " | ".join(
            str(results[n]["snapshots"]["budget"]["step"]) if pair_of(n) == pair else "" for n in order) + " |")
        lines.append(f"| {pair.upper()} budget {budget:.1f} s: held-out accuracy | " + " | ".join(
            fmt(results[n]["snapshots"]["budget"]["accuracy"], ".1%") if pair_of(n) == pair else "" for n in order)
            + " |")
    return "\n".join(lines)


def parse_runs(text: str) -> tuple[str, ...]:
    """--runs: a comma-separated subset of PAIRS, run in PAIRS' order."""
    picked = {p.strip().lower() for p in text.strip("[] ").split(",") if p.strip()}
    unknown = sorted(picked - set(PAIRS))
    if unknown or not picked:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(PAIRS)}, got {text!r}"
                                         + (f" (unknown: {', '.join(unknown)})" if unknown else "")
                                         + "; e.g. --runs grpo,rloo")
    return tuple(p for p in PAIRS if p in picked)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of a few prompts (smoke test)")
    parser.add_argument("--runs", type=parse_runs, default=PAIRS, metavar="grpo,rloo,dpo",
                        help="which astrai/TRL pairs run, a comma-separated subset (default all: grpo,rloo,dpo)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of every run")
    parser.add_argument("--prompts", type=int, default=64, help="GRPO prompts per step")
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4, help="GRPO learning rate")
    parser.add_argument("--pairs", type=int, default=32, help="DPO pairs per step")
    parser.add_argument("--dpo_lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=5, help="linear warmup steps, then constant")
    parser.add_argument("--sft_scale", type=float, default=1.0,
                        help="scale of the demo's pre-training and SFT steps for the start model (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=[f"{s}_{p}" for p in PAIRS for s in ("trl", "astrai")],
                        help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--budget_s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.prompts, args.group_size, args.pairs, args.sft_scale, args.warmup = 3, 4, 4, 4, 0.01, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:  # one run in this process; its result goes to <work>/<name>.json
        work = Path(args.work)
        fn = worker_trl if args.worker.startswith("trl") else worker_astrai
        result = fn(work / "start", work, args.worker, args)
        (work / f"{args.worker}.json").write_text(json.dumps(result))
        return 0
    try:
        import trl  # noqa: F401
    except ImportError as e:
        print(f"compare_trl: TRL is not installed ({e}); install the dev extra: pip install -e '.[dev]'",
              file=sys.stderr)
        return 2
    passed = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp_name:
        work = Path(tmp_name)
        start = prepare(work, args)
        start_acc = accuracy(str(start), work / "data" / "eval.jsonl")
        num_eval = len((work / "data" / "eval.jsonl").read_text().splitlines())
        results: dict[str, dict[str, Any]] = {}
        for name in (f"{system}_{pair}" for pair in args.runs for system in ("trl", "astrai")):
            budget = results[f"trl_{pair_of(name)}"]["snapshots"]["steps"]["seconds"] \
                if name.startswith("astrai") else 0.0
            cmd = [sys.executable, __file__, *passed, "--worker", name, "--work", str(work), "--budget_s", str(budget)]
            log = work / f"{name}.log"
            with log.open("w") as f:
                code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
            if code != 0:
                print(log.read_text()[-4000:], file=sys.stderr)
                print(f"compare_trl: the {name} run failed (exit code {code})", file=sys.stderr)
                return 1
            results[name] = json.loads((work / f"{name}.json").read_text())
            for snap in results[name]["snapshots"].values():
                snap["accuracy"] = accuracy(snap["path"], work / "data" / "eval.jsonl")
    print(table(results, start_acc, num_eval, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
