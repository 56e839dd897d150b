"""The quickstart at its default budget: every stage runs and SFT clearly beats pre-training.

The default budget is used because shorter ones sit near the point where the model starts to
add with carries, so their accuracy after SFT varies from run to run."""

from __future__ import annotations

import json

import pytest

from astrai.demo import main as demo_main


@pytest.mark.slow
def test_short_demo_improves_accuracy_and_reuses_stages(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo_main(["--out", str(out)]) == 0
    evals = json.loads((out / "eval" / "stage.json").read_text())
    before, after = evals["pretrained"]["accuracy"], evals["sft"]["accuracy"]
    assert after >= before + 0.05, f"SFT accuracy {after:.1%} is not clearly above pre-training {before:.1%}"
    report = (out / "report.md").read_text()
    assert f"{after:.1%}" in report and f"{before:.1%}" in report
    for name in ("pretrain", "sft"):
        assert (out / name / "final" / "model.safetensors").exists()
        assert any((out / name / "plots").glob("*.png"))
    assert "astrai serve --model" in capsys.readouterr().out
    # a second run finds every stage finished and only rewrites the report
    assert demo_main(["--out", str(out)]) == 0
    assert "reusing the finished stage" in capsys.readouterr().out
