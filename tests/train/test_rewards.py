"""Rewards: reward models with their own tokenizer, and `module:function` resolved from the working directory.

A reward model whose directory holds a tokenizer other than the policy's must read ids of its own
tokenizer (the decoded texts re-encoded, through its chat template when it has one); with the
policy's tokenizer it reads the policy's ids untouched. User reward functions resolve against the
working directory however astrai is started: the console script, `python -m astrai`, the launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from astrai.config import RLConfig
from astrai.data.tasks import generate_items, prompt_record
from astrai.data.tokenizer import load_tokenizer, same_tokenizer
from astrai.data.tokenizer_training import train_tokenizer
from astrai.model.config import ModelConfig
from astrai.model.hf import save_model
from astrai.model.transformer import CausalLM
from astrai.train.launch import launch
from astrai.train.rl.reward_model import RewardModel
from astrai.train.rl.rewards import RewardSet
from tests.train.resume_data import MODEL, read_metrics, write_tokenizer
from tests.train.rl_runs import write_rl_run

MYMOD = "def fn(prompt, completion, record):\n    return 0.25\n"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("policy_tok"))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A tokenizer trained on other text with another vocabulary size: other ids for the same text."""
    out = tmp_path_factory.mktemp("other_tok")
    words = ["the quick brown fox jumps over the lazy dog", "what is", "user assistant system"]
    train_tokenizer(words * 20, 280, out, min_frequency=1)
    return out


def reward_model_dir(out: Path, tokenizer=None, chat_template: bool = True) -> Path:
    """A tiny reward model directory: a random trunk, a scalar `score` head, maybe a tokenizer."""
    save_model(CausalLM(ModelConfig(**MODEL), seed=0), out, tokenizer)
    tensors = load_file(out / "model.safetensors")
    tensors["score.weight"] = torch.randn(1, MODEL["hidden_size"], generator=torch.Generator().manual_seed(0))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None and not chat_template:
        config = json.loads((out / "tokenizer_config.json").read_text())
        config.pop("chat_template")
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def policy_rollout(tok, num: int = 3):
    """(prompt texts, completions, records, policy ids) as the rollout runner hands them over."""
    records = [{**prompt_record(it), "answer": "7"} for it in generate_items(num, ["add"], digits=2, seed=3)]
    completions = [f" {i + 11}" for i in range(num)]
    prompt_ids = [tok.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records]
    sequences = [p + tok.encode(c) for p, c in zip(prompt_ids, completions)]
    return [tok.decode(p) for p in prompt_ids], completions, records, sequences


def spy(rewards: RewardSet) -> list[list[int]]:
    """The ids every reward model of `rewards` is run on (one list per sequence, without padding)."""
    seen: list[list[int]] = []
    for fn in rewards.functions:
        if isinstance(fn, RewardModel):
            forward = fn.model.forward

            def recording(input_ids, attention_mask=None, forward=forward, **kw):
                seen.extend(row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask))
                return forward(input_ids, attention_mask=attention_mask, **kw)

            fn.model.forward = recording
    return seen


def test_a_reward_model_with_its_own_tokenizer_reads_its_own_ids_through_its_chat_template(
        tmp_path, policy_dir, other_dir):
    policy, other = load_tokenizer(policy_dir), load_tokenizer(other_dir)
    assert not same_tokenizer(policy, other)
    rm = reward_model_dir(tmp_path / "rm", other)
    rewards = RewardSet(RLConfig(rewards=[str(rm)]), tokenizer=policy)
    seen = spy(rewards)
    prompts, completions, records, sequences = policy_rollout(policy)
    total, terms = rewards(prompts, completions, records, sequences, 1)
    assert len(seen) == 3 and total.shape == (3,)
    for ids, completion, record, policy_ids in zip(seen, completions, records, sequences):
        chat = [*record["messages"], {"role": "assistant", "content": completion}]
        assert ids == other.apply_chat_template(chat)
        assert other.decode(ids, skip_special_tokens=False) == other.render_chat(chat)
        assert completion in other.decode(ids) and record["messages"][-1]["content"] in other.decode(ids)
        assert ids != policy_ids


def test_a_reward_model_tokenizer_without_a_chat_template_reads_prompt_text_plus_completion(
        tmp_path, policy_dir, other_dir):
    policy = load_tokenizer(policy_dir)
    rm = reward_model_dir(tmp_path / "rm", load_tokenizer(other_dir), chat_template=False)
    own = load_tokenizer(rm)
    assert not own.chat_template
    rewards = RewardSet(RLConfig(rewards=[str(rm)]), tokenizer=policy)
    seen = spy(rewards)
    prompts, completions, records, sequences = policy_rollout(policy)
    rewards(prompts, completions, records, sequences, 1)
    assert seen == [own.encode(p + c) for p, c in zip(prompts, completions)]
    assert [own.decode(ids) for ids in seen] == [p + c for p, c in zip(prompts, completions)]


def test_a_reward_model_with_the_policys_tokenizer_reads_the_policys_ids(tmp_path, policy_dir):
    policy = load_tokenizer(policy_dir)
    resaved = tmp_path / "resaved"  # the same tokenizer written again (other formatting): still the same
    load_tokenizer(policy_dir).save(resaved)
    (resaved / "tokenizer.json").write_text(json.dumps(json.loads((resaved / "tokenizer.json").read_text())))
    assert same_tokenizer(load_tokenizer(resaved), policy)
    rm = reward_model_dir(tmp_path / "rm", load_tokenizer(resaved))
    bare = reward_model_dir(tmp_path / "bare")  # no tokenizer in the directory
    prompts, completions, records, sequences = policy_rollout(policy)
    for rewards in (RewardSet(RLConfig(rewards=[str(rm)]), tokenizer=policy),
                    RewardSet(RLConfig(rewards=[str(bare)]), tokenizer=policy),
                    RewardSet(RLConfig(rewards=[str(rm)]))):  # no policy tokenizer given: the policy's ids
        seen = spy(rewards)
        rewards(prompts, completions, records, sequences, 1)
        assert seen == sequences


