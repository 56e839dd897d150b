"""Online RL: rollouts, rewards, policy versions, the online loop through the CLI, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from astrai.config import ConfigError, RLConfig, load_config
from astrai.data.tasks import generate_items, prompt_record
from astrai.train.cli import main
from astrai.train.publish import latest_checkpoint, verify_checkpoint
from astrai.train.rl.loop import check_policy_lag
from astrai.train.rl.rewards import RewardSet
from tests.train.resume_data import MODEL, read_metrics
from tests.train.rl_runs import REPO, checkpoint_weights, sigterm_after_step, write_rl_run

# ------------------------------------------------------------------------------ rewards


def bad_reward(prompt, completion, record):
    return float("nan") if record.get("n") == 3 else 1.0


def test_reward_errors_name_the_function_and_prompt():
    rewards = RewardSet(RLConfig(rewards=["tests.train.test_rl:bad_reward"]))
    records = [{"n": i} for i in range(6)]
    with pytest.raises(ValueError, match=r"tests.train.test_rl:bad_reward.*completion 1 of prompt 1"):
        rewards(["p"] * 6, ["c"] * 6, records, [[1]] * 6, group_size=2)

    rewards.functions = [lambda p, c, r: [1.0, 2.0]]  # a list where a float is due: wrong type
    with pytest.raises(ValueError, match="completion 0 of prompt 0"):
        rewards(["p"] * 2, ["c"] * 2, [{}, {}], [[1]] * 2, group_size=2)


def test_builtin_rewards_andcheckpoint_weights():
    cfg = RLConfig(rewards=["exact_match", "format", "length"], reward_weights=[1.0, 0.5, 2.0], length_target=4)
    total, terms = RewardSet(cfg)(["p", "p"], [" 12 ", "twelve and more"], [{"answer": "12"}] * 2, [[1], [1]], 2)
    assert terms["exact_match"].tolist() == [1.0, 0.0]
    assert terms["format"].tolist() == [1.0, 0.0]
    assert terms["length"].tolist() == [0.0, -1.0]  # 15 characters: past twice the target of 4
    assert total.tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="unknown reward 'exact'"):
        RewardSet(RLConfig(rewards=["exact"]))


def test_final_number_reward_checks_the_last_number_against_the_answer():
    cfg = RLConfig(rewards=["final_number", "exact_match"], reward_weights=[1.0, 0.5])
    completions = ["3 + 4 = 7.", "7", "The answer is 8", "seven"]
    total, terms = RewardSet(cfg)(["p"] * 4, completions, [{"answer": "7"}] * 4, [[1]] * 4, 2)
    assert terms["final_number"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert terms["exact_match"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert total.tolist() == [1.0, 1.5, 0.0, 0.0]
    with pytest.raises(ValueError, match="final_number needs an 'answer'"):
        RewardSet(RLConfig(rewards=["final_number"]))(["p"] * 2, ["1", "2"], [{}, {}], [[1]] * 2, 2)


def test_policy_lag_and_future_versions_are_errors():
    check_policy_lag(3, 4, max_lag=1)
    with pytest.raises(ValueError, match="version 2 is 2 versions behind the current version 4"):
        check_policy_lag(2, 4, max_lag=1)
    with pytest.raises(ValueError, match="generated at policy version 5, newer than the current version 4"):
        check_policy_lag(5, 4, max_lag=1)


def test_online_dpo_needs_two_samples_per_prompt():
    with pytest.raises(ConfigError, match="online_dpo needs group_size >= 2"):
        load_config(None, ["--train_type", "online_dpo", "--group_size", "1"])


def test_rl_fields_are_in_the_dry_run(capsys):
    from astrai.train.cli import main as train_main

    assert train_main(["--train_type", "online_grpo", "--group_size", "8", "--dry_run"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["rl"]["group_size"] == 8 and out["rl"]["rewards"] == ["exact_match"]
    for name in ("rollout_interval", "rollout_max_tokens", "rollout_temperature", "rollout_top_p", "rollout_top_k",
                 "max_prompt_len", "max_policy_lag", "clip_eps", "clip_eps_high", "kl_coef", "scale_rewards",
                 "rl_loss_agg", "reward_weights"):
        assert name in out["rl"]


# ------------------------------------------------------------------------------ the loop


def test_online_grpo_runs_and_logs_rollout_metrics(tmp_path, tok_dir):
    config = write_rl_run(tmp_path, tok_dir, rollout_interval=2)
    assert main(["--config", str(config)]) == 0
    lines = read_metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["policy_version"] for m in lines] == [1, 2, 3, 4]
    assert [m["rollout_policy_version"] for m in lines] == [0, 0, 2, 2]  # each rollout serves two steps
    first = lines[0]
    for key in ("reward_mean", "reward_std", "reward_std_batch", "rewards/exact_match", "rewards/exact_match_rate", "rewards/format",
                "response_length_mean", "response_length_max", "clip_fraction", "approx_kl", "rollout_tokens_per_s",
                "rollout_time_share", "skipped_prompts"):
        assert key in first, key
    # the trainer recomputes the sampler's log-probs: in fp32 they agree to rounding
    assert first["sampler_logp_diff"] < 1e-5
    assert "sampler_logp_diff" not in lines[1] and "rollout_tokens_per_s" not in lines[1]  # a reused rollout
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["policy_version"] == 4
    verify_checkpoint(ckpt)
    assert "rollout.pt" in json.loads((ckpt / "manifest.json").read_text())["files"]


def test_over_long_prompts_are_skipped_and_counted(tmp_path, tok_dir, capsys):
    items = generate_items(8, ["add"], digits=2, seed=1)
    records = [prompt_record(it) for it in items]
    records[1]["messages"][-1]["content"] = "what is " + "1 + " * 40 + "1?"  # far over max_prompt_len
    config = write_rl_run(tmp_path, tok_dir, records=records, max_prompt_len=48)
    assert main(["--config", str(config), "--max_steps", "2"]) == 0
    assert "skipped 1 prompt(s) longer than max_prompt_len=48" in capsys.readouterr().err
    assert sum(m.get("skipped_prompts", 0) for m in read_metrics(tmp_path)) == 1


def test_online_dpo_runs(tmp_path, tok_dir):
    config = write_rl_run(tmp_path, tok_dir, train_type="online_dpo", rewards=["format"])
    assert main(["--config", str(config)]) == 0
    lines = read_metrics(tmp_path)
    assert len(lines) == 4 and all("skipped_groups" in m for m in lines if "rollout_seconds" in m)


def test_instruction_records_use_output_as_the_answer_and_never_render_it(tmp_path, tok_dir):
    from astrai.data.datasets import build_dataset
    from astrai.data.tokenizer import load_tokenizer

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"instruction": "add", "input": "2 + 3", "output": "5"}) + "\n")
    tok = load_tokenizer(tok_dir)
    row = build_dataset("prompt", path, tok, 128)[0]
    assert row["answer"] == "5"
    assert [m["role"] for m in row["messages"]] == ["system", "user"]
    assert "5" not in tok.decode(row["prompt_ids"]).replace("2 + 3", "")


def test_prefix_cache_never_serves_kv_across_a_policy_update():
    from astrai.infer.engine import LLMEngine
    from astrai.infer.sampling import SamplingParams
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM

    model = CausalLM(ModelConfig(**MODEL), seed=0).eval()
    engine = LLMEngine(model, None, block_size=4, kv_cache_tokens=512)
    prompt = list(range(3, 23))
    params = SamplingParams(temperature=0, max_tokens=2)
    engine.run_batch([prompt], params)
    assert engine.run_batch([prompt], params)[0].num_cached_tokens > 0  # same weights: a prefix hit
    engine.set_policy_version(1)
    out = engine.run_batch([prompt], params)[0]
    assert out.num_cached_tokens == 0 and out.policy_version == 1  # new weights: recomputed
    with pytest.raises(ValueError, match="must not decrease"):
        engine.set_policy_version(0)


# ------------------------------------------------------------------------------ exact resume


@pytest.mark.slow
def test_sigterm_and_resume_equals_the_uninterrupted_run(tmp_path, tok_dir):
    """A stop after step 3 (inside a rollout reused for two steps) resumes bit for bit."""
    straight = write_rl_run(tmp_path / "straight", tok_dir, rollout_interval=2)
    stopped = write_rl_run(tmp_path / "stopped", tok_dir, rollout_interval=2)
    for cfg in (straight, stopped):
        cfg.write_text(cfg.read_text().replace("max_steps: 4", "max_steps: 6"))
    assert main(["--config", str(straight)]) == 0

    sigterm_after_step(stopped, 3, tmp_path)
    assert latest_checkpoint(tmp_path / "stopped" / "ckpt").name == "step_00000003"
    assert main(["--config", str(stopped), "--resume"]) == 0

    keys = ("step", "policy_version", "rollout_policy_version", "loss", "grad_norm", "reward_mean", "lr")
    got = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "stopped")]
    want = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "straight")]
    assert got == want
    a, b = checkpoint_weights(tmp_path / "stopped"), checkpoint_weights(tmp_path / "straight")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


# ------------------------------------------------------------------------------ offline grpo


def test_offline_grpo_without_logprobs_uses_the_policys_own_hand_checked_loss(tmp_path, tok_dir):
    """With no behaviour log-probs the ratio is 1, so the first step's loss is -mean_token(A)."""
    from astrai.data.datasets import build_dataset
    from astrai.data.tokenizer import load_tokenizer

    rec = {"messages": [{"role": "user", "content": "1 + 1"}], "responses": ["2", "one one one one", "2 2"],
           "rewards": [1, 0, 0.5]}
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    config = write_rl_run(tmp_path, tok_dir, train_type="grpo")
    config.write_text(config.read_text().replace(str(tmp_path / "prompts.jsonl"), str(path)))
    assert main(["--config", str(config), "--max_steps", "1", "--batch_per_device", "1", "--grad_accum_steps", "1",
                 "--max_grad_norm", "0"]) == 0
    ds = build_dataset("rollout", path, load_tokenizer(tok_dir), 128)
    lengths = [len(r) for r in ds[0]["responses"]]
    assert len(set(lengths)) == 3  # the loss weighs each response by its tokens
    # rewards [1, 0, 0.5]: mean 0.5, population std sqrt(1/6) (above reward_std_floor), plus 1e-8
    std = (1 / 6) ** 0.5 + 1e-8
    adv = [0.5 / std, -0.5 / std, 0.0]
    expected = -sum(a * n for a, n in zip(adv, lengths)) / sum(lengths)
    assert abs(expected) > 0.1
    assert read_metrics(tmp_path)[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_rollout_records_are_checked_field_by_field(tmp_path, tok_dir):
    from astrai.data.records import RecordError, encode_record
    from astrai.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tok_dir)
    base = {"prompt": "1 + 1", "responses": ["2", "3"], "rewards": [1.0, 0.0]}
    encode_record(base, "rollout", tok, 128)
    with pytest.raises(RecordError, match="'rewards' must list one finite number per response"):
        encode_record({**base, "rewards": [1.0, float("nan")]}, "rollout", tok, 128)
    with pytest.raises(RecordError, match=r"'logprobs\[0\]' has 1 entries"):
        encode_record({**base, "logprobs": [[-0.1], [-0.2]]}, "rollout", tok, 128)


