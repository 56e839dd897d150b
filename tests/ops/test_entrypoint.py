"""docker/entrypoint.sh: resume from the latest complete checkpoint, else the base model; exec the trainer.

`astrai` is a fake on PATH that records the `astrai train` call; `astrai ckpt latest` answers
from FAKE_LATEST, or runs the real command (the same selection `--resume` makes).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.ops.fakes import REPO, base_env, calls

ENTRYPOINT = str(REPO / "docker" / "entrypoint.sh")


@pytest.fixture
def mounts(tmp_path):
    ckpt, model = tmp_path / "checkpoints", tmp_path / "model"
    (ckpt / "job").mkdir(parents=True)
    (ckpt / "job" / "trainer.yaml").write_text("data: {train_type: sft}\n")
    model.mkdir()
    (model / "config.json").write_text("{}")
    return ckpt, model


def entry_env(tmp_path, mounts, **extra):
    ckpt, model = mounts
    defaults = {"ASTRAI_GPU_COUNT": "1", "ASTRAI_PARALLEL_MODE": "auto", "ASTRAI_STOP_TIMEOUT": "600"}
    return base_env(tmp_path, ASTRAI_CKPT_MOUNT=str(ckpt), ASTRAI_MODEL_MOUNT=str(model), **{**defaults, **extra})


def run_entry(env, cwd):
    return subprocess.run(["bash", ENTRYPOINT], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def train_argv(tmp_path) -> list[str]:
    (call,) = calls(tmp_path, "astrai")
    return call["argv"]


def test_no_checkpoint_starts_from_the_base_model(tmp_path, mounts):
    ckpt, model = mounts
    r = run_entry(entry_env(tmp_path, mounts, FAKE_LATEST="none"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert train_argv(tmp_path) == ["train", "--config", str(ckpt / "job" / "trainer.yaml"), "--nprocs", "1",
                                    "--parallel_mode", "none", "--stop_timeout", "600", "--param_path", str(model)]
    assert "starting from the base model" in r.stderr


def test_a_model_section_job_starts_without_param_path(tmp_path, mounts):
    (mounts[1] / "config.json").unlink()  # the empty placeholder directory of a model: job
    r = run_entry(entry_env(tmp_path, mounts, FAKE_LATEST="none"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--param_path" not in train_argv(tmp_path) and "--resume" not in train_argv(tmp_path)


def test_gpus_mode_extra_args_and_duration_limit(tmp_path, mounts):
    ckpt, _ = mounts
    (ckpt / "job" / "args").write_text("--max_lr\n3e-4\n--data_path\n/data/with space.jsonl\n")
    env = entry_env(tmp_path, mounts, FAKE_LATEST=str(ckpt / "step_00000004"), ASTRAI_GPU_COUNT="4",
                    ASTRAI_MAX_DURATION_SECONDS="3600")
    r = run_entry(env, tmp_path)
    assert r.returncode == 0, r.stderr
    argv = train_argv(tmp_path)
    assert argv[argv.index("--nprocs") + 1] == "4" and argv[argv.index("--parallel_mode") + 1] == "ddp"
    assert argv[-4:] == ["--max_lr", "3e-4", "--data_path", "/data/with space.jsonl"]
    assert "--resume" in argv
    assert "exec timeout --preserve-status --signal TERM --kill-after 600 3600 astrai train" in r.stderr


def test_resume_picks_the_latest_complete_checkpoint_and_skips_a_damaged_newer_one(tmp_path, mounts):
    from astrai.train.publish import publish

    ckpt, model = mounts
    for step in (2, 4, 6):
        publish(ckpt, step, lambda d: (d / "model.safetensors").write_bytes(b"weights"))
    (ckpt / "step_00000006" / "manifest.json").write_text("{not json")
    r = run_entry(entry_env(tmp_path, mounts), tmp_path)  # the real `astrai ckpt latest`
    assert r.returncode == 0, r.stderr
    assert f"resuming from {ckpt / 'step_00000004'}" in r.stderr
    assert "skipping a damaged checkpoint newer than step_00000004" in r.stderr and "step_00000006" in r.stderr
    argv = train_argv(tmp_path)
    assert argv[-3:] == ["--param_path", str(model), "--resume"]  # resume_path picks the same one in ckpt_dir


def test_only_damaged_checkpoints_refuse_to_start_over(tmp_path, mounts):
    ckpt, _ = mounts
    (ckpt / "step_00000003").mkdir()  # no manifest: never complete
    (ckpt / "step_00000003" / "model.safetensors").write_bytes(b"x")
    r = run_entry(entry_env(tmp_path, mounts), tmp_path)
    assert r.returncode == 1 and "none is complete; refusing to start over" in r.stderr
    assert calls(tmp_path, "astrai") == []


def test_missing_job_directory_is_a_clear_error(tmp_path, mounts):
    (mounts[0] / "job" / "trainer.yaml").unlink()
    r = run_entry(entry_env(tmp_path, mounts, FAKE_LATEST="none"), tmp_path)
    assert r.returncode == 2 and "scripts/train.sh start" in r.stderr


def test_the_trainer_is_execed_so_sigterm_reaches_it(tmp_path, mounts):
    ready = tmp_path / "trainer.pid"
    env = entry_env(tmp_path, mounts, FAKE_LATEST="none", FAKE_WAIT_TERM=str(ready))
    proc = subprocess.Popen(["bash", ENTRYPOINT], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # a failure guard only: the test waits for the pid file
        while not (ready.exists() and ready.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.read_text() == str(proc.pid)  # the trainer *is* the entrypoint process: exec, no shell left
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert Path(f"{ready}.stopped").read_text() == "graceful"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_local_rollout_replicas_take_the_first_gpus(tmp_path, mounts):
    r = run_entry(entry_env(tmp_path, mounts, FAKE_LATEST="none", ASTRAI_GPU_COUNT="3", ASTRAI_ROLLOUT_REPLICAS="1"),
                  tmp_path)
    assert r.returncode == 0, r.stderr
    argv = train_argv(tmp_path)
    assert argv[argv.index("--nprocs") + 1] == "2" and argv[argv.index("--parallel_mode") + 1] == "ddp"
