"""Run directories for end-to-end checkpoint/resume tests: a tiny tokenizer, JSONL data, a YAML config;
and `astrai train` run in this process with a SIGTERM at a chosen micro-batch.

Shared by the resume, kill-fuzz and multi-rank tests. Everything is small enough that a run of
`astrai train` over it takes a second or two of compute on a 2-core CPU.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

from astrai.cli import main as astrai_main
from astrai.data.tasks import corpus_records, dpo_record, generate_items, sft_record
from astrai.data.tokenizer_training import train_tokenizer
from astrai.train import build as trainer_mod  # the builder of every loop's callbacks
from astrai.train import signals

MODEL = {
    "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
}


def write_tokenizer(out: Path) -> Path:
    items = generate_items(200, ["add", "sub"], digits=2, seed=0)
    train_tokenizer([r["text"] for r in corpus_records(items)] + ["user assistant system"] * 5, 300, out)
    return out


def write_data(out_dir: Path, train_type: str, num_records: int) -> Path:
    items = generate_items(num_records * 4, ["add", "sub"], digits=2, seed=1)
    rng = random.Random(0)
    if train_type == "seq":
        records = corpus_records(items, per_doc=4)[:num_records]
    elif train_type == "sft":
        records = [sft_record(it) for it in items[:num_records]]
    else:
        records = [dpo_record(it, rng) for it in items[:num_records]]
    path = out_dir / f"{train_type}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_run(run_dir: Path, tok_dir: Path, train_type: str, num_records: int = 24, **train) -> Path:
    """A YAML config for `astrai train` in `run_dir` (ckpt/ and log/ inside it); returns its path."""
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    data = write_data(run_dir, train_type, num_records)
    cfg = {
        "model": MODEL,
        "data": {"train_type": train_type, "data_path": str(data), "tokenizer_path": str(tok_dir),
                 "max_seq_len": 48},
        "train": {"n_epoch": 2, "batch_per_device": 4, "grad_accum_steps": 1, "random_seed": 0,
                  "device": "cpu", **train},
        "optim": {"max_lr": 3e-3, "schedule": "cosine", "warmup_steps": 2, "weight_decay": 0.1},
        "ckpt": {"ckpt_dir": str(run_dir / "ckpt"), "ckpt_interval": 0, "keep_last": 2},
        "log": {"log_dir": str(run_dir / "log"), "progress": False},
    }
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "log" / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("split", "train") == "train"]


class SigtermAt:
    """A callback that sends SIGTERM to this process at the start of micro-batch number `at`
    (0-based), so a stop goes through the real signal handler and lands at a known place."""

    def __init__(self, at: int):
        self.at, self.seen = at, 0

    def on_batch_begin(self, trainer, batch) -> None:
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1


def train_in_process(config, *flags, kill_at=None, monkeypatch=None) -> int:
    """`astrai train --config config *flags` in this process; with `kill_at`, SIGTERM at that
    micro-batch (`monkeypatch` adds the callback to every loop's defaults, then is undone)."""
    if kill_at is not None:
        original = trainer_mod.default_callbacks
        monkeypatch.setattr(trainer_mod, "default_callbacks", lambda t: [*original(t), SigtermAt(kill_at)])
    try:
        return astrai_main(["train", "--config", str(config), *flags])
    finally:
        monkeypatch.undo()
        signals.uninstall_signal_handlers()
