"""Rollout traces (train/traces.py): what a tool-using episode looks like in a trace line, the
lines a short online GRPO run with tools writes, and a SIGTERM'd + resumed run's traces holding
exactly one line per traced (step, sample)."""

from __future__ import annotations

import json

from astrai.config import RLConfig
from astrai.data.tokenizer import load_tokenizer
from astrai.train.cli import main
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import Draw, EpisodeRunner
from astrai.train.traces import TraceLog, read_traces, sample_view
from tests.train.rl_runs import sigterm_after_step, write_tool_run
from tests.train.rl_user_code import USER_CODE
from tests.train.samplers import ScriptedSampler, fake_turn

FIELDS = {"split", "step", "policy_version", "policy_lag", "group", "sample", "prompt", "turns", "reward", "rewards",
          "advantage", "sampler_logp_diff", "entropy_estimate", "truncated", "masked", "group_has_signal",
          "num_tokens"}


def test_a_tool_episode_traces_its_turns_calls_arguments_and_results(tok_dir):
    tok = load_tokenizer(tok_dir)
    script = ['<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>', "408"]
    cfg = RLConfig(group_size=1, rollout_max_tokens=64, max_turns=3, tools=[f"{USER_CODE}:multiply"],
                   rewards=["exact_match"])
    sampler = ScriptedSampler(lambda turn, ids: fake_turn(tok, script[turn], stop=turn == 0), 4096)
    runner = EpisodeRunner(sampler, tok, cfg, RewardSet(cfg, tokenizer=tok), max_prompt_len=4096)
    [[e]] = runner.run([{"messages": [{"role": "user", "content": "12*34"}]}], [], [Draw(runner.sampling, 1, lambda *a: 0)],
                       policy_version=0)
    view = sample_view(e, set(tok.stop_token_ids))
    assert view["prompt"] == [{"role": "user", "content": "12*34"}]
    first, last = view["turns"]
    assert first["tool_calls"] == [{"name": "multiply", "arguments": '{"a": 12, "b": 34}', "result": "408"}]
    assert first["finish_reason"] == "stop" and first["tokens"] == len(tok.encode(script[0])) + 1
    assert (last["text"], last["finish_reason"], last["tokens"]) == ("408", "length", len(tok.encode("408")))
    assert view["truncated"]  # its last turn was cut at max_tokens


def test_resume_drops_trace_lines_past_the_restored_step_and_the_file_rotates(tmp_path):
    class Loop:
        is_main = True

        class ctx:
            step = 2

    log = TraceLog(tmp_path, 4, max_bytes=200)
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps({"step": s, "sample": 0}) + "\n" for s in (1, 2, 3)))
    log.on_train_begin(Loop())
    assert [t["step"] for t in read_traces(tmp_path)] == [1, 2]
    for step in range(3, 12):
        log.write([{"step": step, "sample": 0, "text": "x" * 40}])
    steps = [t["step"] for t in read_traces(tmp_path)]
    assert steps == sorted(steps) and steps[-1] == 11 and (tmp_path / "traces.1.jsonl").exists()
    assert (tmp_path / "traces.jsonl").stat().st_size < 200 + 100 and steps[0] > 1  # bounded: old lines gone


def test_an_online_grpo_run_with_tools_writes_its_traces(tmp_path, tok_dir):
    assert main(["--config", str(write_tool_run(tmp_path, tok_dir))]) == 0
    lines = read_traces(tmp_path / "log")
    assert [(t["step"], t["group"], t["sample"]) for t in lines] == [(s, i // 4, i % 4) for s in (1, 2, 3)
                                                                    for i in range(6)]
    for t in lines:
        assert FIELDS <= set(t), FIELDS - set(t)
        assert set(t["rewards"]) == {"exact_match", "format"} and t["policy_lag"] == 0
        assert t["sampler_logp_diff"] < 1e-5 and t["prompt"][-1]["role"] == "user"
        assert t["turns"][0]["role"] == "assistant" and t["turns"][0]["tokens"] >= 1
        assert sum(t["rewards"].values()) == t["reward"]  # unit weights


def test_a_sigterm_and_resume_leaves_one_trace_line_per_step_and_sample(tmp_path, tok_dir):
    config = write_tool_run(tmp_path, tok_dir)
    sigterm_after_step(config, 2, tmp_path)
    assert {t["step"] for t in read_traces(tmp_path / "log")} == {1, 2}
    assert main(["--config", str(config), "--resume"]) == 0
    keys = [(t["step"], t["group"], t["sample"]) for t in read_traces(tmp_path / "log")]
    assert keys == [(s, i // 4, i % 4) for s in (1, 2, 3) for i in range(6)]


def test_astrai_traces_worst_prints_the_lowest_reward_samples_of_the_last_step(tmp_path, capsys):
    from astrai.cli import main as astrai

    rewards = {1: [0.0, 0.5, 1.0, 0.2], 2: [0.9, 0.1, 0.7, 0.3]}
    lines = [{"split": "train", "step": s, "group": 0, "sample": i, "reward": r, "rewards": {"exact_match": r},
              "advantage": r - 0.5, "prompt": [{"role": "user", "content": f"q{s}"}],
              "turns": [{"role": "assistant", "text": f"answer {s}.{i}", "tokens": 3, "finish_reason": "stop",
                         "tool_calls": [{"name": "multiply", "arguments": "{}", "result": "8"}]}]}
             for s, rs in rewards.items() for i, r in enumerate(rs)]
    (tmp_path / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in lines))
    assert astrai(["traces", str(tmp_path), "--worst", "3"]) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("step ")]
    assert [h.split("  ")[2] for h in heads] == ["sample 1", "sample 3", "sample 2"]  # rewards 0.1, 0.3, 0.7
    assert "reward 0.100 (exact_match 0.100)  advantage -0.400" in heads[0]
    assert "answer 2.1" in out and "tool multiply({}) -> 8" in out and "answer 1." not in out
    assert astrai(["traces", str(tmp_path), "--step", "1", "--best", "1"]) == 0
    assert "answer 1.2" in capsys.readouterr().out
    assert astrai(["traces", str(tmp_path), "--grep", "ANSWER 2.3"]) == 0
    assert capsys.readouterr().out.count("\nstep ") == 0  # one sample: no second header
    assert astrai(["traces", str(tmp_path / "none")]) == 1
    assert "no traces.jsonl lines" in capsys.readouterr().err
