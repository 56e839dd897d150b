"""The environment and tool hooks a config names are checked before anything else of a run, and
each mistake is one line naming the entry and the fix: a class given as a tool, a tool whose
parameters have no type hints (``rl/environments.py``, ``rl/tools.py``); an opening prompt that
leaves no room for a turn names what bounds the episode (``rl/runner.py``)."""

from __future__ import annotations

import pytest

from astrai.config import RLConfig
from astrai.data.tokenizer import load_tokenizer
from astrai.train.cli import main
from astrai.train.rl.environments import check_hooks
from astrai.train.rl.rewards import RewardSet
from astrai.train.rl.runner import Draw, EpisodeRunner
from astrai.train.rl.tools import ToolBox
from tests.train.resume_data import write_tokenizer
from tests.train.rl_runs import write_rl_run
from tests.train.samplers import ScriptedSampler, fake_turn

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
