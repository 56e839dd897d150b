"""An external environment library trains through `astrai serve`: an environment of verifiers, run
with its training client in a venv of its own (verifiers brings no torch and never shares astrai's),
records prompt ids, completion ids and log-probs for every model call of every rollout (two prompts,
two rollouts each, two turns each; tests/serve/verifiers_rollouts.py runs them). 0.3.1 (a
`MultiTurnEnv`): a first turn is a chat completion (`logprobs` + `extra_body={"return_token_ids":
true}`), its prompt ids the chat template's; the second turn's ids are stitched by the client (the
first turn's ids as sampled, then the template's for the follow-up) and posted to
`/v1/chat/completions/tokens`, which the server counts. 0.4.0 (a `SingleAgentEnv` whose harness talks
through verifiers' interception server): every turn is rendered by its `TrainClient` with the chat
template and sent to `POST /inference/v1/generate`.

The test installs each release itself, from PyPI, into .cache/verifiers-<version> (kept and reused):
with `uv` (a dev dependency: a venv and the install in about 2 s once uv's own cache holds the
wheels), or `python -m venv` + pip where uv is absent. The venv is built beside its final place and
renamed into it once complete, so a killed run leaves no half venv to be reused. A release that
cannot be installed (offline) is skipped with the installer's one-line reason."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from astrai.data.tokenizer import load_tokenizer
from tests.serve.conftest import API_KEY
from tests.serve.verifiers_rollouts import FOLLOW_UP, MAX_TOKENS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("verifiers_rollouts.py")
RESULT = "VERIFIERS_ROLLOUTS "
INSTALL_TIMEOUT_S = 420  # a cold install downloads a few hundred MB of wheels
COMPLETE = ".installed"  # written last inside the venv, before the rename


def uv_binary() -> str | None:
    """The `uv` the dev dependencies installed (beside this Python), else one on PATH."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


def install_commands(venv: Path, version: str) -> list[list[str]]:
    """uv when present (it never downloads a Python: the venv is this interpreter's), else venv + pip."""
    requirement = f"verifiers=={version}"
    uv = uv_binary()
    if uv is not None:
        return [[uv, "venv", "--quiet", "--relocatable", "--python", sys.executable, str(venv)],
                [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), requirement]]
    # pip's console scripts name the build path in their shebangs; the test runs `bin/python` only
    return [[sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             requirement]]


def one_line(output: str) -> str:
    """An installer's failure in one line: its first error line and its last cause (uv prints the
    error, then a `cause:` per level; pip a line per retry, then two ERROR lines)."""
    lines = [line.strip() for line in output.splitlines() if line.strip() and not line.startswith("WARNING")]
    if not lines:
        return "no output"
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def remove_abandoned(cache: Path, version: str) -> None:
    """Partial venvs of runs that were killed (their pid is gone), ~300 MB each."""
    for partial in cache.glob(f".verifiers-{version}.partial-*"):
        pid = int(partial.name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(partial, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def verifiers_python(version: str) -> Path:
    """The Python of a complete venv with verifiers `version`, installed on first use; skips with the
    installer's reason when it cannot be installed here."""
    cache = REPO / ".cache"
    venv = cache / f"verifiers-{version}"
    if (venv / COMPLETE).is_file():
        return venv / "bin" / "python"
    cache.mkdir(exist_ok=True)
    remove_abandoned(cache, version)
    partial = cache / f".verifiers-{version}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    try:
        for command in install_commands(partial, version):
            r = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env)
            if r.returncode != 0:
                pytest.skip(f"verifiers {version} cannot be installed here ({Path(command[0]).name} "
                            f"{' '.join(command[1:3])}): {one_line(r.stderr + r.stdout)}")
        (partial / COMPLETE).touch()
        if venv.exists():  # a half venv from before the rename scheme, or another run's finished one
            if (venv / COMPLETE).is_file():
                return venv / "bin" / "python"
            shutil.rmtree(venv)
        try:
            partial.rename(venv)
        except OSError:  # another run renamed its complete venv there first
            if not (venv / COMPLETE).is_file():
                raise
    except subprocess.TimeoutExpired as exc:
        pytest.skip(f"verifiers {version} cannot be installed here: {Path(exc.cmd[0]).name} took over "
                    f"{INSTALL_TIMEOUT_S} s")
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return venv / "bin" / "python"


def count_requests(server, route: str) -> int:
    """The server's count of 200 answers on `route` (its prometheus counter)."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found = re.search(rf'astrai_http_requests_total{{route="{re.escape(route)}",status="200"}} (\S+)', text)
    return int(float(found.group(1))) if found else 0


@pytest.mark.slow
@pytest.mark.parametrize(("version", "client", "env"), [("0.3.1", "openai_chat_completions_token", "MultiTurnEnv"),
                                                        ("0.4.0", "train (renderer)", "SingleAgentEnv")])
def test_verifiers_records_ids_and_logprobs_of_every_rollout(version, client, env, model_dir, request):
    python = verifiers_python(version)
    server = request.getfixturevalue("server")  # started only once the venv is there
    stitched_before = count_requests(server, "/v1/chat/completions/tokens")
    environ = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([str(python), str(SCRIPT), server.base_url, API_KEY, "tiny-model", str(model_dir)],
                       capture_output=True, text=True, timeout=300, env=environ)
    lines = [line for line in r.stdout.splitlines() if line.startswith(RESULT)]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len(RESULT):])
    assert (out["version"], out["client"], out["env"]) == (version, client, env)
    tok = load_tokenizer(model_dir)
    rollouts = out["rollouts"]
    assert [rollout["turn"] for rollout in rollouts] == [0, 1] * 4  # 2 prompts x 2 rollouts x 2 turns, one record per call
    for previous, rollout in zip([None, *rollouts], rollouts):
        assert rollout["error"] is None
        ids, logprobs = rollout["completion_ids"], rollout["completion_logprobs"]
        assert 0 < len(ids) == len(logprobs) <= MAX_TOKENS and all(lp <= 0 for lp in logprobs)
        assert rollout["reward"] in (0.0, 1.0)  # the environment scored the rollout
        assert [m["content"] for m in rollout["messages"][2:]] == [FOLLOW_UP] * rollout["turn"]
        if version == "0.3.1" and rollout["turn"] == 1:
            # stitched by the client: the first turn's ids as sampled, then what the template adds for
            # the follow-up (ids from /tokenize), posted to /v1/chat/completions/tokens
            head = previous["prompt_ids"] + previous["completion_ids"]
            assert rollout["prompt_ids"][:len(head)] == head
            assert FOLLOW_UP in tok.decode(rollout["prompt_ids"][len(head):])
        else:  # rendered from the messages: the chat template's ids
            assert rollout["prompt_ids"] == tok.apply_chat_template(rollout["messages"], add_generation_prompt=True)
    stitched = count_requests(server, "/v1/chat/completions/tokens") - stitched_before
    assert stitched == (4 if version == "0.3.1" else 0)
