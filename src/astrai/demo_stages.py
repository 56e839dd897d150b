"""The stages of `astrai demo` and `astrai demo --algo tools`: each runs once and is reused when a
re-run finds its `stage.json` marker; a training stage runs `astrai train` on a written config and
publishes the newest checkpoint's model files as `<stage>/final`. Curves and plots for the report."""

from __future__ import annotations

import json
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from astrai.train import signals

MODEL_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json")


def stage_done(stage_dir: Path) -> dict[str, Any] | None:
    marker = stage_dir / "stage.json"
    return json.loads(marker.read_text()) if marker.exists() else None


def mark_done(stage_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / "stage.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def run_stage(name: str, stage_dir: Path, fn, log) -> dict[str, Any]:
    done = stage_done(stage_dir)
    if done is not None:
        log(f"[{name}] reusing the finished stage in {stage_dir}")
        return done
    log(f"[{name}] running")
    start = time.perf_counter()
    info = fn() or {}
    stopped_by = signals.last_signal()  # `astrai train` ends a stopped run with a checkpoint and exit 0
    if stopped_by is not None:
        log(f"[{name}] stopped by {signal.Signals(stopped_by).name}: the stage is not marked finished; run the "
            "demo again to redo it")
        raise SystemExit(128 + stopped_by)
    info["seconds"] = round(time.perf_counter() - start, 1)
    log(f"[{name}] done in {info['seconds']} s")
    return mark_done(stage_dir, info)


def publish_final(ckpt_dir: Path, final_dir: Path) -> Path:
    """The newest complete checkpoint's model files as a plain model directory, published as a
    checkpoint is (atomically, with a manifest of sizes and checksums that loading checks)."""
    from astrai.model.manifest import newest_checkpoint, read_manifest
    from astrai.train.publish import publish_model_dir

    found = newest_checkpoint(ckpt_dir, "sizes")
    if found.path is None:
        raise RuntimeError(f"training finished without a complete checkpoint in {ckpt_dir}")
    latest = found.path

    def copy(staging: Path) -> None:
        for name in MODEL_FILES:
            if (latest / name).exists():
                shutil.copy2(latest / name, staging / name)

    return publish_model_dir(final_dir, read_manifest(latest)["step"], copy)


def train_stage(stage_dir: Path, config: dict[str, Any]) -> dict[str, Any]:
    from astrai.train.cli import main as train_main

    stage_dir.mkdir(parents=True, exist_ok=True)
    config_path = stage_dir / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    import torch

    # the demo's thread count (--num_threads), which `astrai train` would otherwise set to its own default
    code = train_main(["--config", str(config_path), "--num_threads", str(torch.get_num_threads())])
    if code != 0:
        raise RuntimeError(f"training stage {stage_dir.name} failed with exit code {code}")
    publish_final(stage_dir / "ckpt", stage_dir / "final")
    from astrai.train.plot import main as plot_main
    from astrai.train.report_page import write_report as write_run_page

    # drawn once, with the stage: a rerun that reuses the stage keeps them
    plot_main([str(stage_dir), "--out", str(stage_dir / "plots")])
    write_run_page(stage_dir)  # <stage>/report.html: curves, samples, config, checkpoints
    return {"config": str(config_path), **throughput(stage_dir / "metrics.jsonl")}


def throughput(metrics_path: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        return {}
    info = {"steps": rows[-1].get("step"), "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"]}
    speeds = sorted(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)  # online RL logs rollout speed only
    if speeds:
        info["tokens_per_s"] = round(speeds[len(speeds) // 2], 1)
    return info


def rl_curves(metrics_path: Path) -> dict[str, Any]:
    """Reward and response length at the start and the end (means of 10 steps), rollout tokens/s;
    for multi-turn runs also the tool-use rate of the rollouts in those steps."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward_mean" in r]
    if not rows:
        return {}
    k = max(1, min(10, len(rows) // 4))

    def mean(key: str, part: list[dict[str, Any]]) -> float:
        return round(sum(r[key] for r in part) / len(part), 3)

    speeds = sorted(r["rollout_tokens_per_s"] for r in rows if "rollout_tokens_per_s" in r)
    curves = {"reward_first": mean("reward_mean", rows[:k]), "reward_last": mean("reward_mean", rows[-k:]),
              "length_first": mean("response_length_mean", rows[:k]),
              "length_last": mean("response_length_mean", rows[-k:]), "curve_window": k,
              "rollout_tokens_per_s": round(speeds[len(speeds) // 2], 1) if speeds else None}
    first, last = ([r for r in part if "tool_use_rate" in r] for part in (rows[:k], rows[-k:]))
    if first and last:  # multi-turn runs: the share of episodes that called a tool, on the rollouts of the window
        curves.update(tool_use_first=mean("tool_use_rate", first), tool_use_last=mean("tool_use_rate", last))
    return curves


def plot_accuracy(out: Path, accuracies: dict[str, float]) -> Path:
    """One bar per stage: held-out exact-match accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    bars = ax.bar(list(accuracies), [100 * a for a in accuracies.values()], color=["#999", "#4c72b0", "#dd8452"])
    ax.bar_label(bars, labels=[f"{a:.1%}" for a in accuracies.values()])
    ax.set_ylabel("held-out exact match (%)")
    ax.set_ylim(0, 100)
    ax.set_title("accuracy after each stage")
    fig.tight_layout()
    path = out / "accuracy.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_against_time(out: Path, runs: dict[str, Path], key: str = "reward_mean") -> Path:
    """`key` of each run (label -> metrics.jsonl) against the wall-clock time of its steps (the
    cumulative ``time_step``): what overlapping rollouts with training buys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, path in runs.items():
        rows = [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if key in r]
        seconds, clock = [], 0.0
        for r in rows:
            clock += r.get("time_step", 0.0)
            seconds.append(clock)
        ax.plot(seconds, [r[key] for r in rows], label=label)
    ax.set_xlabel("wall-clock seconds of training steps")
    ax.set_ylabel(key)
    ax.legend()
    fig.tight_layout()
    path = out / f"{key}_vs_time.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
