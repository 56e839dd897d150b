"""rl/pipeline.py: ``async_steps`` draws each rollout k ahead on a thread over its own copy of the
weights, on a fixed schedule: the lag is k on every step after the first k, two runs with one seed
end with the same weights, and a run stopped (SIGTERM) or killed (SIGKILL) resumes into the
uninterrupted run bit for bit. Every run here has a reward with a spread (``length``), so every
step moves the weights and a wrong rollout would show in them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from astrai.config import ConfigError, load_config
from astrai.train.cli import main
from astrai.train.publish import latest_checkpoint
from tests.train.resume_data import read_metrics
from tests.train.rl_runs import REPO, checkpoint_weights, sigterm_after_step, write_rl_run

GUARD_S = 300  # a guard against a hung run, not the property under test


def async_run(run_dir: Path, tok_dir: Path, k: int, max_steps: int = 4, **rl) -> Path:
    config = write_rl_run(run_dir, tok_dir, async_steps=k, rewards=["length"], length_target=4, **rl)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["max_steps"] = max_steps
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = checkpoint_weights(a), checkpoint_weights(b)
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def rows(run_dir: Path, *keys: str) -> list[dict]:
    return [{k: m.get(k) for k in keys} for m in read_metrics(run_dir)]


EXACT = ("step", "policy_version", "rollout_policy_version", "policy_lag", "loss", "grad_norm", "reward_mean")


def test_async_steps_draws_k_behind_and_two_runs_are_identical(tmp_path, tok_dir):
    for name in ("a", "b"):
        assert main(["--config", str(async_run(tmp_path / name, tok_dir, 2, max_steps=5))]) == 0
    metrics = read_metrics(tmp_path / "a")
    assert [m["policy_lag"] for m in metrics] == [0, 1, 2, 2, 2]  # rollout i drawn after step i - 2
    assert [m["rollout_policy_version"] for m in metrics] == [0, 0, 0, 1, 2]
    assert all(m["mismatch_kl"] >= 0 for m in metrics) and metrics[-1]["mismatch_kl"] > 0  # k versions apart
    assert len({m["loss"] for m in metrics}) > 1  # the weights move
    assert rows(tmp_path / "a", *EXACT) == rows(tmp_path / "b", *EXACT)
    assert same_weights(tmp_path / "a", tmp_path / "b")


def test_a_lag_past_max_policy_lag_is_refused_at_start(tmp_path, tok_dir):
    config = async_run(tmp_path, tok_dir, 2, rollout_interval=2, max_policy_lag=4)
    with pytest.raises(ConfigError, match=r"async_steps=2 with 2 step\(s\) per rollout trains on rollouts up to 5 "
                                          r"policy versions old, more than max_policy_lag=4"):
        load_config(str(config))


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_sigterm_and_resume_equals_the_uninterrupted_run(tmp_path, tok_dir, k):
    """Stopped after step 3 with k rollouts in flight: the checkpoint holds them, the resumed run
    trains on them and draws the rest as the uninterrupted run did."""
    straight = async_run(tmp_path / "straight", tok_dir, k, max_steps=6)
    stopped = async_run(tmp_path / "stopped", tok_dir, k, max_steps=6)
    assert main(["--config", str(straight)]) == 0
    sigterm_after_step(stopped, 3, tmp_path)
    ckpt = latest_checkpoint(tmp_path / "stopped" / "ckpt")
    assert ckpt.name == "step_00000003" and (ckpt / "pipeline.pt").is_file()
    assert main(["--config", str(stopped), "--resume"]) == 0
    assert rows(tmp_path / "stopped", *EXACT) == rows(tmp_path / "straight", *EXACT)
    assert same_weights(tmp_path / "stopped", tmp_path / "straight")


@pytest.mark.slow
def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path, tok_dir):
    """Killed after step 3 (the checkpoint of step 2 is the newest): the resume redoes step 3 on
    the rollout saved in flight and ends where the uninterrupted run ends."""
    straight = async_run(tmp_path / "straight", tok_dir, 1, max_steps=5)
    killed = async_run(tmp_path / "killed", tok_dir, 1, max_steps=5)
    assert main(["--config", str(straight)]) == 0
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ASTRAI_PAUSE_AT": "step:3", "ASTRAI_PAUSE_FILE": str(tmp_path / "paused")}
    proc = subprocess.Popen([sys.executable, "-m", "astrai", "train", "--config", str(killed), "--ckpt_interval", "2"],
                            env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + GUARD_S
    ckpt = tmp_path / "killed" / "ckpt"
    # the kill lands at the pause after step 3 once step 2's checkpoint (written in the background) is published
    while not (list(tmp_path.glob("paused.*")) and latest_checkpoint(ckpt)) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=GUARD_S)
    assert latest_checkpoint(ckpt).name == "step_00000002"
    assert main(["--config", str(killed), "--resume", "--ckpt_interval", "2"]) == 0
    assert same_weights(tmp_path / "killed", tmp_path / "straight")
