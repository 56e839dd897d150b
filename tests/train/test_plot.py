"""`astrai plot LOG_DIR` writes PNG curves, validation overlaid; errors are clear."""

from __future__ import annotations

import json

from astrai.train.plot import main, read_metrics


def test_plot_writes_pngs(tmp_path, capsys):
    rows = [{"split": "train", "step": s, "epoch": 0, "lr": 1e-3, "loss": 3.0 / s, "grad_norm": 1.0,
             "tokens_per_s": 100.0, "rewards/accuracies": 0.5} for s in range(1, 6)]
    rows.append({"split": "val", "step": 5, "epoch": 0, "val/loss": 0.9})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    assert val == {"loss": [(5, 0.9)]} and len(train["loss"]) == 5
    assert main([str(tmp_path), "--out", str(tmp_path / "plots")]) == 0
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"loss.png", "lr.png", "grad_norm.png", "rewards_accuracies.png", "curves.png"} <= names
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_missing_log(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
