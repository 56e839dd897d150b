"""Evaluation during training (`eval_interval`, `eval_data_path`): `eval/` rows at step 0, every
interval and the last step, from an engine over the live weights, in every loop; the same rows
after an exact resume; the greedy accuracy equal to an independent generation from the final
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astrai.config import ConfigError, load_config
from astrai.data.tasks import SCORERS, generate_items, sft_record
from astrai.train.cli import main
from astrai.train.publish import latest_checkpoint
from tests.train.resume_data import MODEL
from tests.train.rl_runs import eval_file, eval_rows, sigterm_after_step, with_eval, write_rl_run

EVAL_KEYS = {"eval/accuracy", "eval/greedy_reward_mean", "eval/reward_mean", "eval/sampled_accuracy",
             "eval/response_length", "eval/truncated_fraction", "eval/num_prompts", "eval/skipped_prompts",
             "eval/seconds"}


def greedy_accuracy(model_dir: Path, eval_path: Path, max_tokens: int) -> float:
    """What eval/accuracy must be for the weights in `model_dir`: a separate engine, greedy."""
    from astrai.infer.llm import LLM
    from astrai.infer.sampling import SamplingParams

    records = [json.loads(line) for line in eval_path.read_text().splitlines()]
    outs = LLM(str(model_dir)).chat([r["messages"] for r in records], SamplingParams(temperature=0, max_tokens=max_tokens))
    return sum(SCORERS["exact"](o.outputs[0].text, r["answer"]) for o, r in zip(outs, records)) / len(records)


def test_online_grpo_logs_eval_rows_at_step_zero_every_interval_and_the_end(tmp_path, tok_dir):
    run = tmp_path / "grpo"
    config = with_eval(write_rl_run(run, tok_dir), eval_file(tmp_path / "eval.jsonl"))
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["max_steps"] = 5
    cfg["train"]["eval_pass_k"] = [1, 2]
    cfg["ckpt"]["keep_last"] = 1
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["--config", str(config)]) == 0
    rows = eval_rows(run)
    assert [r["step"] for r in rows] == [0, 2, 4, 5]
    for row in rows:
        assert EVAL_KEYS <= set(row)
        assert row["eval/num_prompts"] == 6 and row["eval/skipped_prompts"] == 0
        for key in ("eval/accuracy", "eval/sampled_accuracy", "eval/truncated_fraction"):
            assert 0.0 <= row[key] <= 1.0
        assert 0 < row["eval/response_length"] <= 6  # rollout_max_tokens
        # pass@1 is the sampled accuracy (every prompt has its 2 samples); pass@2 at least that
        assert row["eval/pass@1"] == pytest.approx(row["eval/sampled_accuracy"])
        assert row["eval/pass@1"] <= row["eval/pass@2"] <= 1.0
    # the live weights at the last step are the final checkpoint's: an independent engine agrees
    final = latest_checkpoint(run / "ckpt")
    assert rows[-1]["eval/accuracy"] == greedy_accuracy(final, tmp_path / "eval.jsonl", max_tokens=6)
    # exact_match + format rewards on greedy answers: at least the accuracy (format adds, never subtracts)
    assert rows[-1]["eval/greedy_reward_mean"] >= rows[-1]["eval/accuracy"]


def test_sft_logs_eval_rows_from_an_engine_of_its_own(tmp_path, tok_dir, capsys):
    items = generate_items(32, ["add"], digits=2, seed=1)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(sft_record(it)) + "\n" for it in items))
    cfg = {"model": MODEL,
           "data": {"train_type": "sft", "data_path": str(tmp_path / "sft.jsonl"), "tokenizer_path": str(tok_dir),
                    "max_seq_len": 48, "eval_data_path": str(eval_file(tmp_path / "eval.jsonl"))},
           "train": {"max_steps": 5, "batch_per_device": 4, "device": "cpu", "eval_interval": 3, "eval_num_samples": 0},
           "optim": {"max_lr": 1e-2, "warmup_steps": 0},
           "rl": {"rollout_max_tokens": 6, "rewards": ["exact_match"]},
           "ckpt": {"ckpt_dir": str(tmp_path / "ckpt"), "ckpt_interval": 0},
           "log": {"log_dir": str(tmp_path / "log"), "progress": False}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "run.yaml")]) == 0
    rows = eval_rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 3, 5]
    summary = capsys.readouterr().err
    assert (f"eval accuracy {rows[0]['eval/accuracy']:.1%} -> {rows[-1]['eval/accuracy']:.1%} (step 5; 3 evaluations"
            in summary), summary[-800:]
    assert all("eval/reward_mean" not in r for r in rows)  # eval_num_samples 0: greedy only
    assert rows[-1]["eval/greedy_reward_mean"] == rows[-1]["eval/accuracy"]  # exact_match is the accuracy
    final = latest_checkpoint(tmp_path / "ckpt")
    assert rows[-1]["eval/accuracy"] == greedy_accuracy(final, tmp_path / "eval.jsonl", max_tokens=6)
    train_rows = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("eval/") for r in train_rows if r.get("split") == "train" for k in r)


@pytest.mark.slow
def test_a_resumed_run_logs_the_same_eval_rows(tmp_path, tok_dir):
    evals = eval_file(tmp_path / "eval.jsonl")
    straight = with_eval(write_rl_run(tmp_path / "straight", tok_dir, rollout_interval=2), evals, max_steps=6)
    stopped = with_eval(write_rl_run(tmp_path / "stopped", tok_dir, rollout_interval=2), evals, max_steps=6)
    assert main(["--config", str(straight)]) == 0
    sigterm_after_step(stopped, 3, tmp_path)
    assert main(["--config", str(stopped), "--resume"]) == 0

    def numbers(run: Path) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "eval/seconds"} for r in eval_rows(run)]

    assert [r["step"] for r in eval_rows(tmp_path / "stopped")] == [0, 2, 4, 6]
    assert numbers(tmp_path / "stopped") == numbers(tmp_path / "straight")


def test_pass_at_k_by_hand():
    """n = 4 samples, c right: pass@1 = c / 4; pass@2 = 1 - C(4 - c, 2) / C(4, 2), so 1 right gives
    1 - 3/6 = 0.5 and 3 right give 1 (no two samples both wrong); summarise averages over prompts."""
    from astrai.train.evaluation import pass_at_k, summarise

    assert [pass_at_k(4, c, 1) for c in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [pass_at_k(4, c, 2) for c in range(5)] == pytest.approx([0.0, 0.5, 1 - 1 / 6, 1.0, 1.0])
    totals = {"prompts": 2.0, "correct": 0.0, "greedy_reward": 0.0, "samples": 8.0, "sample_reward": 0.0,
              "sample_correct": 4.0, "tokens": 8.0, "truncated": 0.0, "skipped": 0.0, "tool_episodes": 0.0,
              "pass@2": 0.5 + 1.0}
    assert summarise(totals, 0.0)["eval/pass@2"] == 0.75
    with pytest.raises(ConfigError, match=r"eval_pass_k has \[8\], but pass@k needs 1 <= k <= eval_num_samples=4"):
        load_config(None, ["--eval_pass_k", "1,8"])


def test_eval_fields_are_checked():
    with pytest.raises(ConfigError, match="eval_interval=5 needs eval_data_path"):
        load_config(None, ["--eval_interval", "5"])
    with pytest.raises(ConfigError, match="eval_num_samples=-1 must be >= 0"):
        load_config(None, ["--eval_num_samples", "-1"])
    with pytest.raises(ConfigError, match="eval_match"):
        load_config(None, ["--eval_match", "fuzzy"])


def test_eval_records_whose_answers_are_all_empty_warn_that_nothing_can_be_scored(tmp_path, tok_dir, capsys):
    items = generate_items(4, ["add"], digits=2, seed=1)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(sft_record(it)) + "\n" for it in items))
    records = [json.loads(line) for line in eval_file(tmp_path / "eval.jsonl", num=2).read_text().splitlines()]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({**r, "answer": a}) + "\n" for r, a in zip(records, ["", " "])))
    cfg = {"model": MODEL,
           "data": {"train_type": "sft", "data_path": str(tmp_path / "sft.jsonl"), "tokenizer_path": str(tok_dir),
                    "max_seq_len": 48, "eval_data_path": str(tmp_path / "eval.jsonl")},
           "train": {"max_steps": 1, "batch_per_device": 4, "device": "cpu", "eval_interval": 1, "eval_num_samples": 0},
           "rl": {"rollout_max_tokens": 2},
           "ckpt": {"ckpt_dir": str(tmp_path / "ckpt"), "ckpt_interval": 0},
           "log": {"log_dir": str(tmp_path / "log"), "progress": False}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(tmp_path / "run.yaml")]) == 0
    err = capsys.readouterr().err
    assert "every 'answer' of the 2 records of eval_data_path" in err and "no reply can be scored" in err, err[-2000:]
