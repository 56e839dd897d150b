"""The environment and tool hooks a config names are checked before anything else of a run, and
each mistake is one line naming the entry and the fix: a class given as a tool, a tool whose
parameters have no type hints (``rl/environments.py``, ``rl/tools.py``); an opening prompt that
leaves no room for a turn names what bounds the episode (``rl/runner.py``). While the episodes run,
whatever an environment gets wrong (what it returns, raises, or a reward that is not a finite
number) is one line naming it and the episode; a call past ``env_timeout`` stops the run, and a stop
request ends a run whose environment hangs, with a checkpoint (the hanging steps wait on an event)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from astrai.config import RLConfig
from astrai.data.tokenizer import load_tokenizer
from astrai.train.cli import main
from astrai.train.publish import latest_checkpoint
from astrai.train.rl.environments import EnvStep, check_hooks
from astrai.train.rl.guard import UserCodeInterrupted
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import Draw, EpisodeRunner
from astrai.train.rl.tools import ToolBox
from tests.train.resume_data import write_tokenizer
from tests.train.rl_runs import REPO, write_rl_run
from tests.train.rl_user_code import HANGING, RELEASE, USER_CODE, HangingEnv
from tests.train.samplers import ScriptedSampler, fake_turn, scripted_episodes

HERE = "tests.train.test_environments"


def untyped(a, b):
    """Multiply without type hints."""
    return a * b


def typed(a: int) -> int:
    """A tool with a schema."""
    return a


class Calculator:
    def step(self, messages):
        return None


class EnvWithUntypedTool:
    tools = [untyped]

    def step(self, messages):
        return None


def test_a_class_given_as_a_tool_is_refused():
    with pytest.raises(ValueError, match=rf"tool '{HERE}:Calculator' is the class Calculator, not a function; name a "
                                         "function"):
        check_hooks(None, [f"{HERE}:Calculator"])


def test_a_tool_without_type_hints_is_one_line_naming_it():
    with pytest.raises(ValueError, match=rf"tool '{HERE}:untyped': tool 'untyped': parameter 'a' has no type hint; "
                                         r"annotate it \(e.g. a: int\)"):
        check_hooks(None, [f"{HERE}:untyped"])
    with pytest.raises(ValueError, match=r"tool 'untyped': tool 'untyped': parameter 'a' has no type hint"):
        ToolBox([untyped])  # an environment's own tools meet the same check
    check_hooks(f"{HERE}:EnvWithUntypedTool", [f"{HERE}:typed"])  # a loadable environment and a good tool pass


def test_a_mistyped_tool_is_the_first_error_of_a_run(tmp_path, capsys):
    """The config also asks for more prompt tokens than the model's positions hold (an error of the
    run builder); the tool's name is reported first, so one fix is not followed by another."""
    tok_dir = write_tokenizer(tmp_path / "tok")
    config = write_rl_run(tmp_path, tok_dir, tools=[f"{HERE}:typo"], max_prompt_len=100_000)
    assert main(["--config", str(config), "--max_steps", "1"]) != 0
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"tool '{HERE}:typo'" in errors[0] and "no attribute 'typo'" in errors[0], errors


@pytest.mark.parametrize("max_prompt_len, max_model_len, fix", [
    # 200 + 2 * (4 + 200) tokens allowed, but the model holds 40: raising max_prompt_len cannot help
    (200, 40, r"the model's max_position_embeddings \(40\) bound an episode; shorten the prompts or the tools' "
              r"docstrings, or lower --rollout_max_tokens \(now 4\)"),
    # 8 + 2 * (4 + 8) = 32 tokens allowed, all of them held: max_prompt_len is the bound
    (8, 32, r"raise --max_prompt_len to at least \d+, or shorten the prompts or the tools' docstrings"),
])
def test_an_opening_prompt_without_room_names_what_bounds_the_episode(tmp_path, max_prompt_len, max_model_len, fix):
    tok = load_tokenizer(write_tokenizer(tmp_path / "tok"))
    cfg = RLConfig(group_size=1, rollout_max_tokens=4, max_turns=2, tools=[f"{HERE}:typed"], rewards=["exact_match"])
    sampler = ScriptedSampler(lambda turn, ids: fake_turn(tok, "1"), max_model_len=max_model_len)
    runner = EpisodeRunner(sampler, tok, cfg, RewardSet(cfg, tokenizer=tok), max_prompt_len=max_prompt_len)
    records = [{"messages": [{"role": "user", "content": "1*1"}], "answer": "1"}]
    with pytest.raises(ValueError, match=r"an episode's opening prompt has \d+ tokens \(tool schemas and environment "
                                         rf"included\), more than the {max_model_len - 4} an episode of {max_model_len} "
                                         rf"tokens leaves beside rollout_max_tokens=4; {fix}"):
        runner.run(records, [], [Draw(runner.sampling, 1, lambda *a: 0)], policy_version=0)


