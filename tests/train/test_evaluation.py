"""Evaluation during training runs through the rollouts' episode runner: a run with an environment
or tools evaluates with them (multi-turn, greedy and sampled), and ``answer`` scores episodes with
the exact-match scoring of ``astrai eval --data`` on any sampler."""

from __future__ import annotations

from astrai.config import RLConfig
from astrai.data.tasks import score_completions
from astrai.data.tokenizer import load_tokenizer
from astrai.train.cli import main
from astrai.train.evaluation import answer
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import Draw, EpisodeRunner
from tests.train.resume_data import write_tokenizer
from tests.train.rl_runs import eval_file, eval_rows, with_eval, write_rl_run
from tests.train.rl_user_code import USER_CODE
from tests.train.samplers import ScriptedSampler, fake_turn


def test_an_environment_run_evaluates_with_its_environment(tmp_path):
    """ScriptedEnv: every episode runs three turns and earns 0.5 + 0.5 + 1.0 from the environment,
    whatever the model says; the eval rows see that reward, greedy and sampled, and the length of
    all three turns (a single-turn evaluation saw one turn and no environment reward)."""
    tok_dir = write_tokenizer(tmp_path / "tok")
    config = write_rl_run(tmp_path, tok_dir, environment=f"{USER_CODE}:ScriptedEnv", rewards=["exact_match"],
                          rollout_max_tokens=4)
    with_eval(config, eval_file(tmp_path / "eval.jsonl"))
    assert main(["--config", str(config), "--max_steps", "2"]) == 0
    rows = eval_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 2]
    for row in rows:
        assert row["eval/greedy_reward_mean"] == 2.0 and row["eval/reward_mean"] == 2.0  # the environment's
        assert 4 < row["eval/response_length"] <= 3 * 4  # tokens of up to three turns of at most 4
        assert row["eval/tool_use_rate"] == 0.0  # ScriptedEnv offers no tool


def test_answer_scores_every_draw_with_the_exact_match_scoring(tmp_path):
    tok = load_tokenizer(write_tokenizer(tmp_path / "tok"))
    records = [{"messages": [{"role": "user", "content": q}], "answer": a} for q, a in (("1+1", "2"), ("2+2", "5"))]
    prompt_ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
    cfg = RLConfig(rewards=["exact_match"], rollout_max_tokens=4)
    sampler = ScriptedSampler(lambda turn, ids: fake_turn(tok, "2" if ids == prompt_ids[0] else "4", stop=False),
                              policy_version=7)
    runner = EpisodeRunner(sampler, tok, cfg, RewardSet(cfg, tokenizer=tok), max_prompt_len=32)
    greedy, sampled = answer(runner, records, prompt_ids, [Draw(runner.sampling.greedy(), 1, lambda *a: None),
                                                           Draw(runner.sampling, 3, lambda i, *more: 100 + i)],
                             policy_version=7)
    assert greedy.correct == [1.0, 0.0] == score_completions(["2", "4"], ["2", "5"])
    assert sampled.correct == [1.0] * 3 + [0.0] * 3 and sampled.rewards.tolist() == sampled.correct
    assert greedy.num_tokens == 2 and sampled.num_tokens == 6
    assert greedy.num_truncated == 2  # cut off (finish reason "length"), as a reply without its stop token is
    # one request per prompt and draw, the draw's sampling, n and seeds
    assert [(r.sampling.temperature, r.n, r.seed) for r in sampler.requests] == [
        (0.0, 1, None), (0.0, 1, None), (1.0, 3, 100), (1.0, 3, 101)]
