"""rl.host_mmap_threshold_mb: glibc's mmap threshold fixed for the online loop, so a large freed
host tensor goes back to the kernel instead of leaving a hole in the heap."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from astrai.config import ConfigError, load_config

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# in a fresh interpreter: RSS after freeing a touched 24 MiB tensor, with and without the setting.
# glibc's moving threshold starts at 128 KiB and rises to the size of each mmapped block freed, so
# after one 24 MiB free a second one comes from the heap and its pages stay resident when freed.
PROBE = """
import sys, torch
from astrai.train.host_memory import set_mmap_threshold
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
ok = set_mmap_threshold(int(sys.argv[1])) if sys.argv[1] != "0" else False
kept = []
for _ in range(2):
    t = torch.ones(6 * 2**20)  # 24 MiB, every page touched
    kept.append(torch.ones(16))  # something small allocated after it, pinning the heap's top
    before = rss_mb()
    del t
    freed = before - rss_mb()
print(ok, round(freed))
"""


def run_probe(megabytes: int, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(megabytes)], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="mallopt(M_MMAP_THRESHOLD) is glibc's")
def test_a_fixed_threshold_returns_freed_tensors_to_the_kernel():
    set_ok, freed = run_probe(1)
    assert set_ok == "True" and freed >= 20  # the second 24 MiB block was its own mapping
    default_ok, default_freed = run_probe(0)
    assert default_ok == "False" and default_freed <= 4  # glibc's default kept it in the heap


@pytest.mark.skipif(not GLIBC, reason="mallopt(M_MMAP_THRESHOLD) is glibc's")
def test_the_environment_wins():
    import os

    set_ok, _ = run_probe(1, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 2**20)})
    assert set_ok == "False"


@pytest.mark.parametrize("value", [-1, 33])
def test_out_of_range_is_one_clear_line(value):
    with pytest.raises(ConfigError, match=rf"host_mmap_threshold_mb={value} must be within \[0, 32\]"):
        load_config(None, ["--train_type", "online_grpo", "--host_mmap_threshold_mb", str(value)])


@pytest.mark.parametrize("megabytes", [0, 1])
def test_the_online_loop_applies_the_setting_before_the_model(tmp_path, monkeypatch, megabytes):
    import astrai.train.rl.loop as loop_mod
    from astrai.train.rl.loop import OnlineLoop
    from tests.train.resume_data import write_tokenizer
    from tests.train.test_rl import write_rl_run

    calls = []
    real_build = loop_mod.build_run
    monkeypatch.setattr(loop_mod, "set_mmap_threshold", lambda mb: calls.append(("threshold", mb)))
    monkeypatch.setattr(loop_mod, "build_run", lambda *a, **k: calls.append(("model",)) or real_build(*a, **k))
    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir)
    config = write_rl_run(tmp_path / "run", tok_dir, host_mmap_threshold_mb=megabytes)
    OnlineLoop(load_config(config, []))
    assert calls == [("threshold", megabytes), ("model",)]
