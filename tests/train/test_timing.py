"""Where each second of a step goes (train/timing.py): the time_* metrics of an online GRPO run
with tools and of an offline run, the shares in the run summary, and each rank's own log."""

from __future__ import annotations

import json

import pytest

from astrai.train.cli import main
from astrai.train.timing import RankLog, StepTimes, format_time_shares, time_shares
from astrai.train.trainer import Trainer
from tests.train.resume_data import read_metrics
from tests.train.rl_runs import write_tool_run
from tests.train.toydata import ToySeqDataset
from tests.train.trainer_utils import tiny_config, tiny_model

INSIDE = ("time_rollout", "time_reference", "time_forward_backward", "time_optimizer", "time_weight_sync")


def test_an_online_step_is_split_into_its_parts_and_the_summary_gives_the_shares(tmp_path, tok_dir, capsys):
    config = write_tool_run(tmp_path, tok_dir)
    config.write_text(config.read_text().replace("ckpt_interval: 0", "ckpt_interval: 1"))
    assert main(["--config", str(config)]) == 0
    lines = read_metrics(tmp_path)
    for m in lines:
        for key in (*INSIDE, "time_step", "time_generation", "time_tools", "time_environment", "time_rewards",
                    "time_other"):
            assert key in m and m[key] >= 0, key
        assert sum(m[k] for k in INSIDE) <= m["time_step"] + 1e-6
        rollout_parts = ("time_generation", "time_tools", "time_environment", "time_rewards")
        assert sum(m[k] for k in rollout_parts) <= m["time_rollout"] + 1e-6
        assert m["time_other"] == pytest.approx(m["time_step"] - sum(m[k] for k in INSIDE), abs=1e-9)
        assert m["time_rollout"] == m["rollout_seconds"]
    assert "time_checkpoint" not in lines[0] and lines[1]["time_checkpoint"] > 0  # step 1's save, after its line
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("  time: ")]
    assert line.startswith("  time: rollout ") and "(generation " in line and "checkpoint " in line


def test_an_offline_step_has_its_forward_backward_and_optimizer_times(tmp_path):
    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--max_steps", "2", "--grad_accum_steps", "2")
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(16))
    t.train()
    for m in map(json.loads, (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()):
        assert m["time_forward_backward"] > 0 and m["time_optimizer"] > 0
        assert m["time_forward_backward"] + m["time_optimizer"] + m["time_other"] == pytest.approx(m["time_step"])


def test_shares_and_their_line():
    times = StepTimes()
    times.add("forward_backward", 1.0)
    times.add("checkpoint", 1.0)  # published after the previous step: outside this step's time
    m = times.take(4.0, {"rollout_seconds": 2.0, "generation_seconds": 1.5, "reward_seconds": 0.25})
    assert m == {"time_step": 4.0, "time_checkpoint": 1.0, "time_forward_backward": 1.0, "time_generation": 1.5,
                 "time_rewards": 0.25, "time_rollout": 2.0, "time_other": 1.0}
    assert times.take(1.0) == {"time_step": 1.0, "time_other": 1.0}
    shares = time_shares(m)
    assert format_time_shares(shares) == ("rollout 40% (generation 30%, rewards 5%), forward_backward 20%, "
                                          "optimizer 0%, checkpoint 20%, other 20%")


def test_each_rank_writes_its_own_log_and_a_resume_drops_lines_past_its_step(tmp_path):
    class Loop:
        step_metrics = {"step": 1, "loss": 2.0, "time_step": 0.5, "time_rollout": 0.25}
        rollout = None

        class ctx:
            step = 0

    log = RankLog(tmp_path, rank=1)
    loop = Loop()
    log.on_train_begin(loop)
    for step in (1, 2, 3):
        loop.ctx.step = step
        log.after_optimizer_step(loop)
    path = tmp_path / "ranks" / "rank_1.jsonl"
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 1, "rank": 1, "time_step": 0.5,
                                                            "time_rollout": 0.25}
    loop.ctx.step = 2
    RankLog(tmp_path, rank=1).on_train_begin(loop)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