def rank0_only_reward(prompt, completion, record):
    """Distinct rewards on rank 0 only: rank 1's groups are all tied (no online DPO pairs there)."""
    return float(len(completion) % 3) if os.environ.get("RANK", "0") == "0" else 0.0


@pytest.mark.slow
def test_online_dpo_under_ddp_when_one_rank_has_no_pairs(tmp_path, tok_dir):
    config = write_rl_run(tmp_path, tok_dir, train_type="online_dpo",
                          rewards=["tests.train.test_rl:rank0_only_reward"])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "astrai", "train", "--config", str(config), "--nprocs", "2",
                        "--parallel_mode", "ddp", "--max_steps", "2"], capture_output=True, text=True, env=env,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["num_loss_units"] > 0 for m in lines)  # rank 0's pairs trained; rank 1 only joined the sync


# ------------------------------------------------------------------------------ mini-batches


def test_mini_batches_clip_and_count_their_steps(tmp_path, tok_dir):
    """mini_batches 4: each rollout of 16 samples gives 4 optimizer steps of 4 samples; the old
    log-probs are pinned before the first, so the later ones see their ratio move and the clip act
    (with rollout_interval alone, one step per rollout, clip_fraction is 0 on every step)."""
    from astrai.train.rl.loop import OnlineLoop

    config = write_rl_run(tmp_path, tok_dir, mini_batches=4, clip_eps=0.02, max_policy_lag=3,
                          rewards=["tests.train.rl_user_code:varied_reward"])
    config.write_text(config.read_text().replace("max_steps: 4", "max_steps: 8"))
    assert main(["--config", str(config)]) == 0
    rows = read_metrics(tmp_path)
    assert [m["rollout_policy_version"] for m in rows] == [0, 0, 0, 0, 4, 4, 4, 4]
    assert rows[0]["clip_fraction"] == 0.0 and rows[4]["clip_fraction"] == 0.0  # the weights of the rollout
    assert max(m["clip_fraction"] for m in rows) > 0
    assert all(m["clip_fraction"] > 0 for i, m in enumerate(rows) if i % 4 == 3)
    assert "sampler_logp_diff" in rows[0] and "sampler_logp_diff" not in rows[1]
    # the schedule's length counts mini-batch steps: 16 prompts / 4 per rollout x 4 steps x 2 passes
    loop = OnlineLoop(load_config(config, ["--max_steps", "null", "--ppo_epochs", "2", "--max_policy_lag", "7"]))
    assert loop.total_steps == 4 * 4 * 2 and loop.steps_per_rollout == 8
    with pytest.raises(ConfigError, match=r"mini_batches=4 x ppo_epochs=2 = 8 steps reuse a rollout until it is 7 "
                                          "policy versions old, more than max_policy_lag=3"):
        load_config(config, ["--ppo_epochs", "2"])
    with pytest.raises(ConfigError, match="with mini-batches set the passes with --ppo_epochs"):
        load_config(config, ["--rollout_interval", "2"])
    with pytest.raises(ConfigError, match="mini_batches=4 applies to online_grpo and online_ppo"):
        load_config(config, ["--train_type", "online_dpo"])


