"""The end-of-run summary (issue 21 item 5): finished and stopped runs, offline and online loops,
with the progress bar off, printed once and only by rank 0, naming the checkpoint and the commands."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from astrai.train import signals
from astrai.train.cli import main
from astrai.train.context import TrainContext
from astrai.train.summary import RunReport, RunSummary, format_duration, format_summary, resume_command
from tests.train.resume_data import MODEL


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    signals.uninstall_signal_handlers()


def write_run(run_dir: Path, tok_dir: Path, train_type: str = "sft", **train) -> Path:
    from astrai.data.tasks import generate_items, prompt_record, sft_record

    run_dir.mkdir(parents=True, exist_ok=True)
    items = generate_items(16, ["add"], digits=2, seed=1)
    make = prompt_record if train_type.startswith("online") else sft_record
    (run_dir / "data.jsonl").write_text("".join(json.dumps(make(it)) + "\n" for it in items))
    cfg = {
        "model": MODEL,
        "data": {"train_type": train_type, "data_path": str(run_dir / "data.jsonl"), "tokenizer_path": str(tok_dir),
                 "max_seq_len": 48, **({"val_split": 0.25} if train_type == "sft" else {})},
        "train": {"max_steps": 3, "batch_per_device": 4, "device": "cpu", **train},
        "optim": {"max_lr": 1e-3},
        "rl": {"group_size": 2, "rollout_max_tokens": 4},
        "ckpt": {"ckpt_dir": str(run_dir / "ckpt"), "ckpt_interval": 0},
        "log": {"log_dir": str(run_dir / "log"), "progress": False},
    }
    path = run_dir / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def summary_of(err: str) -> list[str]:
    """The summary's lines in a run's stderr (it starts with 'run finished' or 'stopped at')."""
    lines = err.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(("run finished at step", "stopped at step"))]
    assert len(starts) == 1, f"expected one summary, found {len(starts)}:\n{err[-3000:]}"
    return lines[starts[0]:starts[0] + 7]


def test_a_finished_offline_run_prints_its_summary_with_progress_off(tmp_path, tok_dir, capsys):
    path = write_run(tmp_path, tok_dir)
    assert main(["--config", str(path), "--no-progress"]) == 0
    lines = summary_of(capsys.readouterr().err)
    metrics = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m["split"] == "train"][-1]
    val = [m for m in metrics if m["split"] == "val"][-1]
    ckpt = tmp_path / "ckpt" / "step_00000003"
    assert lines[0] == "run finished at step 3 of 3"
    assert lines[1] == f"  train loss {train['loss']:.4f} (step 3), val loss {val['val/loss']:.4f} (step 3)"
    assert "tokens/s (" in lines[2] and "wall time" in lines[2]
    assert lines[3] == f"  last checkpoint: {ckpt}"
    assert lines[4] == f"  serve it:  astrai serve --model {shlex.quote(str(ckpt))}"
    assert not any("resume" in line for line in lines)  # a finished run has nothing to resume


def test_a_stopped_run_says_so_and_its_resume_command_continues_it(tmp_path, tok_dir, capsys, monkeypatch):
    """SIGTERM after step 1: the summary says it stopped, names the checkpoint of step 1 and gives
    the command that resumes it; running that command finishes the run."""
    path = write_run(tmp_path, tok_dir)
    from astrai.train import callbacks

    real = callbacks.default_callbacks

    class SigtermAfterFirstStep:
        def after_optimizer_step(self, trainer):
            if trainer.ctx.step == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler main() installed requests the stop

    monkeypatch.setattr("astrai.train.build.default_callbacks", lambda t: [*real(t), SigtermAfterFirstStep()])
    assert main(["--config", str(path), "--max-steps", "3"]) == 0
    lines = summary_of(capsys.readouterr().err)
    ckpt = tmp_path / "ckpt" / "step_00000001"
    assert lines[0] == "stopped at step 1 of 3 (signal SIGTERM); checkpoint published"
    assert lines[3] == f"  last checkpoint: {ckpt}"
    resume = lines[5].removeprefix("  resume:    ")
    assert resume == shlex.join(["astrai", "train", "--config", str(path), "--max-steps", "3", "--resume"])

    monkeypatch.setattr("astrai.train.build.default_callbacks", real)
    signals.uninstall_signal_handlers()
    assert main(shlex.split(resume)[2:]) == 0
    lines = summary_of(capsys.readouterr().err)
    assert lines[0] == "run finished at step 3 of 3"


def test_the_online_loop_prints_the_same_summary_with_its_reward(tmp_path, tok_dir, capsys):
    path = write_run(tmp_path, tok_dir, train_type="online_grpo", max_steps=2)
    assert main(["--config", str(path), "--progress", "false"]) == 0
    lines = summary_of(capsys.readouterr().err)
    last = [json.loads(x) for x in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()][-1]
    assert lines[0] == "run finished at step 2 of 2"
    assert lines[1] == (f"  train loss {last['loss']:.4f} (step 2), val loss - (no validation), "
                        f"reward_mean {last['reward_mean']:.4f}")
    assert lines[3] == f"  last checkpoint: {tmp_path / 'ckpt' / 'step_00000002'}"


def _fake_loop(tmp_path: Path, is_main: bool) -> SimpleNamespace:
    cfg = SimpleNamespace(ckpt=SimpleNamespace(ckpt_dir=str(tmp_path / "ckpt")),
                          train=SimpleNamespace(resume=False, param_path=None), log=SimpleNamespace(summary_hints=True))
    return SimpleNamespace(ctx=TrainContext(), config=cfg, is_main=is_main, total_steps=2, step_metrics={})


def test_only_rank_0_prints_and_a_failed_run_prints_no_summary(tmp_path):
    for is_main, fail, printed in [(False, False, False), (True, True, False), (True, False, True)]:
        out = io.StringIO()
        cb, loop = RunSummary(stream=out), _fake_loop(tmp_path, is_main)
        cb.on_train_begin(loop)
        loop.ctx.step, loop.ctx.tokens_seen, loop.step_metrics = 1, 40, {"step": 1, "loss": 2.5}
        cb.after_optimizer_step(loop)
        if fail:
            cb.on_error(loop, RuntimeError("boom"))
        cb.on_train_end(loop)
        assert bool(out.getvalue()) == printed, (is_main, fail, out.getvalue())
    assert out.getvalue().splitlines()[:2] == ["run finished at step 1 of 2",
                                               "  train loss 2.5000 (step 1), val loss - (no validation)"]
    assert "last checkpoint: none" in out.getvalue()


def test_format_summary_by_hand():
    report = RunReport(step=57, total_steps=200, seconds=125.0, tokens=250_000, stop_reason="signal SIGTERM",
                       train_loss=(57, 1.23456), val_loss=(50, 1.5), checkpoint=Path("out/ckpt/step_00000057"),
                       resume_command="astrai train --config run.yaml --resume")
    assert format_summary(report).splitlines() == [
        "stopped at step 57 of 200 (signal SIGTERM); checkpoint published",
        "  train loss 1.2346 (step 57), val loss 1.5000 (step 50)",
        "  2,000 tokens/s (250,000 tokens), wall time 2m 05s",
        "  last checkpoint: out/ckpt/step_00000057",
        "  serve it:  astrai serve --model out/ckpt/step_00000057",
        "  resume:    astrai train --config run.yaml --resume",
    ]
    from dataclasses import replace

    # log.summary_hints false (the demo's stages): the facts stay, the two commands go
    assert format_summary(replace(report, hints=False)).splitlines() == format_summary(report).splitlines()[:4]
    before_any_step = RunReport(step=0, total_steps=200, seconds=3.0, tokens=0, stop_reason="signal SIGINT")
    assert format_summary(before_any_step).splitlines()[0] == (
        "stopped at step 0 of 200 (signal SIGINT); no optimizer step completed, nothing to save")
    assert [format_duration(s) for s in (4.25, 61, 7322)] == ["4.2s", "1m 01s", "2h 02m"]


def test_resume_command_names_the_checkpoint_only_when_param_path_would_win(tmp_path):
    ckpt = tmp_path / "run" / "step_00000004"
    other = tmp_path / "other" / "step_00000010"  # a chained stage: weights from another run's checkpoint
    other.mkdir(parents=True)
    (other / "trainer_state.json").write_text("{}")
    model_dir = tmp_path / "model"
    model_dir.mkdir()

    def cfg(param_path=None, resume=False):
        return SimpleNamespace(train=SimpleNamespace(param_path=param_path, resume=resume))

    argv = ["--config", "run.yaml"]
    assert resume_command(argv, cfg(), ckpt) == "astrai train --config run.yaml --resume"
    assert resume_command(argv, cfg(str(model_dir)), ckpt) == "astrai train --config run.yaml --resume"
    assert resume_command([*argv, "--resume"], cfg(resume=True), ckpt) == "astrai train --config run.yaml --resume"
    assert resume_command(argv, cfg(str(other)), ckpt) == (
        f"astrai train --config run.yaml --resume --param_path {ckpt}")
    assert resume_command(None, cfg(), ckpt) is None  # the Python API: no command line to repeat