# ------------------------------------------------------------------------------ environment mistakes


class Opens:
    """A base whose step ends the episode: each mistake below overrides one method."""

    def step(self, messages):
        return EnvStep(done=True)


class StepReturnsDict(Opens):
    def step(self, messages):
        return {"done": True}


class StepReturnsNone(Opens):
    def step(self, messages):
        return None


class InitRaises(Opens):
    def __init__(self):
        raise RuntimeError("no sandbox")


class ResetReturnsNone(Opens):
    def reset(self, record):
        return None


class ResetReturnsStrings(Opens):
    def reset(self, record):
        return ["hello", "world"]


class ResetReturnsNothing(Opens):
    def reset(self, record):
        return []


class UnknownRole(Opens):
    def reset(self, record):
        return [{"role": "wizard", "content": "hi"}]


class UnknownRoleInStep(Opens):
    def step(self, messages):
        return EnvStep(messages=[{"role": "wizard", "content": "again"}])


class RewardText(Opens):
    def step(self, messages):
        return EnvStep(reward="abc", done=True)


class ExitsThree(Opens):
    def step(self, messages):
        sys.exit(3)


class NanReward(Opens):
    def step(self, messages):
        return EnvStep(reward=float("nan"), done=True)


class InfReward(Opens):
    def step(self, messages):
        return EnvStep(reward=float("inf"), done=True)


OPENING, STEP = r"\(prompt 0, sample 0, after 0 turn\(s\)\)", r"\(prompt 0, sample 0, after 1 turn\(s\)\)"


@pytest.mark.parametrize("env, message", [
    ("StepReturnsDict", rf"environment StepReturnsDict.step returned dict {{'done': True}} {STEP}, not an EnvStep; "
                        r"return EnvStep\(messages=..., reward=..., done=...\)"),
    ("StepReturnsNone", rf"environment StepReturnsNone.step returned NoneType None {STEP}, not an EnvStep"),
    ("InitRaises", rf"environment InitRaises.__init__ raised RuntimeError: no sandbox {OPENING}; fix the environment"),
    ("ResetReturnsNone", rf"environment ResetReturnsNone.reset returned NoneType None {OPENING}, not a list of "
                         "messages"),
    ("ResetReturnsStrings", rf"environment ResetReturnsStrings.reset returned str 'hello' as message 0 {OPENING}; a "
                            "message is a dict with a str 'role' and a str 'content'"),
    ("ResetReturnsNothing", rf"environment ResetReturnsNothing.reset returned no messages {OPENING}; return the "
                            "opening conversation"),
    ("UnknownRole", rf"the chat template cannot render the messages of environment UnknownRole.reset {OPENING}: "
                    "unknown role wizard; expected system, user, assistant or tool; return messages the template "
                    "accepts"),
    ("UnknownRoleInStep", rf"the chat template cannot render the messages of environment UnknownRoleInStep.step {STEP}: "
                          "unknown role wizard"),
    ("RewardText", rf"environment RewardText.step returned reward='abc' {STEP}; a reward is None or a number finite "
                   r"in float32 \(\|r\| <= 3.4e\+38\)"),
    ("ExitsThree", rf"environment ExitsThree.step called sys.exit\(3\) {STEP}; fix the environment"),
    ("NanReward", rf"environment NanReward.step returned reward=nan {STEP}; a reward is None or a number finite"),
    ("InfReward", rf"environment InfReward.step returned reward=inf {STEP}; a reward is None or a number finite"),
])
def test_an_environment_mistake_is_one_line_naming_it(tok_dir, env, message):
    with pytest.raises(ValueError, match=f"^{message}") as e:
        scripted_env_episodes(tok_dir, f"{HERE}:{env}")
    assert "\n" not in str(e.value)


