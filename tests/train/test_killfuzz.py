"""Kill -9 fuzz: training killed at random moments (many during checkpoint saves) never loses a checkpoint.

One driver process (this file run as a script) imports astrai once and then forks a training
run per trial, each resuming from the newest complete checkpoint, and SIGKILLs it at a random
but exact moment: right after optimizer step N, or inside the publish of checkpoint N (files
staged, manifest sealed, or renamed into place). The moment is reached through the
`ASTRAI_PAUSE_AT` test hook (`signals.pause_point`): the run announces it with a file and waits
there, so every kill lands where it was aimed, however fast or slow the machine. After every kill:
each public `step_*` directory verifies (checksums), `latest_checkpoint` finds one, and the next
trial resumes from it. A last trial runs to the end, and its final weights and per-step losses
equal those of an uninterrupted run: nothing was lost or applied twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

NUM_TRIALS = 24
REPO = Path(__file__).resolve().parents[2]


KILL_POINTS = ("step", "publish-staged", "publish-sealed", "publish-renamed")


def _fork_train(argv: list[str], env: dict[str, str] | None = None) -> int:
    from astrai.cli import main

    pid = os.fork()
    if pid == 0:  # child: train, then leave without running the parent's cleanup
        code = 1
        try:
            os.environ.update(env or {})
            code = main(["train", *argv])
        finally:
            os._exit(code)
    return pid


def _wait_for_pause(pid: int, marker: Path, guard_s: float = 300.0) -> bool:
    """True once the run announced the pause point; False if it exited first (a failure)."""
    deadline = time.monotonic() + guard_s  # only a guard against a hung test, never the property
    while time.monotonic() < deadline:
        if marker.exists():
            return True
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
        time.sleep(0.005)
    return False


def _resume_step(ckpt_dir: Path) -> int:
    """The step the next run resumes at: its newest complete checkpoint, counting a sealed staging
    directory that the run's start-up cleanup will move into place."""
    from astrai.train.publish import HIDDEN_DIR, is_complete, list_checkpoints

    steps = [step for step, _ in list_checkpoints(ckpt_dir)]
    for p in ckpt_dir.iterdir() if ckpt_dir.is_dir() else []:
        m = HIDDEN_DIR.match(p.name)
        if m and m.group(2) == "staging" and is_complete(p, checksums=True):
            steps.append(int(m.group(1).removeprefix("step_")))
    return max(steps, default=0)


def _check_public_dirs(ckpt_dir: Path) -> list[str]:
    from astrai.train.publish import STEP_DIR, verify_checkpoint

    names = []
    for p in sorted(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []:
        if STEP_DIR.match(p.name):
            verify_checkpoint(p)  # a public checkpoint directory is always complete
            names.append(p.name)
    return names


def drive(config: Path, straight_config: Path, trials: int, seed: int) -> dict:
    """Run in a separate process (see the test): the fork server and the kill loop."""
    import torch
    import torch._dynamo  # noqa: F401 - the optimizer imports it lazily (seconds); once here, not per trial

    import astrai.data.datasets  # noqa: F401 - import once here, so forked trials start fast
    import astrai.train.trainer  # noqa: F401
    from astrai.train.publish import latest_checkpoint, verify_checkpoint

    torch.set_num_threads(1)
    rng = random.Random(seed)
    ckpt_dir = Path(yaml_value(config, "ckpt_dir"))
    report = {"trials": [], "during_save": 0}
    for trial in range(trials):
        latest = latest_checkpoint(ckpt_dir)
        start = _resume_step(ckpt_dir)
        event = f"{rng.choice(KILL_POINTS)}:{start + rng.randint(1, 3)}"
        marker = config.parent / f"pause-{trial}"
        pid = _fork_train(["--config", str(config), *(["--resume"] if latest is not None else [])],
                          {"ASTRAI_PAUSE_AT": event, "ASTRAI_PAUSE_FILE": str(marker)})
        paused = _wait_for_pause(pid, Path(f"{marker}.{pid}"))
        staging_now = ckpt_dir.is_dir() and any(".staging-" in p.name for p in ckpt_dir.iterdir())
        if paused:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        else:
            status = 0
        report["during_save"] += int(staging_now)
        public = _check_public_dirs(ckpt_dir)
        latest = latest_checkpoint(ckpt_dir)
        if latest is not None:
            verify_checkpoint(latest)
        report["trials"].append({"event": event, "paused": paused, "killed": paused and os.WIFSIGNALED(status),
                                 "public": public, "latest": latest.name if latest else None,
                                 "staging": staging_now})
    # finish the interrupted run, and run the same config uninterrupted for comparison
    for cfg, flags in ((config, ["--resume"]), (straight_config, [])):
        _, status = os.waitpid(_fork_train(["--config", str(cfg), *flags]), 0)
        report.setdefault("final_codes", []).append(os.waitstatus_to_exitcode(status))
    return report


def yaml_value(config: Path, key: str):
    import yaml

    for section in yaml.safe_load(config.read_text()).values():
        if isinstance(section, dict) and key in section:
            return section[key]
    raise KeyError(key)


@pytest.mark.slow
def test_kill9_fuzz_never_loses_a_checkpoint(tmp_path):
    from safetensors.torch import load_file

    from astrai.train.publish import latest_checkpoint
    from tests.train.resume_data import read_metrics, write_run, write_tokenizer

    tok = write_tokenizer(tmp_path / "tok")
    # a checkpoint after every optimizer step, so many kills land inside a save
    # long enough (120 steps) that the 24 trials, each advancing at most 3 steps, never finish the run
    flags = {"grad_accum_steps": 2, "batch_per_device": 2, "n_epoch": 12}
    config = write_run(tmp_path / "fuzz", tok, "sft", num_records=40, **flags)
    straight = write_run(tmp_path / "straight", tok, "sft", num_records=40, **flags)
    for cfg in (config, straight):
        cfg.write_text(cfg.read_text().replace("ckpt_interval: 0", "ckpt_interval: 1"))

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run(
        [sys.executable, __file__, str(config), str(straight), str(NUM_TRIALS), "0"],
        capture_output=True, text=True, timeout=500, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])

    trials = report["trials"]
    assert len(trials) == NUM_TRIALS
    assert all(t["paused"] and t["killed"] for t in trials), trials  # every kill landed where aimed
    assert {t["event"].split(":")[0] for t in trials} == set(KILL_POINTS), trials
    assert report["during_save"] >= 5, report  # kills really hit saves in progress
    assert sum(t["latest"] is not None for t in trials) >= NUM_TRIALS // 2
    assert report["final_codes"] == [0, 0]

    # the chain of killed-and-resumed runs ends where the uninterrupted run ends, bit for bit
    keys = ("step", "epoch", "lr", "loss", "grad_norm")
    got = [{k: m[k] for k in keys} for m in read_metrics(tmp_path / "fuzz")]
    want = [{k: m[k] for k in keys} for m in read_metrics(tmp_path / "straight")]
    assert got == want
    a = load_file(str(latest_checkpoint(tmp_path / "fuzz" / "ckpt") / "model.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "straight" / "ckpt") / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg, straight_cfg, n, seed = sys.argv[1:5]
    result = drive(Path(cfg), Path(straight_cfg), int(n), int(seed))
    sys.stdout.write(json.dumps(result) + "\n")
