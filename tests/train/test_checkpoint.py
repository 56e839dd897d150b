"""The checkpoint file layer: atomic publish, manifest, verify, latest lookup, retention, cleanup, CLI."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from astrai.train import checkpoint as CK
from astrai.train import publish as C
from astrai.train.ckpt_cli import main as ckpt_main


def _writer(payload: bytes = b"weights", extra: bool = True):
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(payload)
        (d / "trainer_state.json").write_text('{"step": 1}')
        if extra:
            (d / "sub").mkdir()
            (d / "sub" / "x.bin").write_bytes(b"\x00" * 10)

    return write


def _hidden(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if p.name.startswith("."))


def test_publish_writes_manifest_with_sizes_and_sha256(tmp_path):
    path = C.publish(tmp_path, 7, _writer(b"abc"))
    assert path == tmp_path / "step_00000007"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "astrai-checkpoint" and manifest["version"] == 1 and manifest["step"] == 7
    assert sorted(manifest["files"]) == ["model.safetensors", "sub/x.bin", "trainer_state.json"]
    assert manifest["files"]["model.safetensors"] == {"size": 3, "sha256": hashlib.sha256(b"abc").hexdigest()}
    assert manifest["files"]["sub/x.bin"]["size"] == 10
    assert _hidden(tmp_path) == []
    C.verify_checkpoint(path)
    assert C.read_manifest(path) == manifest


def test_republish_replaces_and_leaves_nothing_hidden(tmp_path):
    C.publish(tmp_path, 3, _writer(b"old", extra=True))
    path = C.publish(tmp_path, 3, _writer(b"new!", extra=False))
    assert (path / "model.safetensors").read_bytes() == b"new!"
    assert not (path / "sub").exists()  # nothing of the old directory survives
    assert _hidden(tmp_path) == []
    C.verify_checkpoint(path)


def test_failed_writer_publishes_nothing(tmp_path):
    C.publish(tmp_path, 1, _writer())

    def broken(d: Path) -> None:
        (d / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        C.publish(tmp_path, 2, broken)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000001"]
    assert C.latest_checkpoint(tmp_path) == tmp_path / "step_00000001"


def test_keep_last_retention_after_publish(tmp_path):
    (tmp_path / "step_00000000").mkdir()  # legacy directory without manifest: never deleted
    for step in range(1, 6):
        C.publish(tmp_path, step, _writer(), keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_00000000", "step_00000004", "step_00000005"]
    # republishing an old step keeps it even though it is not among the newest two
    C.publish(tmp_path, 2, _writer(), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir())[1:] == ["step_00000002", "step_00000004", "step_00000005"]
    with pytest.raises(ValueError, match="keep_last"):
        C.publish(tmp_path, 9, _writer(), keep_last=0)


def test_latest_checkpoint_skips_incomplete_and_hidden(tmp_path):
    assert C.latest_checkpoint(tmp_path / "missing") is None
    C.publish(tmp_path, 2, _writer())
    C.publish(tmp_path, 4, _writer())
    (tmp_path / "step_00000009").mkdir()  # no manifest
    (tmp_path / ".step_00000010.staging-123").mkdir()  # hidden staging
    C.publish(tmp_path, 6, _writer())
    (tmp_path / "step_00000006" / "model.safetensors").write_bytes(b"x")  # truncated after publish
    assert C.latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    assert [s for s, _ in C.list_checkpoints(tmp_path)] == [2, 4]


def test_checkpoint_to_resume_names_damage(tmp_path, capsys):
    with pytest.raises(C.CheckpointError, match="no checkpoint"):
        CK.checkpoint_to_resume(tmp_path)
    path = C.publish(tmp_path, 1, _writer(b"0123"))
    (path / "model.safetensors").write_bytes(b"01")
    with pytest.raises(C.CheckpointError, match="no complete checkpoint.*model.safetensors has 2 bytes"):
        CK.checkpoint_to_resume(tmp_path)
    C.publish(tmp_path, 1, _writer())
    damaged = C.publish(tmp_path, 2, _writer())
    (damaged / "trainer_state.json").unlink()
    assert CK.checkpoint_to_resume(tmp_path) == tmp_path / "step_00000001"
    assert "skipping a damaged checkpoint newer than step_00000001" in capsys.readouterr().err


def test_verify_names_corrupt_truncated_and_missing_file(tmp_path):
    path = C.publish(tmp_path, 1, _writer(b"0123456789"))
    f = path / "model.safetensors"
    f.write_bytes(b"0123456780")  # one byte changed, same size
    with pytest.raises(C.CheckpointError, match="model.safetensors.*sha256"):
        C.verify_checkpoint(path)
    C.verify_checkpoint(path, checksums=False)  # sizes still agree
    f.write_bytes(b"01234")
    with pytest.raises(C.CheckpointError, match="model.safetensors has 5 bytes"):
        C.verify_checkpoint(path, checksums=False)
    (path / "sub" / "x.bin").unlink()
    f.write_bytes(b"0123456789")
    with pytest.raises(C.CheckpointError, match="x.bin is listed"):
        C.verify_checkpoint(path)


@pytest.mark.parametrize(
    "text, match",
    [
        (None, "no manifest.json"),
        ("{not json", "not valid JSON"),
        ('{"format": "other", "version": 1, "step": 1, "files": {}}', "'format' must be"),
        ('{"format": "astrai-checkpoint", "version": 2, "step": 1, "files": {}}', "version 2"),
        ('{"format": "astrai-checkpoint", "version": 1, "step": 1, "files": {"a": {}}}', "entry for 'a'"),
        ('{"format": "astrai-checkpoint", "version": 1, "step": 5, "files": {}}', "records step 5"),
    ],
)
def test_bad_manifests_are_errors(tmp_path, text, match):
    path = tmp_path / "step_00000001"
    path.mkdir()
    if text is not None:
        (path / "manifest.json").write_text(text)
    with pytest.raises(C.CheckpointError, match=match):
        C.verify_checkpoint(path)
    assert C.latest_checkpoint(tmp_path) is None


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_manifest_entry_outside_the_checkpoint_makes_it_damaged(tmp_path, where):
    # the outside file is there with the listed size and sha256: only its name gives it away
    from astrai.model.manifest import ManifestError, check_model_dir

    outside = tmp_path / "hostname"
    outside.write_bytes(b"somebody else's\n")
    path = C.publish(tmp_path / "ckpt", 1, _writer())
    manifest = json.loads((path / "manifest.json").read_text())
    name = "../../hostname" if where == "relative" else str(outside)
    manifest["files"][name] = {"size": outside.stat().st_size, "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(C.CheckpointError, match=f"entry '{name}' points outside the checkpoint"):
        C.verify_checkpoint(path)
    assert C.latest_checkpoint(tmp_path / "ckpt") is None
    with pytest.raises(ManifestError, match="points outside"):
        check_model_dir(path)  # serving and generation refuse it too


def test_cleanup_restores_interrupted_republish_and_removes_leftovers(tmp_path):
    # a crash between retiring step 3 and renaming its new copy: only hidden copies remain
    good = C.publish(tmp_path, 3, _writer(b"new"))
    os.replace(good, tmp_path / ".step_00000003.staging-2")  # another (dead) process
    C.publish(tmp_path, 3, _writer(b"old"))
    os.replace(tmp_path / "step_00000003", tmp_path / ".step_00000003.retired-1")
    # a half-written staging directory of step 4 and a half-deleted step 1
    (tmp_path / ".step_00000004.staging-1").mkdir()
    C.publish(tmp_path, 1, _writer())
    os.replace(tmp_path / "step_00000001", tmp_path / ".step_00000001.deleting-1")
    assert C.latest_checkpoint(tmp_path) is None

    restored = C.cleanup_leftovers(tmp_path)
    assert restored == [tmp_path / "step_00000003"]
    assert (tmp_path / "step_00000003" / "model.safetensors").read_bytes() == b"new"  # staged copy wins
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003"]
    C.verify_checkpoint(tmp_path / "step_00000003")


def test_cleanup_restores_retired_when_staging_is_incomplete(tmp_path):
    C.publish(tmp_path, 5, _writer(b"old"))
    os.replace(tmp_path / "step_00000005", tmp_path / ".step_00000005.retired-1")
    (tmp_path / ".step_00000005.staging-1").mkdir()
    assert C.cleanup_leftovers(tmp_path) == [tmp_path / "step_00000005"]
    assert (tmp_path / "step_00000005" / "model.safetensors").read_bytes() == b"old"
    assert _hidden(tmp_path) == []


def test_manifest_cannot_be_written_by_writer(tmp_path):
    with pytest.raises(C.CheckpointError, match="manifest"):
        C.publish(tmp_path, 1, lambda d: (d / "manifest.json").write_text("{}"))
    assert list(tmp_path.iterdir()) == []


def test_background_publish_appears_after_wait(tmp_path):
    import threading

    release = threading.Event()
    original = C._seal

    def slow_seal(staging, step):  # hold the background part until the test looks
        release.wait(10)
        original(staging, step)

    C.publish(tmp_path, 1, _writer())
    try:
        C._seal = slow_seal
        path = C.publish(tmp_path, 2, _writer(b"new"), keep_last=1, background=True)
        assert C.latest_checkpoint(tmp_path) == tmp_path / "step_00000001"  # not visible yet
        assert _hidden(tmp_path) == [f".step_00000002.staging-{os.getpid()}"]
        release.set()
        C.wait_for_publish()
    finally:
        C._seal = original
    assert C.latest_checkpoint(tmp_path) == path == tmp_path / "step_00000002"
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002"]  # retention ran after it
    C.verify_checkpoint(path)


def test_background_publish_error_surfaces_at_the_next_publish(tmp_path):
    C.publish(tmp_path, 1, lambda d: (d / "manifest.json").write_text("{}"), background=True)
    with pytest.raises(C.CheckpointError, match="manifest"):
        C.publish(tmp_path, 2, _writer())
    assert list(tmp_path.iterdir()) == []  # neither the failed one nor the next was published
    C.wait_for_publish()  # the error was reported once


def test_cli_list_and_verify(tmp_path, capsys):
    C.publish(tmp_path, 1, _writer())
    path = C.publish(tmp_path, 2, _writer(b"0123"))
    (tmp_path / ".step_00000003.staging-1").mkdir()
    assert ckpt_main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step_00000001" in out and "complete" in out and "leftover" in out
    assert "latest complete: step_00000002" in out
    assert ckpt_main(["verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("OK") == 2
    (path / "model.safetensors").write_bytes(b"0124")
    assert ckpt_main(["verify", str(path)]) == 1
    assert "model.safetensors" in capsys.readouterr().out
    assert ckpt_main(["verify", str(tmp_path / "nothing")]) == 2


def test_cli_latest_prints_the_newest_complete_checkpoint_or_fails(tmp_path, capsys):
    assert ckpt_main(["latest", str(tmp_path)]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    C.publish(tmp_path, 1, _writer())
    newer = C.publish(tmp_path, 2, _writer())
    (newer / "manifest.json").write_text("not json")  # damaged: skipped with a warning naming it
    assert ckpt_main(["latest", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "step_00000001")
    assert "manifest.json" in captured.err


def test_each_caller_asks_the_one_finder_at_its_level(tmp_path, capsys):
    """latest_checkpoint, `ckpt list` and `--model CKPT_DIR` check sizes; `--resume` and `ckpt latest`
    also checksums and the files the train type needs (the PPO critic)."""
    from astrai.model.manifest import resolve_model_dir

    def ppo(critic: bool):
        def write(d: Path) -> None:
            _writer()(d)
            (d / "trainer_state.json").write_text(json.dumps({"config": {"data": {"train_type": "online_ppo"}}}))
            for name in ("value_model.pt", "value_optimizer.pt")[: 2 if critic else 1]:
                (d / name).write_bytes(b"critic")
        return write

    C.publish(tmp_path, 1, ppo(critic=True))
    C.publish(tmp_path, 2, ppo(critic=False))  # complete, but cannot resume a PPO run
    bad = C.publish(tmp_path, 3, ppo(critic=True))
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[0] ^= 0x01  # same size: only a checksum sees it
    (bad / "model.safetensors").write_bytes(bytes(data))
    assert C.latest_checkpoint(tmp_path) == resolve_model_dir(tmp_path) == bad
    assert ckpt_main(["list", str(tmp_path)]) == 0
    assert "latest complete: step_00000003" in capsys.readouterr().out
    assert CK.checkpoint_to_resume(tmp_path) == tmp_path / "step_00000001"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: skipping a damaged checkpoint newer than step_00000001: {tmp_path / 'step_00000002'} lacks "
        "value_optimizer.pt, which its train type needs to resume",
        f"warning: skipping a damaged checkpoint newer than step_00000001: {bad / 'model.safetensors'} fails its "
        f"sha256 check (manifest.json {C.read_manifest(bad)['files']['model.safetensors']['sha256'][:12]}..., file "
        f"{hashlib.sha256(bytes(data)).hexdigest()[:12]}...); the file is damaged, use another checkpoint",
    ]
    assert ckpt_main(["latest", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "step_00000001")


def test_ckpt_latest_of_an_empty_folder_says_no_checkpoint(tmp_path, capsys):
    from astrai.train.ckpt_cli import main as ckpt_main

    assert ckpt_main(["latest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no checkpoint in {tmp_path} (no step_* directory in it)" in err and "--resume" not in err
