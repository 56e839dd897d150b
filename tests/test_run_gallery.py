"""benchmarks/run_gallery.py without training: each broken run changes only its own fields of the
demo's resolved config, writes where it is told, and the picture is drawn from metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "run_gallery.py"


@pytest.fixture(scope="module")
def gallery():
    spec = importlib.util.spec_from_file_location("run_gallery", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_dir(tmp_path: Path) -> Path:
    stage = tmp_path / "demo" / "rl-grpo"
    stage.mkdir(parents=True)
    config = {"train": {"max_steps": 300, "random_seed": 0}, "optim": {"max_lr": 5e-4},
              "rl": {"rollout_interval": 2, "rollout_temperature": 1.0, "rollout_max_tokens": 8},
              "ckpt": {"ckpt_dir": "x", "ckpt_interval": 0}, "log": {"log_dir": "x", "progress": True}}
    (stage / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp_path / "demo"


def test_each_run_changes_only_its_fields(gallery, tmp_path):
    demo = demo_dir(tmp_path)
    base = gallery.run_config(demo, tmp_path / "g", "healthy", 40)
    assert base["train"] == {"max_steps": 40, "random_seed": 0} and base["log"]["log_dir"] == str(tmp_path / "g" / "healthy")
    for name, (_, changes) in gallery.RUNS.items():
        config = gallery.run_config(demo, tmp_path / "g", name, 40)
        changed = {(s, k) for s in config for k in config[s] if config[s][k] != base[s].get(k)}
        assert changed == {(s, k) for s, fields in changes.items() for k in fields} | (
            {("ckpt", "ckpt_dir"), ("log", "log_dir")} if name != "healthy" else set())


def test_the_picture_is_drawn_from_the_runs_metrics(gallery, tmp_path, capsys):
    out = tmp_path / "g"
    for name in ("healthy", "flat"):
        (out / name).mkdir(parents=True)
        rows = [{"split": "train", "step": s, **{m: s / 10 for m in gallery.METRICS}} for s in range(1, 21)]
        (out / name / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows + [{"split": "eval", "step": 20}])))
    figure = tmp_path / "fig.png"
    assert gallery.main(["--demo", str(demo_dir(tmp_path)), "--out", str(out), "--runs", "healthy", "flat",
                         "--draw_only", "--figure", str(figure)]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "healthy: reward_mean 0.550 -> 1.550" in capsys.readouterr().out


def test_a_missing_demo_is_one_line(gallery, tmp_path, capsys):
    with pytest.raises(SystemExit):
        gallery.main(["--demo", str(tmp_path / "none")])
    assert "run `astrai demo --out" in capsys.readouterr().err
