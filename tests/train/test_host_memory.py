"""rl.host_mmap_threshold_mb: glibc's mmap threshold fixed for the online loop, so a large freed
host tensor goes back to the kernel instead of leaving a hole in the heap; rl.host_keep_heap:
freed heap memory stays mapped for the next step instead of being trimmed and faulted back."""

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


# in a fresh interpreter: RSS given back when a burst of four touched 24 MiB blocks (96 MiB at the
# heap's top, after a warm-up block that settles glibc's moving thresholds at 24 / 48 MiB) is
# freed; malloc directly and RSS read through a raw descriptor, so nothing small lands above the
# blocks and pins the top (an 8 KiB file buffer did, depending on the interpreter's heap layout)
KEEP_PROBE = """
import ctypes, os, sys
from astrai.train.host_memory import HeapTrim
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
statm = os.open("/proc/self/statm", os.O_RDONLY)  # read without a file object: its malloc'd buffer could pin the top
def rss_mb():
    return int(os.pread(statm, 128, 0).split()[1]) * 4096 / 2**20
rss_mb()
def block():
    p = libc.malloc(24 * 2**20)
    ctypes.memset(p, 1, 24 * 2**20)
    return p
heap = HeapTrim()
ok = heap.start(sys.argv[1] == "1")
libc.free(block())
with heap.rollout() if sys.argv[2] == "rollout" else open("/dev/null"):
    burst = [block() for _ in range(4)]
    before = rss_mb()
    for p in burst:
        libc.free(p)
    after = rss_mb()
print(ok, round(before - after))
"""


def run_keep_probe(enabled: bool, phase: str, env: dict | None = None) -> tuple[str, int]:
    """In a fresh interpreter each time, so the heap's layout is the probe's own."""
    out = subprocess.run([sys.executable, "-c", KEEP_PROBE, "1" if enabled else "0", phase], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="mallopt(M_TRIM_THRESHOLD) is glibc's")
def test_the_heap_is_kept_during_the_rollout_and_trimmed_in_training():
    ok, in_rollout = run_keep_probe(True, "rollout")
    assert ok == "True" and in_rollout <= 4  # the 96 MiB stay in the heap for the next decode step
    ok, in_training = run_keep_probe(True, "train")
    assert ok == "True" and in_training >= 64  # the trainer's policy: glibc's settled default, which trims the top
    default_ok, default_rollout = run_keep_probe(False, "rollout")
    assert default_ok == "False" and default_rollout >= 64  # off: glibc's default trims the top


@pytest.mark.skipif(not GLIBC, reason="mallopt(M_TRIM_THRESHOLD) is glibc's")
def test_a_trim_threshold_from_the_environment_wins():
    import os

    ok, in_rollout = run_keep_probe(True, "rollout", env={**os.environ, "MALLOC_TRIM_THRESHOLD_": str(2**20)})
    assert ok == "False" and in_rollout >= 64


@pytest.mark.parametrize("value", [-1, 33])
def test_out_of_range_is_one_clear_line(value):
    with pytest.raises(ConfigError, match=rf"host_mmap_threshold_mb={value} must be within \[0, 32\]"):
        load_config(None, ["--train_type", "online_grpo", "--host_mmap_threshold_mb", str(value)])


@pytest.mark.parametrize("megabytes,keep", [(0, True), (1, False)])
def test_the_online_loop_applies_the_setting_before_the_model(tmp_path, monkeypatch, megabytes, keep):
    import astrai.train.rl.loop as loop_mod
    from astrai.train.rl.loop import OnlineLoop
    from tests.train.resume_data import write_tokenizer
    from tests.train.rl_runs import write_rl_run

    calls = []
    real_build = loop_mod.build_run
    monkeypatch.setattr(loop_mod, "set_mmap_threshold", lambda mb: calls.append(("threshold", mb)))
    monkeypatch.setattr(loop_mod.HeapTrim, "start", lambda self, on, mb: calls.append(("keep", on, mb)))
    monkeypatch.setattr(loop_mod, "build_run", lambda *a, **k: calls.append(("model",)) or real_build(*a, **k))
    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir)
    config = write_rl_run(tmp_path / "run", tok_dir, host_mmap_threshold_mb=megabytes,
                           host_keep_heap=keep)
    OnlineLoop(load_config(config, []))
    assert calls == [("threshold", megabytes), ("keep", keep, megabytes), ("model",)]


def test_the_online_loop_decodes_every_rollout_inside_the_kept_heap(tmp_path, monkeypatch):
    from contextlib import contextmanager

    import astrai.train.rl.loop as loop_mod
    from astrai.train.rl.loop import OnlineLoop
    from tests.train.resume_data import write_tokenizer
    from tests.train.rl_runs import write_rl_run

    events = []

    @contextmanager
    def rollout(self):
        events.append("enter")
        yield
        events.append("exit")

    monkeypatch.setattr(loop_mod.HeapTrim, "rollout", rollout)
    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir)
    config = write_rl_run(tmp_path / "run", tok_dir)
    loop = OnlineLoop(load_config(config, ["--max_steps", "2"]))
    draw = loop.runner.rollout
    monkeypatch.setattr(loop.runner, "rollout", lambda *a, **k: events.append("generate") or draw(*a, **k))
    loop.train()
    assert events == ["enter", "generate", "exit"] * 2  # one rollout per step, each inside the policy
