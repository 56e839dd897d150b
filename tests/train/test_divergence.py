"""Divergence never poisons checkpoints; one run per ckpt_dir; NaN is never an improvement."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from astrai.train import publish
from astrai.train.callbacks import EarlyStopping
from astrai.train.cli import main
from astrai.train.context import TrainContext
from astrai.train.step import GradientStep, NonFiniteError
from tests.train.resume_data import write_run


class _Schedule:
    def __init__(self):
        self.num_steps = 0

    def get_last_lr(self):
        return [0.1]

    def step(self):
        self.num_steps += 1


def _window(max_nonfinite_steps=2):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = _Schedule()
    step = GradientStep([w], opt, sched, max_grad_norm=1.0, world_size=1, device=torch.device("cpu"),
                        max_nonfinite_steps=max_nonfinite_steps)
    return w, step, sched


def _micro_batch(w, step, scale):
    loss = (w * scale).sum()
    loss.backward()
    step.add(loss, 1, 3)


def test_nonfinite_loss_skips_the_update_and_counts_it(capsys):
    w, step, sched = _window()
    _micro_batch(w, step, float("nan"))
    out = step.step(1)
    assert out["skipped"] == 1 and out["nonfinite_steps"] == 1
    assert torch.equal(w.detach(), torch.ones(3)) and w.grad is None  # no update, gradients dropped
    assert sched.num_steps == 1  # the schedule still follows the step count
    assert "step 1 skipped" in capsys.readouterr().err
    _micro_batch(w, step, 1.0)
    out = step.step(2)
    assert out["skipped"] == 0 and out["nonfinite_steps"] == 1 and step.num_nonfinite_in_row == 0
    assert not torch.equal(w.detach(), torch.ones(3))  # a finite step updates again


def test_consecutive_nonfinite_steps_stop_the_run():
    w, step, _ = _window(max_nonfinite_steps=2)
    _micro_batch(w, step, float("inf"))
    step.step(1)
    _micro_batch(w, step, float("inf"))
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        step.step(2)


def test_a_diverging_run_fails_and_never_publishes_nonfinite_weights(tmp_path, tok_dir, capsys):
    config = write_run(tmp_path, tok_dir, "sft", num_records=48, n_epoch=4)
    code = main(["--config", str(config), "--max_lr", "1e30", "--warmup_steps", "0", "--ckpt_interval", "1",
                 "--keep_last", "2", "--max_nonfinite_steps", "3"])
    err = capsys.readouterr().err
    assert code != 0
    assert "diverged" in err or "not finite" in err, err[-2000:]
    published = publish.list_checkpoints(tmp_path / "ckpt")
    for _, path in published:
        tensors = load_file(str(path / "model.safetensors"))
        assert all(bool(torch.isfinite(t).all()) for t in tensors.values()), path
    # the newest finite checkpoint survived retention (or none was ever finite enough to publish)
    assert all(publish.is_complete(p, checksums=True) for _, p in published)


def test_second_run_on_the_same_ckpt_dir_fails_at_once_naming_the_holder(tmp_path, tok_dir, capsys):
    config = write_run(tmp_path, tok_dir, "sft", num_records=8, n_epoch=1)
    with publish.run_lock(tmp_path / "ckpt"):
        assert main(["--config", str(config)]) == 1
        err = capsys.readouterr().err
        assert f"pid {os.getpid()}" in err and "in use by another run" in err
        assert publish.list_checkpoints(tmp_path / "ckpt") == []  # the second run touched nothing
    assert main(["--config", str(config)]) == 0  # released when the holder's block ends
    assert len(publish.list_checkpoints(tmp_path / "ckpt")) == 1


def test_the_lock_of_a_killed_run_is_not_stale(tmp_path):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: take the lock, say so, then wait to be killed
        os.close(read)
        with publish.run_lock(tmp_path):
            os.write(write, b"locked")
            signal.pause()
        os._exit(0)
    os.close(write)
    assert os.read(read, 6) == b"locked"  # the child holds the lock now
    with pytest.raises(publish.CkptDirLocked, match=f"pid {pid}"), publish.run_lock(tmp_path):
        pass
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with publish.run_lock(tmp_path):  # the kernel released it with the process
        pass


def test_ckpt_dir_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(publish.CheckpointError, match="is a file"), publish.run_lock(tmp_path / "file"):
        pass


def test_early_stopping_counts_nan_as_no_improvement():
    class Loop:
        ctx = TrainContext()
        step_metrics: dict = {}

    loop, stopper = Loop(), EarlyStopping("val/loss", patience=2)
    for value in (1.0, float("nan"), float("nan")):
        loop.step_metrics = {"val/loss": value}
        stopper.after_optimizer_step(loop)
    assert stopper.best == 1.0 and loop.ctx.stop_requested


def test_model_vocab_smaller_than_the_tokenizer_is_an_error_before_training(tmp_path, tok_dir, capsys):
    config = write_run(tmp_path, tok_dir, "sft", num_records=8, n_epoch=1)
    assert main(["--config", str(config), "--vocab_size", "64"]) == 1
    err = capsys.readouterr().err
    assert "vocab_size is 64 but the tokenizer" in err and "at least" in err
    assert publish.list_checkpoints(tmp_path / "ckpt") == []


@pytest.mark.parametrize("device, message", [("tpu", "not supported"), ("cuda", "no CUDA device")])
def test_unknown_or_unavailable_device_is_a_one_line_error(tmp_path, tok_dir, capsys, device, message):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present here")
    config = write_run(tmp_path, tok_dir, "sft", num_records=8, n_epoch=1)
    assert main(["--config", str(config), "--device", device]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("damage", ["checksum", "truncated", "missing", "manifest"])
def test_resume_skips_every_kind_of_damage_the_same_way(tmp_path, tok_dir, capsys, damage):
    config = write_run(tmp_path, tok_dir, "sft", num_records=16, n_epoch=1)
    assert main(["--config", str(config), "--ckpt_interval", "1", "--keep_last", "5", "--max_steps", "3"]) == 0
    newest = tmp_path / "ckpt" / "step_00000003"
    target = newest / "optimizer.pt"
    if damage == "checksum":  # same size, different bytes
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:10])
    elif damage == "missing":
        target.unlink()
    else:
        (newest / "manifest.json").write_text("{not json")
    capsys.readouterr()
    assert main(["--config", str(config), "--resume", "--max_steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err
    assert ("manifest.json" if damage == "manifest" else "optimizer.pt") in err
    assert "resumed from" in err and "step_00000002 at step 2" in err


def test_fine_tuning_defaults_and_the_first_line_says_what_the_run_uses(tmp_path, tok_dir, capsys):
    import yaml

    config = write_run(tmp_path / "scratch", tok_dir, "sft", num_records=8, n_epoch=1)
    raw = yaml.safe_load(config.read_text())
    del raw["optim"]["max_lr"], raw["optim"]["warmup_steps"]
    config.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(config)]) == 0
    assert "max_lr=0.001 (default for training from scratch" in capsys.readouterr().err
    ckpt = publish.latest_checkpoint(tmp_path / "scratch" / "ckpt")
    del raw["model"]
    raw["ckpt"]["ckpt_dir"] = str(tmp_path / "tuned" / "ckpt")
    raw["log"]["log_dir"] = str(tmp_path / "tuned" / "log")
    config.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(config), "--param_path", str(ckpt), "--max_steps", "40"]) == 0
    err = capsys.readouterr().err
    assert "max_lr=2e-05 (default for fine-tuning sft; set --max_lr to change)" in err
    assert "warmup=1 of 40 steps (default for fine-tuning sft" in err  # round(0.03 * 40)
