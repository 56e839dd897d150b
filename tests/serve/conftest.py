"""Shared fixtures for the server tests: a tiny random model directory and a live server.

The model directory is what `astrai serve` reads in production (config.json, safetensors,
tokenizer files), built from a random 2-layer model and a byte-level BPE trained on a few
sentences. `ServerProcess` runs `astrai serve` in a subprocess on a free loopback port, so the
tests talk to a real uvicorn server over TCP with the official `openai` client.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
MAX_REQUEST_BYTES = 64 * 1024
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a language model predicts the next token from the previous ones",
    "hello world, this is a tiny tokenizer for tests",
    "numbers like 12345 and 67890 and symbols like !?., are here too",
] * 20


def make_model_dir(path: Path) -> Path:
    """A random 2-layer model with a tokenizer trained on TEXTS, saved as a model directory."""
    from astrai.data.tokenizer_training import train_tokenizer
    from astrai.model.config import ModelConfig
    from astrai.model.hf import save_model
    from astrai.model.transformer import CausalLM

    tok = train_tokenizer(TEXTS, vocab_size=384, out_dir=None)
    config = ModelConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    save_model(CausalLM(config, seed=0), path, tokenizer=tok)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`astrai serve` in a subprocess; `start()` waits until /health answers 200."""

    def __init__(self, model_dir: Path, *extra: str, api_key: str | None = API_KEY):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = ["--model", str(model_dir), "--port", str(self.port), "--max_model_len", str(MAX_MODEL_LEN),
                "--max_request_bytes", str(MAX_REQUEST_BYTES), "--kv_cache_tokens", "16384",
                "--log_level", "warning", *extra]
        if api_key:
            args += ["--api_key", api_key]
        code = f"import sys; from astrai.serve.cli import main; sys.exit(main({args!r}))"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        env.pop("ASTRAI_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def start(self, timeout: float = 60.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("serve") / "tiny-model")


@pytest.fixture(scope="session")
def server(model_dir: Path):
    proc = ServerProcess(model_dir).start()
    yield proc
    proc.stop()


@pytest.fixture()
def client(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c
