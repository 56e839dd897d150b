"""An external environment library trains through `astrai serve`: verifiers' training client,
run in its own venv (verifiers brings no torch and never shares astrai's), records prompt ids,
completion ids and log-probs for every rollout, the prompt ids being the chat template's.
0.3.1 reads them from chat completions (`logprobs` + `extra_body={"return_token_ids": true}`);
0.4.0 renders the prompt itself and calls `POST /inference/v1/generate` (tests/serve/verifiers_rollouts.py).

The venvs are made by `make verifiers` (from PyPI, into .cache/verifiers-<version>, once); a version
whose venv is absent is skipped, naming the command, and one that could not be installed (offline)
is skipped with pip's reason."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from astrai.data.tokenizer import load_tokenizer
from tests.serve.conftest import API_KEY

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("verifiers_rollouts.py")
RESULT = "VERIFIERS_ROLLOUTS "


def verifiers_python(version: str) -> Path:
    venv = REPO / ".cache" / f"verifiers-{version}"
    failed = venv.with_name(venv.name + ".failed")
    if failed.is_file():
        pytest.skip(f"verifiers {version} cannot be installed here: {failed.read_text().strip() or 'pip failed'}")
    if not (venv / ".installed").is_file():
        pytest.skip(f"no venv with verifiers {version} at {venv}: `make verifiers` installs it from PyPI (its own "
                    "venv; it brings no torch)")
    return venv / "bin" / "python"


@pytest.mark.slow
@pytest.mark.parametrize(("version", "client"), [("0.3.1", "openai_chat_completions_token"),
                                                 ("0.4.0", "train (renderer)")])
def test_verifiers_records_ids_and_logprobs_of_every_rollout(version, client, model_dir, request):
    python = verifiers_python(version)
    server = request.getfixturevalue("server")  # started only when a venv is there
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([str(python), str(SCRIPT), server.base_url, API_KEY, "tiny-model", str(model_dir)],
                       capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith(RESULT)]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len(RESULT):])
    assert out["version"] == version and out["client"] == client
    tok = load_tokenizer(model_dir)
    assert len(out["rollouts"]) == 4  # 2 prompts x 2 rollouts
    for rollout in out["rollouts"]:
        assert rollout["error"] is None
        assert rollout["prompt_ids"] == tok.apply_chat_template(rollout["messages"], add_generation_prompt=True)
        ids, logprobs = rollout["completion_ids"], rollout["completion_logprobs"]
        assert 0 < len(ids) == len(logprobs) <= 6 and all(lp <= 0 for lp in logprobs)
