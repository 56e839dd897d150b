"""`astrai demo --algo tools` at its default budget: the calculator example learns on a CPU.

The SFT model calls the `multiply` tool in about 70% of its sampled episodes (as often as its
traces did) and answers the rest from its head, wrongly; online GRPO with `CalculatorEnv` makes it
call the tool nearly always. Measured 2026-12-04 over 7 runs (seeds 0-4 at one thread, seeds 0
and 1 at two threads; each seed also draws its own problems), on the 100 held-out problems, sampled
at temperature 1 (4 episodes per problem, the rollouts' policy), SFT -> RL, seeds 0, 1, 2, 3, 4 at
one thread (at two threads seeds 0 and 1 gave the same figures as at one):
  tool use  72 -> 99, 69 -> 96, 62 -> 99, 69 -> 99, 67 -> 98%   (gain +27 to +37 points)
  accuracy  72.0 -> 97.0, 63.5 -> 91.5, 62.0 -> 97.0, 66.0 -> 95.2, 52.0 -> 81.5%   (gain +25 to +35)
  rollout reward (first / last 10 steps)  0.79 -> 0.95, 0.75 -> 0.91, 0.69 -> 0.97, 0.84 -> 0.96,
            0.62 -> 0.82
Greedy decoding already calls the tool after SFT (the call is its single most likely first
token), so greedy accuracy is what copying the result allows: 83-100% after SFT, 87-100% after RL;
it is reported, not asserted. Copying the tool's result is learned abruptly during SFT (the loss
falls from about 0.45 to below 0.2 within a few hundred steps, between steps 700 and 2,300 in
these runs). With 2,000 SFT steps (the setting before 2026-12-04) a run that had not yet reached that
point copied badly: seeds 0 and 4 gave 12.8 -> 20.8% and 22.0 -> 31.2% on 2026-12-02, and after
that day's float rounding changes seed 0 at one thread stayed at 3% (SFT loss 0.26 against 0.13
when copying is learned), so SFT now runs 3,000 steps. Margins, about half the measured minimum:
tool use +13 points, accuracy +12 points; the rollout reward must rise. With 2 layers, or with 50%
of the traces calling the tool, copying the result was not learned at all for some seeds
(held-out accuracy about 1%), so those settings were dropped. About 6 minutes on 2 idle cores.
"""

from __future__ import annotations

import json

import pytest

from astrai.demo import main as demo_main

SEED, THREADS = 0, 1
TOOL_USE_GAIN, SAMPLED_ACCURACY_GAIN = 0.13, 0.12


@pytest.mark.slow
def test_tools_demo_raises_tool_use_and_accuracy(tmp_path, capsys):
    out = tmp_path / "demo-tools"
    flags = ["--algo", "tools", "--out", str(out), "--seed", str(SEED), "--threads", str(THREADS)]
    assert demo_main(flags) == 0
    before = json.loads((out / "eval" / "stage.json").read_text())
    rl = json.loads((out / "rl-tools" / "stage.json").read_text())
    after = rl["eval"]
    s0, s1 = before["sampled"], after["sampled"]
    print(f"rollout tool use {rl['tool_use_first']:.3f} -> {rl['tool_use_last']:.3f}, reward {rl['reward_first']:.3f} -> "
          f"{rl['reward_last']:.3f}; held-out sampled accuracy {s0['accuracy']:.3f} -> {s1['accuracy']:.3f}, tool use "
          f"{s0['tool_use']:.3f} -> {s1['tool_use']:.3f}; greedy {before['greedy']['accuracy']:.3f} -> "
          f"{after['greedy']['accuracy']:.3f}")
    assert s1["tool_use"] >= s0["tool_use"] + TOOL_USE_GAIN, (s0, s1)
    assert s1["accuracy"] >= s0["accuracy"] + SAMPLED_ACCURACY_GAIN, (s0, s1)
    assert s1["tool_errors"] <= s1["num_total"] // 10  # the calls it learned are well formed
    assert rl["reward_last"] > rl["reward_first"]
    report = (out / "report.md").read_text()
    for value in (s0["accuracy"], s1["accuracy"], before["greedy"]["accuracy"], after["greedy"]["accuracy"]):
        assert f"{value:.1%}" in report
    assert "tool use" in report
    for name in ("sft", "rl-tools"):
        assert (out / name / "final" / "model.safetensors").exists()
    assert (out / "rl-tools" / "plots" / "tool_use_rate.png").exists()
    assert (out / "accuracy.png").exists()
    printed = capsys.readouterr().out
    assert "held-out accuracy (greedy)" in printed and "astrai serve --model" in printed
    assert demo_main(flags) == 0  # a second run finds every stage finished
    second = capsys.readouterr().out
    for name in ("data", "tokenizer", "sft", "eval", "rl-tools"):
        assert f"[{name}] reusing the finished stage" in second
