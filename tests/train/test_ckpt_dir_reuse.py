"""A fresh run on a ckpt_dir that holds another run's checkpoints is refused in one line naming
--resume and --overwrite_ckpt_dir (its saves would mix with the old run's: retention deleting its
own, the summary naming the old run's step); with the flag the old checkpoints are deleted before
the first save; the summary names this run's own last checkpoint; a symlinked `.lock` is refused."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from astrai.train import signals
from astrai.train.cli import main
from astrai.train.context import TrainContext
from astrai.train.publish import CheckpointError, last_published, latest_checkpoint, publish, run_lock
from astrai.train.summary import RunSummary


@pytest.fixture(autouse=True)
def _restore_signal_handlers():
    yield
    signals.uninstall_signal_handlers()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from astrai.data.tokenizer_training import train_tokenizer

    d = tmp_path_factory.mktemp("reuse")
    rows = [{"messages": [{"role": "user", "content": f"add {i} and {i + 1}"},
                          {"role": "assistant", "content": f"{i} plus {i + 1} is {2 * i + 1}"}]} for i in range(16)]
    (d / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer([d / "sft.jsonl"], vocab_size=300, out_dir=d / "tok")
    return d


def _config(data: Path, run: Path) -> Path:
    cfg = {
        "model": {"vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "max_position_embeddings": 64},
        "data": {"train_type": "sft", "data_path": str(data / "sft.jsonl"), "tokenizer_path": str(data / "tok"),
                 "max_seq_len": 48},
        "train": {"batch_per_device": 4, "max_steps": 3},
        "ckpt": {"ckpt_dir": str(run / "ckpt"), "ckpt_interval": 1, "keep_last": 2},
        "log": {"log_dir": str(run / "log"), "progress": False},
    }
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.yaml").write_text(yaml.safe_dump(cfg))
    return run / "run.yaml"


def _steps(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("step_"))


def _last_checkpoint_line(err: str) -> str:
    return next(line.strip() for line in err.splitlines() if line.strip().startswith("last checkpoint:"))


def test_a_fresh_run_on_a_used_ckpt_dir_is_refused_or_overwrites_with_the_flag(data, tmp_path, capsys):
    path = _config(data, tmp_path)
    ckpt = tmp_path / "ckpt"
    assert main(["--config", str(path)]) == 0
    assert _steps(ckpt) == ["step_00000002", "step_00000003"]
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.name != ".lock"}
    capsys.readouterr()

    assert main(["--config", str(path), "--max_steps", "1"]) == 1  # a second, unrelated run
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--resume" in lines[0] and "--overwrite_ckpt_dir" in lines[0] and str(ckpt) in lines[0]
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("*") if p.name != ".lock"} == before  # untouched

    assert main(["--config", str(path), "--max_steps", "1", "--overwrite_ckpt_dir"]) == 0
    err = capsys.readouterr().err
    assert "deleted 2 checkpoint(s)" in err
    assert _steps(ckpt) == ["step_00000001"]  # the old run's step_2 and step_3 are gone
    assert _last_checkpoint_line(err) == f"last checkpoint: {ckpt / 'step_00000001'}"

    assert main(["--config", str(path), "--max_steps", "2", "--resume"]) == 0  # continuing is no reuse
    assert _steps(ckpt) == ["step_00000001", "step_00000002"]


def test_overwrite_never_deletes_the_runs_own_param_path(data, tmp_path, capsys):
    path = _config(data, tmp_path)
    assert main(["--config", str(path), "--max_steps", "1"]) == 0
    capsys.readouterr()
    init = tmp_path / "ckpt" / "step_00000001"
    assert main(["--config", str(path), "--param_path", str(init), "--overwrite_ckpt_dir"]) == 1
    assert "is this run's param_path" in capsys.readouterr().err
    assert init.is_dir()


def _fake_loop(ckpt_dir: Path, resume: bool = False) -> SimpleNamespace:
    cfg = SimpleNamespace(ckpt=SimpleNamespace(ckpt_dir=str(ckpt_dir)),
                          train=SimpleNamespace(resume=resume, param_path=None), log=SimpleNamespace(summary_hints=True))
    return SimpleNamespace(ctx=TrainContext(), config=cfg, is_main=True, total_steps=2, step_metrics={})


def test_the_summary_names_this_runs_own_checkpoint_not_the_newest_in_the_dir(tmp_path):
    ckpt = tmp_path / "ckpt"
    publish(ckpt, 2, lambda staging: (staging / "weights").write_text("this run"))
    other = tmp_path / "other"  # another process's checkpoint of a later step, landing in the same dir
    publish(other, 9, lambda staging: (staging / "weights").write_text("an older run"))
    (other / "step_00000009").rename(ckpt / "step_00000009")
    assert latest_checkpoint(ckpt) == ckpt / "step_00000009"
    assert last_published(ckpt) == ckpt / "step_00000002"

    out = io.StringIO()
    summary, loop = RunSummary(stream=out), _fake_loop(ckpt)
    summary.on_train_begin(loop)
    loop.ctx.step = 2
    summary.on_train_end(loop)
    assert f"last checkpoint: {ckpt / 'step_00000002'}" in out.getvalue()


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(data, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".lock").symlink_to(victim)
    with pytest.raises(CheckpointError, match="is a symlink"):
        with run_lock(ckpt):
            pass
    path = _config(data, tmp_path)
    assert main(["--config", str(path), "--max_steps", "1"]) == 1
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.strip()]) == 1 and ".lock is a symlink" in err, err
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_a_lock_that_is_no_plain_file_is_one_line(data, tmp_path, capsys, kind):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if kind == "directory":
        (ckpt / ".lock").mkdir()
    else:
        os.mkfifo(ckpt / ".lock")  # opening it for reading alone would wait for a writer
    assert main(["--config", str(_config(data, tmp_path)), "--max_steps", "1"]) == 1
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert f".lock is a {kind}" in err and "remove" in err, err
