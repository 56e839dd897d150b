"""Hugging Face Hub ids as models: `--model org/name` and `param_path: org/name` load the cached
snapshot (model/hub.py), offline, from a fake Hub cache laid out as huggingface_hub writes it."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.model.hub import HubError, is_hub_id, resolve_model_path
from tests.infer.conftest import tiny_model

pytest.importorskip("huggingface_hub")

REPO_ID = "tiny-org/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(cache: Path, repo_id: str, model_dir: Path, commit: str = COMMIT) -> Path:
    """models--org--name/snapshots/<commit>/... and refs/main, as huggingface_hub's cache holds them."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tok):
    from astrai.model.hf import save_model

    model_dir = tmp_path_factory.mktemp("hub_src")
    save_model(tiny_model(seed=3, vocab_size=320), model_dir, tokenizer=tok)
    cache = tmp_path_factory.mktemp("hub_cache")
    return cache, fake_hub_cache(cache, REPO_ID, model_dir)


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    """HF_HUB_CACHE -> the fake cache and HF_HUB_OFFLINE on, in this process (huggingface_hub reads
    both into its constants when imported, so the constants are patched as well as the env)."""
    from huggingface_hub import constants

    cache, snapshot = hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_hub_ids_are_told_apart_from_local_paths(tmp_path, monkeypatch):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name@v1.0")
    for local in ("/abs/path", "./org/name", "../org/name", "model", "a/b/c", "org/"):
        assert not is_hub_id(local), local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a local path that exists wins
    assert resolve_model_path("org/name") == "org/name"


def test_resolves_the_cached_snapshot(offline_cache):
    assert Path(resolve_model_path(REPO_ID)) == offline_cache
    assert Path(resolve_model_path(f"{REPO_ID}@main")) == offline_cache


def test_offline_and_not_cached_names_the_id_and_the_fix(offline_cache):
    with pytest.raises(HubError) as err:
        resolve_model_path("tiny-org/not-cached", "param_path")
    message = str(err.value)
    assert "param_path 'tiny-org/not-cached'" in message and "HF_HUB_OFFLINE" in message
    assert "download tiny-org/not-cached" in message and str(offline_cache.parents[3]) in message


def test_missing_huggingface_hub_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    with pytest.raises(HubError, match="pip install huggingface_hub"):
        resolve_model_path("tiny-org/tiny-chat")


def test_generate_cli_with_a_hub_id(hub_cache, tmp_path):
    """The whole command in a fresh process: HF_HUB_CACHE and HF_HUB_OFFLINE from the environment."""
    cache, _ = hub_cache
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "home")}
    argv = [sys.executable, "-m", "astrai", "generate", "--model", REPO_ID, "--prompt", "Hello",
            "--temperature", "0", "--max_tokens", "3", "--ignore_eos", "--kv_cache_tokens", "256"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and len(done.stdout) > 1
    missing = subprocess.run(argv[:5] + ["tiny-org/absent"] + argv[6:], env=env, capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2
    assert "--model 'tiny-org/absent' is not a local path" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr


def test_train_param_path_hub_id(offline_cache, tmp_path):
    from astrai.config import load_config
    from astrai.train.build import build_model, build_tokenizer

    cfg = load_config(None, ["--param_path", REPO_ID, "--log_dir", str(tmp_path / "log")])
    tok = build_tokenizer(cfg)
    model = build_model(cfg)
    assert len(tok) == 300 and model.config.vocab_size == 320
    assert Path(cfg.train.param_path) == offline_cache  # the run (and its checkpoints) name the snapshot read
    bad = load_config(None, ["--param_path", "tiny-org/absent"])
    with pytest.raises(FileNotFoundError, match="param_path 'tiny-org/absent'.*HF_HUB_OFFLINE"):
        build_model(bad)


def test_llm_and_load_model_take_a_hub_id(offline_cache):
    from astrai import LLM, SamplingParams, load_model

    assert load_model(REPO_ID).config.vocab_size == 320
    out = LLM(REPO_ID, kv_cache_tokens=256).generate("Hi", SamplingParams(temperature=0, max_tokens=2,
                                                                          ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_serve_checks_resolve_a_hub_id(offline_cache):
    from astrai.serve.cli import _check_args, build_parser

    args = build_parser().parse_args(["--model", REPO_ID])
    assert _check_args(args) is None
    assert Path(args.model) == offline_cache and args.served_model_name == REPO_ID  # clients use the id
    bad: argparse.Namespace = build_parser().parse_args(["--model", "tiny-org/absent"])
    assert "--model 'tiny-org/absent'" in _check_args(bad)


def test_resume_with_a_hub_param_path_uses_ckpt_dir(offline_cache, tmp_path):
    from astrai.config import load_config
    from astrai.train.publish import CheckpointError
    from astrai.train.resume import resume_path

    cfg = load_config(None, ["--param_path", REPO_ID, "--resume", "--ckpt_dir", str(tmp_path / "ckpt")])
    with pytest.raises(CheckpointError, match="found no checkpoint in"):  # looked in ckpt_dir, not at the id
        resume_path(cfg)


def test_adapter_base_named_by_hub_id(offline_cache, tmp_path):
    import json

    from astrai.model.lora import resolve_base

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": REPO_ID, "target_modules": ["q_proj"], "r": 2,
         "lora_alpha": 4}))
    assert resolve_base(tmp_path) == offline_cache
