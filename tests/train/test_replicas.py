"""`astrai train --rollout_replicas 1` (train/replicas.py) on the CPU: one command starts an `astrai
serve` replica and the trainer, trains from the replica, and a SIGTERM stops the trainer at a step
with a checkpoint and leaves no process behind."""

from __future__ import annotations

import json
import os

import yaml

from astrai.train.publish import latest_checkpoint
from tests.train.rl_runs import sigterm_after_step, write_rl_run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_one_command_runs_a_replica_and_leaves_nothing_after_sigterm(tok_dir, tmp_path):
    config = write_rl_run(tmp_path / "run", tok_dir, rollout_replicas=1)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["max_steps"] = 3
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    sigterm_after_step(config, 1, tmp_path)  # to the launcher: it stops the trainer, then the replica
    assert latest_checkpoint(tmp_path / "run" / "ckpt").name == "step_00000001"
    pids = json.loads((tmp_path / "run" / "log" / "replicas.json").read_text())
    assert len(pids["replicas"]) == 1
    assert not any(_alive(p) for p in [pids["trainer"]["pid"], *(r["pid"] for r in pids["replicas"])])
    rows = [json.loads(line) for line in (tmp_path / "run" / "log" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["sampler_logp_diff"] <= 1e-5 and "weight_sync_seconds" in rows[0]
