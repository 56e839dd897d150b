"""docs/tutorial-real-model.md, run as written: every `bash` and `python` block, in order, as one
shell script in a scratch folder that sees the converted SmolLM2-135M-Instruct (`make
real-model`). Slow and opt-in: skips when .cache/smollm2 has not been made. `sh` blocks are the
setup the skip condition stands for (`make real-model`) and are not run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial-real-model.md"
MODEL_DIR = ROOT / ".cache" / "smollm2"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def tutorial_script(text: str) -> str:
    """The tutorial's bash and python blocks as one bash script (python blocks as heredocs)."""
    parts = ["set -euo pipefail"]
    for lang, body in FENCE.findall(text):
        if lang == "bash":
            parts.append(body)
        elif lang == "python":
            parts.append(f"python - <<'PYTHON_BLOCK'\n{body}PYTHON_BLOCK\n")
    return "\n".join(parts)


def stated_accuracy(text: str) -> tuple[float, float]:
    """The 'held-out accuracy: B% -> A%' figures the tutorial states."""
    m = re.search(r"held-out accuracy: ([\d.]+)% -> ([\d.]+)%", text)
    assert m, "the tutorial no longer states its measured held-out accuracy"
    return float(m.group(1)) / 100, float(m.group(2)) / 100


def test_tutorial_states_a_measured_gain():
    before, after = stated_accuracy(TUTORIAL.read_text())
    assert 0 <= before < after <= 1
    # the README quotes the tutorial's figures, which the slow test below measures
    assert f"{before:.1%} -> {after:.1%}" in (ROOT / "README.md").read_text().replace("\n", " ")


def test_tutorial_script_keeps_every_runnable_block():
    text = "x\n```bash\necho a\n```\n```python\nprint(1)\n```\n```sh\nmake real-model\n```\n"
    script = tutorial_script(text)
    assert "echo a" in script and "print(1)" in script and "make real-model" not in script
    blocks = FENCE.findall(TUTORIAL.read_text())
    assert {lang for lang, _ in blocks} == {"bash", "python", "sh"}, "a block the test would not run"
    assert sum(lang in ("bash", "python") for lang, _ in blocks) >= 6


@pytest.mark.slow
@pytest.mark.timeout(3600)  # serving, two evals and 20 GRPO steps of a 135M model on a CPU
@pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(),
                    reason=f"{MODEL_DIR} not found; run `make real-model` to create it")
def test_tutorial_runs_as_written(tmp_path):
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "smollm2").symlink_to(MODEL_DIR)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(["bash", "-c", tutorial_script(TUTORIAL.read_text())], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"the tutorial failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    out = tmp_path / "out" / "tutorial"
    before, after = (json.loads((out / f"{n}.json").read_text()) for n in ("before", "after"))
    assert before["num_total"] == after["num_total"] == 40
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == list(range(1, 21))
    assert "held-out accuracy:" in proc.stdout
    # the figures the page states are the ones this run measures (greedy, seeded rollouts)
    stated_before, stated_after = stated_accuracy(TUTORIAL.read_text())
    assert abs(before["accuracy"] - stated_before) <= 0.05, (before["accuracy"], stated_before)
    assert abs(after["accuracy"] - stated_after) <= 0.10, (after["accuracy"], stated_after)
    assert after["accuracy"] >= before["accuracy"] + 0.15, "GRPO no longer raises held-out accuracy clearly"
    assert any((out / "grpo" / "plots").glob("*.png"))
    print(proc.stdout)