@pytest.mark.slow
def test_a_stop_inside_a_rollouts_mini_batches_resumes_exactly(tmp_path, tok_dir):
    """mini_batches 2, ppo_epochs 2: a stop after step 3 (the second pass's first mini-batch) resumes
    into the same mini-batch order and the same pinned old log-probs, bit for bit; with ref_ema 0.5
    the moved KL reference comes back too (reference_model.pt), so the kl term matches."""
    runs = {}
    for name in ("straight", "stopped"):
        runs[name] = write_rl_run(tmp_path / name, tok_dir, mini_batches=2, ppo_epochs=2, clip_eps=0.02,
                                  kl_coef=0.1, ref_ema=0.5, rewards=["tests.train.rl_user_code:varied_reward"])
        runs[name].write_text(runs[name].read_text().replace("max_steps: 4", "max_steps: 6"))
    assert main(["--config", str(runs["straight"])]) == 0
    sigterm_after_step(runs["stopped"], 3, tmp_path)
    assert main(["--config", str(runs["stopped"]), "--resume"]) == 0
    keys = ("step", "policy_version", "rollout_policy_version", "loss", "grad_norm", "clip_fraction", "kl", "lr")
    got = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "stopped")]
    want = [{k: m.get(k) for k in keys} for m in read_metrics(tmp_path / "straight")]
    assert got == want and [m["rollout_policy_version"] for m in want] == [0, 0, 0, 0, 4, 4]
    assert want[4]["kl"] > 0  # the reference moved (step 5 runs after the resume)
    a, b = checkpoint_weights(tmp_path / "stopped"), checkpoint_weights(tmp_path / "straight")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
