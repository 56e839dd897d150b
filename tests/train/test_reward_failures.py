"""User reward functions that fail: whatever they raise (sys.exit included) is one error line naming
the function and the prompt; numpy and torch scalars are numbers; scores and weights must be finite
in float32; ``reward_timeout`` bounds a call and a stop request interrupts one. Every slow reward
here waits on an Event nobody sets: the timeout or the stop is what ends it, never a race."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from astrai.config import ConfigError, RLConfig, load_config
from astrai.train.rl.guard import UserCodeInterrupted
from astrai.train.rl.rewards import RewardSet

MOD = "tests.train.test_reward_failures:"
NEVER = threading.Event()  # never set: a reward waiting on it returns only if the test's bound fails
STARTED = threading.Event()


def score(names: list[str], n: int = 4, group_size: int = 2, weights: list[float] | None = None,
          timeout: float = 60.0, should_stop=None):
    rewards = RewardSet(RLConfig(rewards=names, reward_weights=weights, reward_timeout=timeout),
                        should_stop=should_stop)
    records = [{"i": i, "answer": "1"} for i in range(n)]
    ids = [[5, 6]] * n
    return rewards(["p"] * n, ["c"] * n, records, [[1, 5, 6]] * n, group_size, completion_ids=ids)


def raises_runtime(prompt, completion, record):
    if record["i"] == 3:
        raise RuntimeError("the judge\nis down")
    return 1.0


def raises_keyerror(prompt, completion, record):
    return float(record["no_such_column"])


def keyboard_interrupt(completions, **kwargs):  # TRL-style: one call for the rollout
    raise KeyboardInterrupt


def numpy_and_torch(prompt, completion, record):
    return [np.float32(0.5), np.bool_(True), torch.tensor(2.0), np.int64(3)][record["i"]]


def batched_array(completions, **kwargs):
    return np.arange(len(completions), dtype=np.float64)


def huge(prompt, completion, record):
    return 1e300 if record["i"] == 2 else 0.0  # finite in float64, inf in float32


def not_a_number(prompt, completion, record):
    return float("nan") if record["i"] == 1 else 0.0


def big(prompt, completion, record):
    return 3e38  # finite in float32 alone; twice it is not


def sleeps_on_prompt_1(prompt, completion, record):
    if record["i"] == 1:
        STARTED.set()
        NEVER.wait()
    return 0.0


def sleeps_on_the_first(prompt, completion, record):
    """Never returns on the first call: the timeout fires on it whatever the machine's speed (a
    quick call before it would itself have to beat the 0.2 s timeout)."""
    if record["i"] == 0:
        NEVER.wait()
    return 0.0


async def async_sleeps_on_prompt_2(prompt, completion, record):
    if record["i"] == 2:
        await asyncio.Event().wait()  # nobody sets it
    return 0.0


def test_an_exception_is_one_line_naming_the_function_and_the_prompt():
    with pytest.raises(ValueError) as e:
        score([MOD + "raises_runtime"])
    message = str(e.value)
    assert "\n" not in message
    assert f"reward '{MOD}raises_runtime' raised RuntimeError: the judge is down on completion 1 of prompt 1" in message
    assert isinstance(e.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match=r"raises_keyerror' raised KeyError: 'no_such_column' on completion 0 of "
                                         r"prompt 0"):
        score([MOD + "raises_keyerror"])


def test_sys_exit_and_keyboard_interrupt_from_a_reward_are_errors_of_that_reward():
    with pytest.raises(ValueError, match=r"exits_zero' called sys.exit\(0\) on completion 0 of prompt 0"):
        score(["tests.train.rl_user_code:exits_zero"])
    with pytest.raises(ValueError, match=r"keyboard_interrupt' raised KeyboardInterrupt on its one call for the "
                                         r"rollout's 2 prompts"):
        score([MOD + "keyboard_interrupt"])


def test_numpy_and_torch_scalars_are_numbers():
    total, terms = score([MOD + "numpy_and_torch", MOD + "batched_array"], weights=[1.0, 0.5])
    assert terms[MOD + "numpy_and_torch"].tolist() == [0.5, 1.0, 2.0, 3.0]
    assert terms[MOD + "batched_array"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert total.tolist() == [0.5, 1.5, 3.0, 4.5]


def test_scores_not_finite_in_float32_are_refused_naming_the_function_and_prompt():
    with pytest.raises(ValueError, match=r"huge' gave 1e\+300 for completion 0 of prompt 1; .*finite in float32"):
        score([MOD + "huge"])
    with pytest.raises(ValueError, match=r"not_a_number' gave nan for completion 1 of prompt 0"):
        score([MOD + "not_a_number"])
    with pytest.raises(ValueError, match=r"weighted sum of rewards .* is 6e\+38 for completion 0 of prompt 0, not "
                                         r"finite in float32"):
        score([MOD + "big"], weights=[2.0])


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), 1e300])
def test_a_weight_not_finite_in_float32_is_refused_at_the_source(weight):
    with pytest.raises(ValueError, match=r"reward_weights\[1\]=.* \(the weight of reward 'format'\) is not a number "
                                         r"finite in float32"):
        RewardSet(RLConfig(rewards=["exact_match", "format"], reward_weights=[1.0, weight]))


def test_a_nan_weight_in_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rl:\n  rewards: [exact_match]\n  reward_weights: [.nan]\n")
    with pytest.raises(ConfigError, match=r"reward_weights=\[nan\] is not a finite number"):
        load_config(path)
    with pytest.raises(ConfigError, match="reward_timeout=-1.0 must be >= 0"):
        load_config(None, ["--reward_timeout", "-1"])


def test_a_reward_past_reward_timeout_is_an_error_naming_the_function_and_prompt():
    with pytest.raises(ValueError, match=r"sleeps_on_the_first' took longer than reward_timeout=0.2s on completion 0 "
                                         r"of prompt 0; .*raise --reward_timeout"):
        score([MOD + "sleeps_on_the_first"], timeout=0.2)


def test_an_async_reward_past_reward_timeout_names_its_prompt():
    with pytest.raises(ValueError, match=r"async_sleeps_on_prompt_2' took longer than reward_timeout=0.2s on "
                                         r"completion 0 of prompt 1"):
        score([MOD + "async_sleeps_on_prompt_2"], timeout=0.2)


@pytest.mark.parametrize("timeout", [0.0, 60.0])  # 0 = no limit: only the stop request ends the wait
def test_a_stop_request_interrupts_a_slow_reward(timeout):
    STARTED.clear()
    with pytest.raises(UserCodeInterrupted, match=r"stop request interrupted reward .*sleeps_on_prompt_1' on "
                                                 r"completion 1 of prompt 0"):
        score([MOD + "sleeps_on_prompt_1"], timeout=timeout, should_stop=STARTED.is_set)  # set once it sleeps


def test_import_errors_in_the_reward_module_are_one_line_at_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_syntax_mod.py").write_text("def fn(prompt, completion, record)\n    return 1.0\n")
    (tmp_path / "raising_mod.py").write_text("import os\nSETTING = os.environ['NO_SUCH_SETTING_XYZ']\n")
    (tmp_path / "exiting_mod.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ValueError, match=r"importing module 'broken_syntax_mod' raised SyntaxError: .*line 1\)"):
        RewardSet(RLConfig(rewards=["broken_syntax_mod:fn"]))
    with pytest.raises(ValueError, match=r"importing module 'raising_mod' raised KeyError: 'NO_SUCH_SETTING_XYZ'"):
        RewardSet(RLConfig(rewards=["raising_mod:fn"]))
    with pytest.raises(ValueError, match=r"importing module 'exiting_mod' called sys.exit\(0\)"):
        RewardSet(RLConfig(rewards=["exiting_mod:fn"]))
