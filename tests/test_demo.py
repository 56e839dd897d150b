"""The quickstart at its default budget: every stage runs, SFT clearly beats pre-training, online
GRPO raises the rollout reward, and a second run reuses every stage; docs/operations.md states the
demo's real flags and task, and the report's budget line is no run time.

A seeded run takes another path on another CPU, so the assertions rest on a spread measured
across 5 runs: SEED 0 at THREADS 1 and 2, and training seeds 1, 2, 3 at one thread (the task
split kept at seed 0, as on any machine). Greedy held-out accuracy on the 40 held-out sums
(min / mean / max): pre-trained 0 / 0 / 0%, SFT 5 / 27 / 42.5%, after GRPO 15 / 39 / 57.5%;
GRPO's change over SFT -5 / +12 / +30 points greedy, so held-out accuracy is not asserted to rise
under RL (at seed 1 it falls 40% -> 35%). The rollout reward on the training prompts rises in
every run: first 0.20-0.46, last 0.46-0.75 (means of 10 steps), the share of the room left that
it closed, (last - first) / (1 - first), 0.33 / 0.47 / 0.55 (seed 0 at one thread: 27.5% ->
57.5%, reward 0.41 -> 0.67, gain 0.44). Margins, about half the measured minimum: SFT +2.5
points over pre-training (one problem of 40; measured minimum +5, seed 2) and GRPO reward gain
0.2 (the minimum 0.33 at seed 2; the reward of a model that does not learn drifts by about
0.07-0.09 of the room, tests/train/test_rl_learns.py). About 60 s at one thread on idle cores,
several minutes when shared. Earlier spreads, and why pre-training is short: docs/performance.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astrai.demo import main as demo_main

ROOT = Path(__file__).resolve().parent.parent

SEED, THREADS = 0, 1  # the spread above was measured around these
SFT_GAIN, REWARD_GAIN = 0.025, 0.2


@pytest.mark.slow
def test_demo_sft_raises_accuracy_rl_raises_reward_and_stages_are_reused(tmp_path, capsys):
    out = tmp_path / "demo"
    flags = ["--out", str(out), "--seed", str(SEED), "--threads", str(THREADS)]
    assert demo_main(flags) == 0
    evals = json.loads((out / "eval" / "stage.json").read_text())
    rl = json.loads((out / "rl-grpo" / "stage.json").read_text())
    before, sft, after = evals["pretrained"]["accuracy"], evals["sft"]["accuracy"], rl["eval"]["accuracy"]
    assert sft >= before + SFT_GAIN, f"SFT accuracy {sft:.1%} is not clearly above pre-training {before:.1%}"
    assert sft <= 0.9, f"SFT accuracy {sft:.1%} leaves RL no headroom; shorten the SFT stage"
    assert rl["steps"] == 300
    first, last = rl["reward_first"], rl["reward_last"]
    gain = (last - first) / (1 - first)
    print(f"held-out accuracy {before:.1%} -> SFT {sft:.1%} -> GRPO {after:.1%} (not asserted: see above); "
          f"rollout reward {first:.3f} -> {last:.3f}, gain {gain:.3f} of the room left")
    assert gain >= REWARD_GAIN, f"GRPO's rollout reward went {first:.3f} -> {last:.3f}: {gain:.2f} of the room " \
                                f"left closed, expected {REWARD_GAIN}"
    assert rl["rollout_tokens_per_s"] > 0
    report = (out / "report.md").read_text()
    for acc in (before, sft, after):
        assert f"{acc:.1%}" in report
    assert "reward" in report and "rollout generation" in report
    for name in ("pretrain", "sft", "rl-grpo"):
        assert (out / name / "final" / "model.safetensors").exists()
        assert any((out / name / "plots").glob("*.png"))
    assert (out / "rl-grpo" / "plots" / "reward_mean.png").exists()
    assert (out / "rl-grpo" / "plots" / "response_length_mean.png").exists()
    assert (out / "accuracy.png").exists()
    assert "astrai serve --model" in capsys.readouterr().out
    # a second run finds every stage finished and only rewrites the report
    assert demo_main(flags) == 0
    second = capsys.readouterr().out
    for name in ("data", "tokenizer", "pretrain", "sft", "eval", "rl-grpo"):
        assert f"[{name}] reusing the finished stage" in second
    assert "[rl-grpo] running" not in second


def test_operations_doc_states_the_demos_real_flags_and_task():
    from astrai.demo import TASK

    text = (ROOT / "docs" / "operations.md").read_text()
    assert "[--scale 1]" in text and f"({TASK['digits']}-digit addition)" in text


def test_the_reports_budget_line_is_not_a_run_time(tmp_path):
    from astrai.demo import write_report

    ev = {"accuracy": 0.5, "num_correct": 1, "num_total": 2, "tokens_per_s": 1.0, "samples": []}
    stages = {name: {"seconds": 1.0} for name in ("data", "tokenizer", "pretrain", "sft")}
    stages["eval"] = {"pretrained": ev, "sft": ev, "seconds": 1.0}
    stages["rl-grpo"] = {"eval": ev, "seconds": 1.0}
    text = write_report(tmp_path, stages, 1.0, "grpo").read_text()
    assert "Steps: --scale 1 (multiplies every stage's steps" in text and "Budget: 8.0 min" not in text


@pytest.mark.parametrize("argv, message", [(["--scale", "0"], "--scale must be positive, got 0"),
                                           (["--minutes", "-1"], "--minutes must be positive")])
def test_a_step_scale_that_is_not_positive_is_one_line(argv, message, capsys):
    from astrai.demo import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_quick_is_a_setting_of_the_tools_demo(capsys):
    with pytest.raises(SystemExit):
        demo_main(["--quick", "--algo", "ppo"])
    assert "--quick is a setting of --algo tools, not of --algo ppo" in capsys.readouterr().err
