"""`astrai train --resume` from a damaged checkpoint fails loudly, naming the file; never a fresh start."""

from __future__ import annotations

import pytest

from astrai.cli import main as astrai_main
from astrai.train import signals
from astrai.train.publish import latest_checkpoint
from tests.train.resume_data import read_metrics, write_run, write_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 optimizer steps with its checkpoint; tests copy it before damaging it."""
    root = tmp_path_factory.mktemp("damaged")
    config = write_run(root / "run", write_tokenizer(root / "tok"), "sft", num_records=8, max_steps=2)
    try:
        assert astrai_main(["train", "--config", str(config)]) == 0
    finally:
        signals.uninstall_signal_handlers()
    return config


def _resume(config, capsys, *extra: str) -> tuple[int, str]:
    try:
        code = astrai_main(["train", "--config", str(config), "--resume", "--max_steps", "4", *extra])
    finally:
        signals.uninstall_signal_handlers()
    return code, capsys.readouterr().err


def _fresh_copy(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained.parent, run)
    config = run / "run.yaml"
    config.write_text(config.read_text().replace(str(trained.parent), str(run)))
    return config, latest_checkpoint(run / "ckpt")


@pytest.mark.parametrize("keep_manifest", [True, False])
def test_truncated_optimizer_exits_nonzero_naming_it(trained, tmp_path, capsys, keep_manifest):
    config, ckpt = _fresh_copy(trained, tmp_path)
    data = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(data[: len(data) // 3])
    if not keep_manifest:
        (ckpt / "manifest.json").unlink()  # a legacy directory: only loads when named explicitly
    code, err = _resume(config, capsys, "--param_path", str(ckpt))
    assert code != 0
    assert "optimizer.pt" in err
    # nothing trained: the log still ends at the checkpoint's step
    assert [m["step"] for m in read_metrics(config.parent)] == [1, 2]


def test_flipped_weight_byte_exits_nonzero_naming_it(trained, tmp_path, capsys):
    config, ckpt = _fresh_copy(trained, tmp_path)
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    code, err = _resume(config, capsys)
    assert code != 0 and "model.safetensors" in err and "sha256" in err


def test_missing_trainer_state_exits_nonzero_naming_it(trained, tmp_path, capsys):
    config, ckpt = _fresh_copy(trained, tmp_path)
    (ckpt / "manifest.json").unlink()
    (ckpt / "trainer_state.json").unlink()
    code, err = _resume(config, capsys, "--param_path", str(ckpt))
    assert code != 0 and "trainer_state.json" in err


def test_resume_from_ckpt_dir_names_the_damaged_file(trained, tmp_path, capsys):
    # no --param_path: the newest complete checkpoint in ckpt_dir is looked up, and there is none
    config, ckpt = _fresh_copy(trained, tmp_path)
    data = (ckpt / "optimizer.pt").read_bytes()
    (ckpt / "optimizer.pt").write_bytes(data[:100])
    code, err = _resume(config, capsys)
    assert code != 0 and "optimizer.pt" in err and "no complete checkpoint" in err


def test_resume_with_another_model_shape_exits_naming_the_fields(trained, tmp_path, capsys):
    # the checkpoint's model has hidden_size 32 and 2 KV heads; training it under a YAML asking
    # for another shape would be a silent lie
    config, _ = _fresh_copy(trained, tmp_path)
    code, err = _resume(config, capsys, "--hidden_size", "64", "--num_key_value_heads", "4")
    assert code != 0
    [line] = [ln for ln in err.splitlines() if "error" in ln]
    assert "hidden_size=64 (checkpoint: 32)" in line and "num_key_value_heads=4 (checkpoint: 2)" in line
    assert "--ckpt_dir" in line  # the fix: set them back, or a new run elsewhere
    assert [m["step"] for m in read_metrics(config.parent)] == [1, 2]


def test_resume_with_another_rope_theta_warns_it_is_ignored(trained, tmp_path, capsys):
    config, _ = _fresh_copy(trained, tmp_path)
    code, err = _resume(config, capsys, "--rope_theta", "20000")
    assert code == 0
    assert "model fields rope_theta=20000.0 (checkpoint: 10000.0) are ignored on resume" in err


def test_resume_past_max_steps_says_how_to_extend_the_run(trained, tmp_path, capsys):
    config, _ = _fresh_copy(trained, tmp_path)
    code, err = _resume(config, capsys, "--max_steps", "1")  # the checkpoint is at step 2
    assert code != 0
    [line] = [ln for ln in err.splitlines() if "error" in ln]
    assert "at step 2" in line and "max_steps=1" in line and "--max_steps above 2" in line
    assert [m["step"] for m in read_metrics(config.parent)] == [1, 2]
