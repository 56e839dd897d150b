"""Tiny online-RL runs for the tests: a run directory (prompts + YAML config) for `astrai train`,
a held-out eval file and the config fields that turn evaluation on, a stop by SIGTERM after a
chosen optimizer step, the newest checkpoint's weights, and a prompt batch for an `EpisodeRunner`.

Shared by the online RL tests of tests/train (the tokenizer they take is the `tok_dir` fixture of
tests/train/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from astrai.data.tasks import generate_items, prompt_record
from astrai.train.publish import latest_checkpoint
from tests.train.resume_data import MODEL

REPO = Path(__file__).resolve().parents[2]


def write_rl_run(run_dir: Path, tok_dir: Path, train_type: str = "online_grpo", num_prompts: int = 16,
                 records: list[dict] | None = None, **rl) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    items = generate_items(num_prompts, ["add"], digits=2, seed=1)
    records = records if records is not None else [prompt_record(it) for it in items]
    (run_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = {
        "model": MODEL,
        "data": {"train_type": train_type, "data_path": str(run_dir / "prompts.jsonl"), "tokenizer_path": str(tok_dir)},
        "train": {"max_steps": 4, "batch_per_device": 4, "grad_accum_steps": 2, "device": "cpu", "random_seed": 0},
        "optim": {"max_lr": 1e-2, "warmup_steps": 0},
        "rl": {"group_size": 4, "rollout_max_tokens": 6, "rewards": ["exact_match", "format"], **rl},
        "ckpt": {"ckpt_dir": str(run_dir / "ckpt"), "ckpt_interval": 0},
        "log": {"log_dir": str(run_dir / "log"), "progress": False},
    }
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def write_tool_run(run_dir: Path, tok_dir: Path, **rl) -> Path:
    """A 3-step online GRPO run offering the `multiply` tool (episodes of up to 2 turns), tracing
    6 samples a rollout."""
    config = write_rl_run(run_dir, tok_dir, tools=["tests.train.rl_user_code:multiply"], max_turns=2, **rl)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["max_position_embeddings"] = 512  # the tool's schema needs the room
    cfg["train"]["max_steps"] = 3
    cfg["log"]["trace_samples"] = 6
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config


def eval_file(path: Path, num: int = 6) -> Path:
    items = generate_items(num, ["add"], digits=2, seed=7)  # another seed than the training prompts
    path.write_text("".join(json.dumps(prompt_record(it)) + "\n" for it in items))
    return path


def eval_rows(run_dir: Path) -> list[dict]:
    """The `split: eval` rows of a run's metrics.jsonl (log_dir run_dir/log)."""
    lines = (run_dir / "log" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("split") == "eval"]


def with_eval(config: Path, eval_path: Path, **train) -> Path:
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["eval_data_path"] = str(eval_path)
    cfg["train"].update({"eval_interval": 2, "eval_num_samples": 2, **train})
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config


def sigterm_after_step(config: Path, step: int, tmp_path: Path) -> None:
    """Run `astrai train` in a subprocess that pauses after optimizer `step` (the test hook),
    SIGTERM it there, and check that it stopped gracefully at that step."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ASTRAI_PAUSE_AT": f"step:{step}", "ASTRAI_PAUSE_FILE": str(tmp_path / "paused")}
    proc = subprocess.Popen([sys.executable, "-m", "astrai", "train", "--config", str(config)], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a guard against a hung run, not the property under test
    while not list(tmp_path.glob("paused.*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    children = child_pids(proc.pid)  # async_steps on a CPU: the rollout process and its fork server
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and f"stopped at step {step}" in err, err[-2000:]
    assert not left_behind(children), f"processes {children} of the stopped run are still running"


def child_pids(pid: int) -> list[int]:
    """Every process descended from `pid` (Linux /proc): children, theirs, and so on."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # gone meanwhile
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def left_behind(pids: list[int], guard_s: float = 60.0) -> list[int]:
    """Those of `pids` still running once they all ended or `guard_s` passed (zombies count as ended)."""
    def running(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + guard_s
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the newest checkpoint in `run_dir/ckpt`."""
    return load_file(str(latest_checkpoint(run_dir / "ckpt") / "model.safetensors"))


def prompt_batch(tokenizer, questions: list[str]) -> dict[str, list]:
    messages = [[{"role": "user", "content": q}] for q in questions]
    return {"prompt_ids": [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in messages],
            "messages": messages, "answer": ["7"] * len(questions), "metadata": [None] * len(questions)}