class LongFollowUp(Opens):
    def step(self, messages):
        return EnvStep(messages=[{"role": "user", "content": "xy " * 1_400_000}])  # about 4 MB


def test_a_huge_environment_message_is_cut_to_what_the_row_can_hold(tok_dir):
    [e] = scripted_env_episodes(tok_dir, f"{HERE}:LongFollowUp")
    assert e.truncated and e.num_turns == 1 and len(e.ids) <= 4096
    assert len(e.messages[-1]["content"]) < 4096 * 16  # (tokens left) x (longest token) + 1 characters


# ------------------------------------------------------------------------------ hanging environments


@pytest.fixture
def hangs(monkeypatch):
    """HangingEnv's steps hang (from its first call) until the test ends."""
    monkeypatch.delenv("ASTRAI_TEST_HANG_AT_CALL", raising=False)
    HangingEnv.num_calls = 0
    RELEASE.clear()
    HANGING.clear()
    yield
    RELEASE.set()


def scripted_env_episodes(tok_dir, environment: str, **kwargs):
    tok = load_tokenizer(tok_dir)
    return scripted_episodes(tok, lambda turn: fake_turn(tok, "1"), [{"messages": [{"role": "user", "content": "1+0"}],
                                                                       "answer": "1"}], 4096, 8,
                             environment=environment, **kwargs)[0]


def test_an_environment_past_env_timeout_is_one_line_naming_it(tok_dir, hangs):
    with pytest.raises(ValueError, match=r"^environment HangingEnv.step took longer than env_timeout=0.2s \(prompt 0, "
                                         r"sample 0, after 1 turn\(s\)\); make it faster or raise --env_timeout "
                                         r"\(0 = no limit\)$"):
        scripted_env_episodes(tok_dir, f"{USER_CODE}:HangingEnv", env_timeout=0.2)


def test_a_stop_request_abandons_a_turn_whose_environment_hangs(tok_dir, hangs):
    with pytest.raises(UserCodeInterrupted, match=r"a stop request interrupted environment HangingEnv.step \(prompt 0, "
                                                  r"sample 0, after 1 turn\(s\)\)"):
        scripted_env_episodes(tok_dir, f"{USER_CODE}:HangingEnv", env_timeout=0.0, should_stop=HANGING.is_set)


def test_a_run_whose_environment_hangs_ends_at_env_timeout_naming_it(tmp_path, tok_dir, hangs, capsys):
    config = write_rl_run(tmp_path, tok_dir, environment=f"{USER_CODE}:HangingEnv", max_turns=2)
    assert main(["--config", str(config), "--max_steps", "1", "--env_timeout", "0.5"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "environment HangingEnv.step took longer than env_timeout=0.5s" in errors[0], errors


@pytest.mark.slow
def test_sigterm_while_an_environment_hangs_stops_the_run_with_a_checkpoint(tmp_path, tok_dir):
    """The default env_timeout (600 s) never fires here: the environment hangs from the first step
    call of the second rollout (16 episodes of up to 2 turns, so past call 32) and the test sends
    SIGTERM once it hangs. The run drops that rollout, saves step 1 and exits 0."""
    config = write_rl_run(tmp_path, tok_dir, environment=f"{USER_CODE}:HangingEnv", max_turns=2)
    marker = tmp_path / "hanging"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "ASTRAI_TEST_HANG_AT_CALL": "33", "ASTRAI_TEST_HANG_FILE": str(marker)}
    proc = subprocess.Popen([sys.executable, "-m", "astrai", "train", "--config", str(config)], env=env,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.monotonic() + 300  # a guard against a hung test, not the property under test
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)  # guard: the stop itself takes a slice of 0.05 s and a save
    assert proc.returncode == 0, err[-2000:]
    assert "a stop request interrupted environment HangingEnv.step" in err and "stopped at step 1" in err, err[-2000:]
    assert latest_checkpoint(tmp_path / "ckpt").name == "step_00000001"
