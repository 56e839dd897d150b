"""Exact resume: 2N steps straight == N steps, SIGTERM, resume, N more (bitwise weights, same losses).

Runs the real `astrai train` entry point in this process. A tiny callback sends SIGTERM to this
process at a chosen micro-batch, so the stop goes through the real signal handler and lands at
a known place: inside an epoch and inside a gradient-accumulation window (the partial window is
dropped and redone after the resume).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from astrai.train import signals
from astrai.train.publish import latest_checkpoint, verify_checkpoint
from tests.train.resume_data import read_metrics, train_in_process, write_run

COMPARED = ("step", "epoch", "lr", "loss", "grad_norm", "num_loss_units")


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    signals.uninstall_signal_handlers()


def _weights(ckpt):
    return load_file(str(ckpt / "model.safetensors"))


# (train_type, micro-batch to stop at): with grad_accum 2 an even micro-batch opens a window; it
# runs, the stop comes before the window's second half, so the half-done window is dropped.
# Every stop is inside the first epoch. Extra flags: the length-grouped order resumes exactly too;
# "mixed_lengths": chats of 4 in a micro-batch, every other one short and the rest long, so the
# default padding-free layout (row_layout pack) really puts several in one row (the task's chats
# are too even for that: a row of two never fits in the longest).
CASES = [("seq", 4, []), ("sft", 6, []), ("dpo", 8, []), ("reward", 8, []),
         ("sft", 6, ["--group_by_length", "true"]), ("sft", 2, ["mixed_lengths"])]


def _mix_lengths(data):
    """Every other SFT record of `data` becomes a short chat, the others three questions long."""
    records = [json.loads(line) for line in data.read_text().splitlines()]
    for i, record in enumerate(records):
        user = record["messages"][0]
        user["content"] = user["content"][:2] if i % 2 else " ".join([user["content"]] * 3)
    data.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.slow
@pytest.mark.parametrize("train_type, kill_at, extra", CASES)
def test_sigterm_resume_is_exact(tmp_path, tok_dir, monkeypatch, train_type, kill_at, extra):
    flags = {"grad_accum_steps": 2, "batch_per_device": 4 if extra == ["mixed_lengths"] else 2}
    straight = write_run(tmp_path / "straight", tok_dir, train_type, **flags)
    stopped = write_run(tmp_path / "stopped", tok_dir, train_type, **flags)
    if extra == ["mixed_lengths"]:
        for path in (straight, stopped):
            _mix_lengths(path.parent / "sft.jsonl")
    elif extra:  # the option goes into both configs
        for path in (straight, stopped):
            path.write_text(path.read_text().replace("data:\n", "data:\n  " + extra[0][2:] + ": " + extra[1] + "\n", 1))

    assert train_in_process(straight, monkeypatch=monkeypatch) == 0
    full = read_metrics(tmp_path / "straight")
    total = full[-1]["step"]

    assert train_in_process(stopped, kill_at=kill_at, monkeypatch=monkeypatch) == 0
    first = latest_checkpoint(tmp_path / "stopped" / "ckpt")
    verify_checkpoint(first)
    # the signal came during micro-batch `kill_at`: that micro-batch finished, the next did not run
    # and the window it belonged to was dropped, so the checkpoint holds the windows before it
    stop_step = kill_at // 2
    assert first.name == f"step_{stop_step:08d}"
    assert 0 < stop_step < total // 2  # mid-epoch (2 epochs)
    assert [m["step"] for m in read_metrics(tmp_path / "stopped")] == list(range(1, stop_step + 1))

    assert train_in_process(stopped, "--resume", monkeypatch=monkeypatch) == 0
    resumed = read_metrics(tmp_path / "stopped")
    assert [{k: m[k] for k in COMPARED} for m in resumed] == [{k: m[k] for k in COMPARED} for m in full]
    a = _weights(latest_checkpoint(tmp_path / "straight" / "ckpt"))
    b = _weights(latest_checkpoint(tmp_path / "stopped" / "ckpt"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


@pytest.mark.slow
def test_resume_across_epoch_boundary_is_exact(tmp_path, tok_dir, monkeypatch):
    # 24 records / batch 4 = 6 micro-batches per epoch; with grad_accum 4 the second window holds
    # micro-batches 4, 5 (epoch 0) and 6, 7 (epoch 1). A stop at 6 drops that window across the boundary.
    flags = {"grad_accum_steps": 4, "batch_per_device": 4}
    straight = write_run(tmp_path / "straight", tok_dir, "sft", **flags)
    stopped = write_run(tmp_path / "stopped", tok_dir, "sft", **flags)
    assert train_in_process(straight, monkeypatch=monkeypatch) == 0
    full = read_metrics(tmp_path / "straight")
    assert train_in_process(stopped, kill_at=6, monkeypatch=monkeypatch) == 0
    assert latest_checkpoint(tmp_path / "stopped" / "ckpt").name == "step_00000001"
    assert train_in_process(stopped, "--resume", monkeypatch=monkeypatch) == 0
    resumed = read_metrics(tmp_path / "stopped")
    assert [{k: m[k] for k in COMPARED} for m in resumed] == [{k: m[k] for k in COMPARED} for m in full]
    a = _weights(latest_checkpoint(tmp_path / "straight" / "ckpt"))
    b = _weights(latest_checkpoint(tmp_path / "stopped" / "ckpt"))
    assert all(torch.equal(a[k], b[k]) for k in a)