def test_policy_ids_outside_the_reward_models_vocabulary_name_the_fix(tmp_path):
    rewards = RewardSet(RLConfig(rewards=[str(reward_model_dir(tmp_path / "rm"))]))
    with pytest.raises(ValueError, match=r"vocab_size 320 but was given token id 999; put the tokenizer"):
        rewards(["p"], ["c"], [{}], [[1, 999]], 1)


# ------------------------------------------------------------------------------ module:function


def test_module_function_resolves_against_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_reward_mod.py").write_text(MYMOD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_reward_mod", raising=False)
    total, _ = RewardSet(RLConfig(rewards=["cwd_reward_mod:fn"]))(["p"], ["c"], [{}], [[1]], 1)
    assert total.tolist() == [0.25]


def test_module_function_errors_name_the_module_the_working_directory_and_the_fix(tmp_path, monkeypatch):
    (tmp_path / "two_args_mod.py").write_text("import math\ndef fn(prompt, completion):\n    return 1.0\nx = 3\n")
    (tmp_path / "broken_import_mod.py").write_text("import no_such_package_xyz\n")
    monkeypatch.chdir(tmp_path)
    for mod in ("two_args_mod", "broken_import_mod"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    cases = {
        "no_such_mod_xyz:fn": rf"no module 'no_such_mod_xyz' in the working directory {tmp_path} or on PYTHONPATH; "
                              r"run astrai from the directory that holds no_such_mod_xyz.py",
        "broken_import_mod:fn": r"importing module 'broken_import_mod' failed .*no_such_package_xyz.*install what",
        "two_args_mod:missing": r"has no attribute 'missing'; define f\(prompt: str, completion: str, record: dict\)",
        "two_args_mod:x": r"is not a function \(found int\); define f\(prompt",
        "two_args_mod:fn": r"has the signature fn\(prompt, completion\); a reward function is called as "
                           r"f\(prompt: str, completion: str, record: dict\) -> float",
        "two_args_mod": r"unknown reward",
        "two_args_mod:": r"is not module:function; write it as mymod:fn",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message) as err:
            RewardSet(RLConfig(rewards=[spec]))
        assert "\n" not in str(err.value)


def test_the_console_script_resolves_module_function_from_the_working_directory(tmp_path, policy_dir):
    """`astrai train` (the console script, whose sys.path[0] is its bin directory) in a directory
    holding mymod.py trains with `--rewards mymod:fn`."""
    (tmp_path / "mymod.py").write_text(MYMOD)
    config = write_rl_run(tmp_path, policy_dir, num_prompts=4)
    script = Path(sys.executable).parent / "astrai"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(script), "train", "--config", str(config), "--max_steps", "1",
                           "--rewards", "mymod:fn"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["rewards/mymod:fn"] for m in read_metrics(tmp_path)] == [0.25]


def test_launcher_ranks_resolve_module_function_from_the_launchers_working_directory(tmp_path, monkeypatch):
    """A stand-in rank under `python -P` (no working directory on sys.path) still finds mymod."""
    (tmp_path / "mymod.py").write_text(MYMOD)
    monkeypatch.chdir(tmp_path)
    rank = ("from astrai.config import RLConfig; from astrai.train.rl.rewards import RewardSet; "
            "total, _ = RewardSet(RLConfig(rewards=['mymod:fn']))(['p'], ['c'], [{}], [[1]], 1); "
            "assert total.tolist() == [0.25], total")
    assert launch([], nprocs=1, program=[sys.executable, "-P", "-c", rank]) == 0


def test_overlong_is_dapos_soft_punishment_by_hand_and_as_trl_computes_it():
    """L_max = rollout_max_tokens = 10, L_cache = overlong_buffer = 4: 0 up to 6 tokens, then
    (6 - |y|) / 4 down to -1 at 10, -1 beyond."""
    from trl.rewards import get_soft_overlong_punishment

    cfg = RLConfig(rewards=["overlong"], rollout_max_tokens=10, overlong_buffer=4)
    ids = [[5] * n for n in (0, 6, 7, 9, 10, 11)]
    total, terms = RewardSet(cfg)(["p"] * 6, ["c"] * 6, [{}] * 6, [[1, *c] for c in ids], 1, completion_ids=ids)
    assert terms["overlong"].tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert total.tolist() == terms["overlong"].tolist() and list(terms) == ["overlong"]
    assert terms["overlong"].tolist() == get_soft_overlong_punishment(10, 4)(completion_ids=ids)


def test_overlong_buffer_must_fit_in_rollout_max_tokens():
    from astrai.config import ConfigError, load_config

    for buffer in ("0", "9"):
        with pytest.raises(ConfigError, match=rf"overlong_buffer={buffer} must be within \[1, rollout_max_tokens=8\]"):
            load_config(None, ["--rewards", "overlong", "--rollout_max_tokens", "8", "--overlong_buffer", buffer])
    assert load_config(None, ["--rollout_max_tokens", "8", "--overlong_buffer", "9"]).rl.overlong_buffer == 9  # unused
    assert load_config(None, ["--rewards", "overlong", "--rollout_max_tokens", "8",
                              "--overlong_buffer", "8"]).rl.overlong_buffer == 8
