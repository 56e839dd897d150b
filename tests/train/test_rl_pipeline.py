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
from tests.train.rl_runs import (
    REPO,
    checkpoint_weights,
    child_pids,
    left_behind,
    sigterm_after_step,
    write_rl_run,
)

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
def test_sigterm_and_resume_equals_the_uninterrupted_run(tmp_path, tok_dir):
    """Stopped after step 3 with 2 rollouts in flight (k = 1 is the SIGKILL and DDP tests'): the
    checkpoint holds them, the resumed run trains on them and draws the rest as the uninterrupted
    run did."""
    straight = async_run(tmp_path / "straight", tok_dir, 2, max_steps=6)
    stopped = async_run(tmp_path / "stopped", tok_dir, 2, max_steps=6)
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
    the rollout saved in flight and ends where the uninterrupted run ends; the rollout process
    (its pipe closed) leaves with the trainer."""
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
    children = child_pids(proc.pid)  # the rollout process and its fork server (async_rollout_source auto, a CPU)
    assert children
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=GUARD_S)
    assert not left_behind(children), "the rollout process outlived its killed trainer"
    assert latest_checkpoint(ckpt).name == "step_00000002"
    assert main(["--config", str(killed), "--resume", "--ckpt_interval", "2"]) == 0
    assert same_weights(tmp_path / "killed", tmp_path / "straight")


def ddp(config: Path) -> Path:
    cfg = yaml.safe_load(config.read_text())
    cfg["dist"] = {"nprocs": 2, "parallel_mode": "ddp"}
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return config


def train_in_subprocess(config: Path, *flags: str, pause_at: str | None = None, pause_dir: Path | None = None) -> str:
    """`astrai train` as a user runs it; with `pause_at`, SIGTERM once both ranks paused there."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if pause_at is not None:
        env.update({"ASTRAI_PAUSE_AT": pause_at, "ASTRAI_PAUSE_FILE": str(pause_dir / "paused")})
    proc = subprocess.Popen([sys.executable, "-m", "astrai", "train", "--config", str(config), *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    if pause_at is not None:
        deadline = time.monotonic() + GUARD_S
        while len(list(pause_dir.glob("paused.*"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=GUARD_S)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_ddp_two_ranks_stopped_and_resumed_equal_the_uninterrupted_run(tmp_path, tok_dir):
    """Two ranks, each drawing its own prompts on its own rollout thread (their draws agree over a
    gloo group of their own, beside DDP's all-reduces): stopped after step 3 and resumed, the run
    ends with the uninterrupted run's weights. The engine on the thread (``async_rollout_source
    thread``): this pins that source's resume, the SIGTERM and SIGKILL tests the process's."""
    straight = ddp(async_run(tmp_path / "straight", tok_dir, 1, max_steps=5, async_rollout_source="thread"))
    stopped = ddp(async_run(tmp_path / "stopped", tok_dir, 1, max_steps=5, async_rollout_source="thread"))
    train_in_subprocess(straight)
    out = train_in_subprocess(stopped, pause_at="step:3", pause_dir=tmp_path)
    assert "stopped at step 3" in out, out[-2000:]
    ckpt = latest_checkpoint(tmp_path / "stopped" / "ckpt")
    assert {"pipeline.pt", "pipeline_rank1.pt"} <= {p.name for p in ckpt.iterdir()}
    train_in_subprocess(stopped, "--resume")
    assert [m["policy_lag"] for m in read_metrics(tmp_path / "straight")] == [0, 1, 1, 1, 1]
    assert rows(tmp_path / "stopped", *EXACT) == rows(tmp_path / "straight", *EXACT)
    assert same_weights(tmp_path / "stopped", tmp_path / "straight")


@pytest.mark.parametrize("train_type, rl", [
    ("online_ppo", {}),  # the critic's values from the critic of the step that trains on the rollout
    ("online_grpo", {"dynamic_sampling": True}),
    ("online_dpo", {}),
])
def test_async_steps_with_each_objective_and_dynamic_sampling(tmp_path, tok_dir, train_type, rl):
    config = write_rl_run(tmp_path, tok_dir, train_type, async_steps=1, rewards=["length"], length_target=4, **rl)
    assert main(["--config", str(config), "--max_steps", "3"]) == 0
    assert [m["policy_lag"] for m in read_metrics(tmp_path)] == [0, 1, 1]


def test_async_steps_with_tools_and_evaluation_during_training(tmp_path, tok_dir):
    """Multi-turn episodes on the rollout thread; evaluation on the training weights meanwhile."""
    from tests.train.rl_runs import eval_file, eval_rows, with_eval, write_tool_run

    config = with_eval(write_tool_run(tmp_path, tok_dir, async_steps=1), eval_file(tmp_path / "eval.jsonl"))
    assert main(["--config", str(config)]) == 0
    assert [m["policy_lag"] for m in read_metrics(tmp_path)] == [0, 1, 1]
    assert [m["step"] for m in eval_rows(tmp_path)] == [0, 2, 3]  # before, every eval_interval, at the end
