"""The one finder of "the newest complete checkpoint" (`astrai.model.manifest.newest_checkpoint`):
each kind of damage is skipped at the level that detects it and accepted below it; newest first."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from astrai.model.manifest import LEVELS, MANIFEST, Newest, check_checkpoint, newest_checkpoint, step_dirs


def _checkpoint(ckpt_dir: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    """A `step_N` directory with a DESIGN.md 3.2 manifest over its files (no training code involved)."""
    path = ckpt_dir / f"step_{step:08d}"
    path.mkdir(parents=True)
    files = files or {"model.safetensors": b"weights-%d" % step, "critic.pt": b"critic"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    entries = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}
    (path / MANIFEST).write_text(json.dumps({"format": "astrai-checkpoint", "version": 1, "step": step,
                                             "files": entries}))
    return path


def _unlist(path: Path, name: str) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"][name]
    (path / MANIFEST).write_text(json.dumps(manifest))
    (path / name).unlink()


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size: only a checksum sees it
    path.write_bytes(bytes(data))


DAMAGE = {  # kind -> (how, the lowest level that skips it, what the problem names)
    "no manifest": (lambda p: (p / MANIFEST).unlink(), "manifest", "has no manifest.json"),
    "renamed": (lambda p: p.rename(p.with_name("step_00000003")), "manifest", "records step 2 but the directory is"),
    "wrong size": (lambda p: (p / "model.safetensors").write_bytes(b"cut"), "sizes", "model.safetensors has 3 bytes"),
    "bad checksum": (lambda p: _flip_last_byte(p / "model.safetensors"), "checksums",
                     "model.safetensors fails its sha256 check"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_each_damage_is_skipped_from_the_level_that_detects_it(tmp_path, kind):
    damage, detected_at, named = DAMAGE[kind]
    good = _checkpoint(tmp_path, 1)
    damage(_checkpoint(tmp_path, 2))
    damaged = step_dirs(tmp_path)[-1][1]
    for level in LEVELS:
        found = newest_checkpoint(tmp_path, level)
        if LEVELS.index(level) >= LEVELS.index(detected_at):
            assert found.path == good, (kind, level)
            assert len(found.skipped) == 1 and named in found.skipped[0] and str(damaged) in found.skipped[0]
        else:
            assert found == Newest(damaged, []), (kind, level)


@pytest.mark.parametrize("level", LEVELS)
def test_a_missing_required_file_is_skipped_at_every_level_and_only_when_required(tmp_path, level):
    good = _checkpoint(tmp_path, 1)
    newer = _checkpoint(tmp_path, 2)
    _unlist(newer, "critic.pt")  # a whole checkpoint, just without the critic
    assert newest_checkpoint(tmp_path, level) == Newest(newer, [])
    found = newest_checkpoint(tmp_path, level, required=("critic.pt",))
    assert found.path == good and found.skipped == [f"{newer} lacks critic.pt, which its train type needs to resume"]
    # a function of the checkpoint decides per checkpoint (the training side reads its train type)
    asked = []
    needs = lambda p: asked.append(p.name) or (("critic.pt",) if p == newer else ())  # noqa: E731
    assert newest_checkpoint(tmp_path, level, required=needs).path == good
    assert asked == ["step_00000002", "step_00000001"]


def test_newest_first_by_step_number_and_only_public_step_directories(tmp_path):
    assert newest_checkpoint(tmp_path / "missing", "checksums") == Newest(None, [])
    for step in (2, 10, 99_999_999, 100_000_000):  # 9 digits: sorts first by name, last by number
        _checkpoint(tmp_path, step)
    (tmp_path / ".step_200000000.staging-7").mkdir()  # hidden staging: never counts
    (tmp_path / "step_300000000").write_text("a file, not a checkpoint")
    assert [s for s, _ in step_dirs(tmp_path)] == [2, 10, 99_999_999, 100_000_000]
    assert newest_checkpoint(tmp_path, "sizes").path.name == "step_100000000"
    for step in (100_000_000, 99_999_999):
        (tmp_path / f"step_{step:08d}" / MANIFEST).unlink()
    found = newest_checkpoint(tmp_path, "sizes")
    assert found.path == tmp_path / "step_00000010"
    assert [p.split(" has no")[0] for p in found.skipped] == [str(tmp_path / "step_100000000"),
                                                              str(tmp_path / "step_99999999")]
    for _, path in step_dirs(tmp_path):
        (path / MANIFEST).write_text("{")
    found = newest_checkpoint(tmp_path, "manifest")
    assert found.path is None and len(found.skipped) == 4 and "not valid JSON" in found.skipped[0]


def test_an_unknown_level_is_an_error_even_without_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="level must be one of manifest, sizes, checksums, got 'size'"):
        newest_checkpoint(tmp_path, "size")
    with pytest.raises(ValueError, match="got 'verify'"):
        check_checkpoint(_checkpoint(tmp_path, 1), "verify")
