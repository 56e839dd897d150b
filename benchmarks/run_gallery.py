"""Healthy and broken online RL runs, side by side: the pictures of docs/reading-a-run.md.

Starts from a finished `astrai demo` (its SFT model, tokenizer, prompts and the resolved config of
its GRPO stage) and runs that stage again, once as it is and once per broken setting, each with the
same seed and step count, then draws every run's curves of the metrics the page explains into one
PNG (a row per run, a column per metric):

    astrai demo --out out/demo
    .venv/bin/python benchmarks/run_gallery.py --demo out/demo --out out/gallery \
        --figure docs/images/reading-a-run.png

The broken settings are ordinary mistakes, not sabotage of the code: a near-greedy rollout
temperature (every sample of a group the same), a learning rate ten times the demo's, one rollout
reused for eight steps at a higher rate, a token budget too small for the answers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

RUNS = {  # name -> (title, the demo config's fields it changes)
    "healthy": ("healthy: the demo's GRPO stage", {}),
    "flat": ("reward flat: rollout_temperature 0.02", {"rl": {"rollout_temperature": 0.02}}),
    "collapse": ("entropy collapse: max_lr 5e-3 (10x)", {"optim": {"max_lr": 5e-3}}),
    "clipped": ("clip pinned, lag: rollout_interval 8, max_lr 2e-3",
                {"rl": {"rollout_interval": 8}, "optim": {"max_lr": 2e-3}}),
    "truncated": ("truncation high: rollout_max_tokens 2", {"rl": {"rollout_max_tokens": 2}}),
}
METRICS = ["reward_mean", "frac_reward_zero_std", "entropy", "clip_fraction", "truncated_fraction"]


def run_config(demo: Path, out: Path, name: str, steps: int) -> dict:
    config = yaml.safe_load((demo / "rl-grpo" / "config.yaml").read_text())
    for section, fields in RUNS[name][1].items():
        config[section].update(fields)
    config["train"]["max_steps"] = steps
    config["ckpt"].update(ckpt_dir=str(out / name / "ckpt"), ckpt_interval=0, overwrite_ckpt_dir=True)
    config["log"].update(log_dir=str(out / name), progress=False)
    return config


def train(config: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    subprocess.run([sys.executable, "-m", "astrai", "train", "--config", str(path)], check=True)


def read_train_rows(log_dir: Path) -> list[dict]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row.get("split") == "train"]


def draw(out: Path, names: list[str], figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(names), len(METRICS), figsize=(3.0 * len(METRICS), 1.9 * len(names)),
                             squeeze=False, sharex=True)
    for r, name in enumerate(names):
        rows = read_train_rows(out / name)
        for c, metric in enumerate(METRICS):
            ax = axes[r][c]
            points = [(row["step"], row[metric]) for row in rows if metric in row]
            if points:
                ax.plot(*zip(*points), lw=1.0)
            ax.tick_params(labelsize=7)
            if r == 0:
                ax.set_title(metric, fontsize=9)
            if c == 0:
                ax.set_ylabel(RUNS[name][0].split(":")[0], fontsize=9)
        axes[r][0].annotate(RUNS[name][0], (0, 1.02), xycoords="axes fraction", fontsize=7, color="0.35")
    for ax in axes[-1]:
        ax.set_xlabel("step", fontsize=8)
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=72)
    from PIL import Image  # (matplotlib's own dependency) a 32-colour palette: a fifth of the bytes

    Image.open(figure).convert("RGB").quantize(32).save(figure, optimize=True)
    print(f"wrote {figure}")


def summary(out: Path, names: list[str]) -> None:
    """First and last ten steps' means of each metric: the figures the page quotes."""
    for name in names:
        rows = read_train_rows(out / name)
        cells = []
        for metric in METRICS:
            values = [row[metric] for row in rows if metric in row]
            head, tail = values[:10], values[-10:]
            cells.append(f"{metric} {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f}")
        print(f"{name}: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", type=Path, default=Path("out/demo"), help="a finished `astrai demo --out` folder")
    p.add_argument("--out", type=Path, default=Path("out/gallery"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--figure", type=Path, default=None, help="PNG to write (default OUT/reading-a-run.png)")
    p.add_argument("--draw_only", action="store_true", help="redraw from the runs already in --out")
    args = p.parse_args(argv)
    if not (args.demo / "rl-grpo" / "config.yaml").is_file():
        p.error(f"--demo {args.demo}: no rl-grpo/config.yaml there; run `astrai demo --out {args.demo}` first")
    if not args.draw_only:
        for name in args.runs:
            train(run_config(args.demo, args.out, name, args.steps), args.out / f"{name}.yaml")
    summary(args.out, args.runs)
    draw(args.out, args.runs, args.figure or args.out / "reading-a-run.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
