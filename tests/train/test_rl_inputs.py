"""Online RL inputs that would loop or overrun the model: prompts that never fit max_prompt_len (an
error at start, a bounded redraw, one warning and a total, a stop honoured while drawing), a
max_prompt_len + rollout_max_tokens beyond the model's positions (refused), settings under which
every advantage is zero (one warning), and a stop request while a reward runs. Events drive every
moment: a signal is sent from inside the run (a skipped batch, a reward call), never on a timer."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from astrai.config import load_config
from astrai.data.tasks import generate_items, prompt_record
from astrai.train.build import fit_rollouts_to_model, warn_if_no_signal
from astrai.train.cli import main
from astrai.train.publish import latest_checkpoint
from astrai.train.rl import draws as draws_module
from astrai.train.rl import loop as loop_module
from astrai.train.rl.runner import EpisodeRunner
from tests.train.resume_data import read_metrics
from tests.train.rl_runs import write_rl_run

LONG = "what is " + "1 + " * 15 + "1?"  # over max_prompt_len=48, within the model's 122 tokens of room


def records(num: int, num_short: int) -> list[dict]:
    """`num` prompt records, the first `num_short` of them short, the others over max_prompt_len=48."""
    out = [prompt_record(it) for it in generate_items(num, ["add"], digits=2, seed=1)]
    for r in out[num_short:]:
        r["messages"][-1]["content"] = LONG
    return out


def skip_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "skipped" in line and "max_prompt_len" in line]


# ------------------------------------------------------------------------- prompts that never fit


def test_a_data_set_with_no_prompt_within_max_prompt_len_is_an_error_at_start(tmp_path, tok_dir, capsys):
    config = write_rl_run(tmp_path, tok_dir, records=records(8, 0), max_prompt_len=48)
    assert main(["--config", str(config)]) == 1
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("astrai train: error:"))
    assert "every one of the 8 prompts is longer than max_prompt_len=48 tokens (the shortest has" in line
    shortest = int(line.split("the shortest has ")[1].split(")")[0])
    assert shortest > 48 and f"raise --max_prompt_len to at least {shortest}" in line
    assert not skip_lines(err)  # refused before any rollout


def test_prompts_beyond_the_models_room_name_that_fix():
    with pytest.raises(ValueError, match=r"the shortest has 819\), so no rollout could be drawn; shorten the prompts "
                                         r"or lower --rollout_max_tokens: the model's positions leave 122 tokens"):
        loop_module.check_prompts_fit([900, 819], 48, 122)
    loop_module.check_prompts_fit([900, 48], 48, 122)  # one fits: the others are skipped and counted


def test_a_batch_without_a_fitting_prompt_is_redrawn_and_warned_about_once(tmp_path, tok_dir, capsys):
    # 8 prompts, one short, 4 a batch: every epoch has a batch of long prompts only, drawn within 2 steps
    config = write_rl_run(tmp_path, tok_dir, records=records(8, 1), max_prompt_len=48)
    assert main(["--config", str(config), "--max_steps", "3"]) == 0
    lines = skip_lines(capsys.readouterr().err)
    total = sum(m.get("skipped_prompts", 0) for m in read_metrics(tmp_path))
    assert total >= 3 * 3 + 4  # the short prompt's 3 companions every step, and at least one all-long batch
    assert len(lines) == 2, lines  # the first skip, then the run's total
    assert "said once" in lines[0]
    assert lines[1] == f"skipped {int(total)} prompt(s) in all longer than max_prompt_len=48"


def test_redraws_are_bounded_and_end_in_one_error_line(tmp_path, tok_dir, capsys, monkeypatch):
    monkeypatch.setattr(draws_module, "MAX_EMPTY_DRAWS", 0)  # the first all-long batch ends the run
    config = write_rl_run(tmp_path, tok_dir, records=records(8, 1), max_prompt_len=48)
    assert main(["--config", str(config), "--max_steps", "3"]) == 1
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("astrai train: error:")]
    assert len(errors) == 1
    assert "1 prompt batches drawn in a row held no prompt within max_prompt_len=48 tokens" in errors[0]
    assert "raise --max_prompt_len to at least" in errors[0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_stop_request_ends_endless_redraws(tmp_path, tok_dir, capsys, monkeypatch, dynamic):
    """The probe's run: every prompt too long, redrawn without end, SIGTERM ignored. With the start
    check and the bound lifted, a SIGTERM sent when the first batch is skipped stops the draws."""
    monkeypatch.setattr(draws_module, "MAX_EMPTY_DRAWS", 10**9)
    monkeypatch.setattr(loop_module, "check_prompts_fit", lambda *a: None)
    count = EpisodeRunner._count_skipped

    def count_and_signal(self, step, lengths):
        count(self, step, lengths)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler asks the loop to stop

    monkeypatch.setattr(EpisodeRunner, "_count_skipped", count_and_signal)
    config = write_rl_run(tmp_path, tok_dir, records=records(8, 0), max_prompt_len=48,
                          dynamic_sampling=dynamic)
    assert main(["--config", str(config)]) == 0
    assert len(skip_lines(capsys.readouterr().err)) == 2  # the one warning and the total
    assert not read_metrics(tmp_path) or all(m.get("step", 0) == 0 for m in read_metrics(tmp_path))


# ------------------------------------------------------------------------ rows beyond the model


def test_max_prompt_len_plus_rollout_max_tokens_beyond_the_model_is_refused():
    cfg = load_config(None, ["--train_type", "online_grpo", "--max_prompt_len", "819", "--rollout_max_tokens", "8"])
    with pytest.raises(ValueError, match=r"max_prompt_len=819 \+ rollout_max_tokens=8 = 827 exceeds the model's "
                                         r"max_position_embeddings=128; set --max_prompt_len to at most 120"):
        fit_rollouts_to_model(cfg, 128)
    cfg = load_config(None, ["--train_type", "online_grpo", "--max_prompt_len", "120", "--rollout_max_tokens", "8"])
    fit_rollouts_to_model(cfg, 128)
    assert cfg.rl.max_prompt_len == 120  # exactly fits: kept


def test_an_unset_max_prompt_len_is_256_or_what_fits(capsys):
    cfg = load_config(None, ["--train_type", "online_grpo", "--rollout_max_tokens", "8"])
    assert cfg.rl.max_prompt_len is None
    fit_rollouts_to_model(cfg, 128)
    assert cfg.rl.max_prompt_len == 120
    assert "note: max_prompt_len is 120 (the model's max_position_embeddings=128" in capsys.readouterr().err
    cfg = load_config(None, ["--train_type", "online_grpo", "--rollout_max_tokens", "8"])
    fit_rollouts_to_model(cfg, 4096)
    assert cfg.rl.max_prompt_len == 256 and not capsys.readouterr().err


def test_the_cli_refuses_an_overrunning_run_at_start(tmp_path, tok_dir, capsys):
    config = write_rl_run(tmp_path, tok_dir, max_prompt_len=1000)  # the test model has 128 positions
    assert main(["--config", str(config)]) == 1
    assert ("max_prompt_len=1000 + rollout_max_tokens=6 = 1006 exceeds the model's max_position_embeddings=128"
            in capsys.readouterr().err)
    assert not (tmp_path / "log" / "metrics.jsonl").exists() or not read_metrics(tmp_path)


# ------------------------------------------------------------------ settings that train nothing


@pytest.mark.parametrize(("flags", "expected"), [
    (["--train_type", "online_grpo", "--group_size", "1"], "group_size=1: advantage_estimator grpo"),
    (["--train_type", "online_grpo", "--rollout_temperature", "0"], "rollout_temperature=0"),
    (["--train_type", "online_grpo", "--advantage_estimator", "rloo", "--rollout_temperature", "0"],
     "advantage_estimator rloo see no difference"),
    (["--train_type", "online_dpo", "--rollout_temperature", "0"], "online_dpo's pairs see no difference"),
    (["--train_type", "online_grpo", "--advantage_estimator", "reinforce_pp", "--group_size", "1"], None),
    (["--train_type", "online_ppo", "--group_size", "1", "--rollout_temperature", "0"], None),
    (["--train_type", "online_grpo"], None),
])
def test_settings_whose_advantages_are_all_zero_warn_once_at_start(flags, expected, capsys):
    line = warn_if_no_signal(load_config(None, flags))
    err = capsys.readouterr().err
    if expected is None:
        assert line is None and not err
    else:
        assert expected in line and "the run trains nothing" in line
        assert err == line + "\n"


def test_the_no_signal_warning_is_in_the_runs_log(tmp_path, tok_dir, capsys):
    config = write_rl_run(tmp_path, tok_dir, group_size=1)
    assert main(["--config", str(config), "--max_steps", "1"]) == 0
    err = capsys.readouterr().err
    assert sum("the run trains nothing" in x for x in err.splitlines()) == 1


# ------------------------------------------------------------------ a stop while a reward runs

NEVER = threading.Event()  # never set
CALLS = [0]


def stops_then_hangs(prompt, completion, record):
    """Scores the first rollout (4 prompts x 4 samples); in the second, asks the run to stop
    (as a SIGTERM from outside would) and never returns."""
    CALLS[0] += 1
    if CALLS[0] > 16:
        os.kill(os.getpid(), signal.SIGTERM)
        NEVER.wait()
    return 1.0


@pytest.mark.parametrize("timeout", [0, 60])
def test_a_stop_during_a_hanging_reward_stops_the_run_with_a_checkpoint(tmp_path, tok_dir, capsys, timeout):
    CALLS[0] = 0
    config = write_rl_run(tmp_path, tok_dir, rewards=["tests.train.test_rl_inputs:stops_then_hangs"],
                          reward_timeout=timeout)
    assert main(["--config", str(config)]) == 0
    assert "a stop request interrupted reward 'tests.train.test_rl_inputs:stops_then_hangs' on completion 0 of " \
           "prompt 0" in capsys.readouterr().err
    ckpt = latest_checkpoint(tmp_path / "ckpt")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert ckpt.name == "step_00000001" and state["step"] == 1
    assert state["consumed_samples"] == 4 * 1  # the dropped rollout's draw is undone: a resume draws it again


def test_a_reward_that_exits_ends_the_run_with_an_error_not_exit_0(tmp_path, tok_dir, capsys):
    config = write_rl_run(tmp_path, tok_dir, rewards=["tests.train.rl_user_code:exits_zero"])
    assert main(["--config", str(config)]) == 1
    assert "reward 'tests.train.rl_user_code:exits_zero' called sys.exit(0) on completion 0 of prompt 0" \
        in capsys.readouterr().err
