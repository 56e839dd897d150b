"""The rollout engine's KV pool between rollouts (`rl.keep_kv_pool`): by default it is freed after
each rollout and each evaluation and made again for the next, sized to that batch; kept, it
stays as it was made at the start. Either way a run draws the same samples and logs the same
losses and rewards, single-turn and multi-turn."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.config import RLConfig, load_config
from astrai.data.tokenizer import load_tokenizer
from astrai.infer.sizing import batch_kv_tokens
from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM
from astrai.train.cli import main
from astrai.train.rl.engine_sampler import engine_runner
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import EpisodeRunner
from tests.train.resume_data import MODEL
from tests.train.rl_runs import eval_file, prompt_batch, with_eval, write_rl_run
from tests.train.rl_user_code import USER_CODE

TIMING = ("seconds", "_per_s", "time_share", "time_")  # wall-clock metrics differ from run to run


def _runner(tok_dir, keep: bool, **rl) -> EpisodeRunner:
    tokenizer = load_tokenizer(tok_dir)
    model = CausalLM(ModelConfig(**MODEL), seed=0)
    cfg = RLConfig(group_size=2, rollout_max_tokens=4, max_prompt_len=32, keep_kv_pool=keep, **rl)
    return engine_runner(model, tokenizer, cfg, 2 * cfg.group_size, RewardSet(cfg, tokenizer=tokenizer))


def _pool_sizes(runner: EpisodeRunner) -> list[int]:
    """Blocks of the engine's pool at each run_batch call, recorded as the runner generates."""
    engine = runner.sampler.engine
    sizes, run_batch = [], engine.run_batch

    def recording(*args, **kwargs):
        sizes.append(engine.runner.kv_caches[0][0].size(0))
        return run_batch(*args, **kwargs)

    engine.run_batch = recording
    return sizes


def _same_rollouts(a, b) -> None:
    for name in ("input_ids", "attention_mask", "labels", "old_logps", "rewards"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("environment", [None, f"{USER_CODE}:ScriptedEnv"], ids=["single_turn", "multi_turn"])
def test_a_released_pool_gives_the_kept_pools_rollouts(tok_dir, environment):
    kept, released = _runner(tok_dir, True, environment=environment), _runner(tok_dir, False, environment=environment)
    assert kept.sampler.engine.has_kv_cache and not released.sampler.engine.has_kv_cache  # freed from the start
    kept_sizes, sizes = _pool_sizes(kept), _pool_sizes(released)
    batch = prompt_batch(kept.tokenizer, ["3+4", "10+2"])
    for step in range(2):
        for runner in (kept, released):
            runner.sampler.set_policy_version(step)
        _same_rollouts(kept.rollout(batch, step=step, policy_version=step),
                       released.rollout(batch, step=step, policy_version=step))
        assert kept.sampler.engine.has_kv_cache and not released.sampler.engine.has_kv_cache
    engine = released.sampler.engine
    if environment is None:  # 4 sequences at the longest prompt + rollout_max_tokens, in whole blocks
        longest = max(len(p) for p in batch["prompt_ids"]) + 4
    else:  # a conversation can grow to the engine's max_model_len
        longest = engine.max_model_len
    assert set(sizes) == {batch_kv_tokens(4, longest, engine.config.block_size) // engine.config.block_size}
    assert max(sizes) < min(kept_sizes) == kept.sampler.engine.initial_num_blocks


def _logged(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "log" / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not any(t in k for t in TIMING)} for row in rows]


def test_online_grpo_logs_the_same_with_the_pool_kept_or_released(tmp_path, tok_dir):
    """A few steps with evaluation during training: every logged number but the timings is equal."""
    runs = {}
    for keep in (True, False):
        run_dir = tmp_path / f"keep_{keep}"
        config = with_eval(write_rl_run(run_dir, tok_dir, keep_kv_pool=keep), eval_file(tmp_path / "eval.jsonl"))
        assert main(["--config", str(config)]) == 0
        runs[keep] = _logged(run_dir)
    kept, released = runs[True], runs[False]
    assert [r.get("split") for r in kept] == [r.get("split") for r in released]
    assert sum(r.get("split") == "eval" for r in kept) >= 2 and sum("loss" in r for r in kept) == 4
    for a, b in zip(kept, released):
        assert a == b


def test_keep_kv_pool_is_a_boolean_flag():
    cfg = load_config(None, ["--train_type", "online_grpo", "--keep_kv_pool", "true"])
    assert cfg.rl.keep_kv_pool is True
    assert load_config(None, ["--train_type", "online_grpo"]).rl.keep_kv_pool is False
