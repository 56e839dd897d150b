"""`astrai plot LOG_DIR` writes PNG curves, validation overlaid; errors are clear."""

from __future__ import annotations

import json
import math

import pytest

from astrai.train.plot import main, read_metrics


def test_plot_writes_pngs(tmp_path, capsys):
    rows = [{"split": "train", "step": s, "epoch": 0, "lr": 1e-3, "loss": 3.0 / s, "grad_norm": 1.0,
             "tokens_per_s": 100.0, "rewards/accuracies": 0.5} for s in range(1, 6)]
    rows.append({"split": "val", "step": 5, "epoch": 0, "val/loss": 0.9})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, val = read_metrics(tmp_path / "metrics.jsonl")
    assert val == {"loss": [(5, 0.9)]} and len(train["loss"]) == 5
    assert main([str(tmp_path)]) == 0  # into LOG_DIR/plots by default
    names = {p.name for p in (tmp_path / "plots").iterdir()}
    assert {"loss.png", "curves.png"} <= names
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the metrics that never changed get no panel: one line each in constants.txt
    assert not names & {"lr.png", "grad_norm.png", "tokens_per_s.png", "rewards_accuracies.png"}
    assert (tmp_path / "plots" / "constants.txt").read_text() == (
        "grad_norm = 1\nlr = 0.001\nrewards/accuracies = 0.5\ntokens_per_s = 100\n")
    assert "wrote 3 plots to" in capsys.readouterr().out  # loss.png, group_loss.png, curves.png


def test_schedules_and_counters_are_drawn_raw():
    from astrai.train.plot import drawn_raw

    assert [m for m in ("lr", "critic_lr", "policy_version", "eval/accuracy", "loss", "reward_mean") if drawn_raw(m)] == [
        "lr", "critic_lr", "policy_version", "eval/accuracy"]


def test_plot_missing_log(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_ema_is_tensorboards_debiased_average():
    from astrai.train.plot import ema

    # s1 = 0.5 -> 0.5 / 0.5 = 1; s2 = 0.25 + 1 = 1.25 -> 1.25 / 0.75; s3 = 0.625 + 1.5 = 2.125 -> / 0.875
    assert ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert ema([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])  # debiased: no pull towards 0
    assert ema([1.0, 5.0], 0.0) == [1.0, 5.0]
    out = ema([2.0, float("nan"), 4.0], 0.5)  # a skipped (NaN) step stays visible and is not averaged in
    assert out[0] == 2.0 and math.isnan(out[1]) and out[2] == pytest.approx((0.5 + 2.0) / 0.75)
    with pytest.raises(ValueError, match=r"smooth=1.0 must be within \[0, 1\)"):
        ema([1.0], 1.0)


def test_metric_groups_and_log_scale(tmp_path):
    from astrai.train.plot import group_of, plot_log_dir

    assert [group_of(m) for m in ("loss", "policy_loss", "lr", "critic_lr", "grad_norm", "tokens_per_s",
                                  "reward_mean", "rewards/accuracies", "response_length_mean", "approx_kl")] == \
        ["loss", "loss", "lr", "lr", "grad_norm", "throughput", "reward", "reward", "length", "other"]
    rows = [{"split": "train", "step": s, "lr": 1e-3 * s, "loss": 3.0 / s, "grad_norm": 10.0 ** -s,
             "tokens_per_s": 9.0 + s, "reward_mean": s / 10, "response_length_mean": 5.0 + s, "approx_kl": 0.01 * s}
            for s in range(1, 9)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = {p.name for p in plot_log_dir(tmp_path, tmp_path / "plots", smooth=0.8)}
    groups = {f"group_{g}.png" for g in ("loss", "lr", "grad_norm", "throughput", "reward", "length", "other")}
    assert groups <= written and "reward_mean.png" in written and "curves.png" in written
    assert all((tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG" for name in written)


def test_plot_draws_smoothed_over_faint_raw_on_a_log_scale(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from astrai.train import plot

    axes = []
    real = plot._draw

    def spy(ax, metric, *args):
        real(ax, metric, *args)
        axes.append((metric, ax))

    close = plt.close
    monkeypatch.setattr(plot, "_draw", spy)
    monkeypatch.setattr(plt, "close", lambda fig: None)  # keep the figures to inspect them
    rows = [{"split": "train", "step": s, "loss": float(s), "grad_norm": 2.0 ** s} for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot.plot_log_dir(tmp_path, smooth=0.5)
    loss_ax = next(ax for metric, ax in axes if metric == "loss")
    raw, smooth = loss_ax.get_lines()
    assert raw.get_alpha() == 0.25 and list(raw.get_ydata()) == [1.0, 2.0, 3.0, 4.0]
    assert list(smooth.get_ydata()) == pytest.approx(plot.ema([1.0, 2.0, 3.0, 4.0], 0.5))
    assert next(ax for metric, ax in axes if metric == "grad_norm").get_yscale() == "log"
    assert loss_ax.get_yscale() == "linear"
    close("all")


def test_plot_rejects_a_bad_smooth_factor(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"split": "train", "step": 1, "loss": 1.0}) + "\n")
    assert main([str(tmp_path), "--smooth", "1.5"]) == 1
    assert "smooth=1.5 must be within [0, 1)" in capsys.readouterr().err


def test_online_rl_debugging_metrics_are_grouped():
    from astrai.train.plot import group_of

    assert {m: group_of(m) for m in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "entropy", "kl",
                                     "sampler_logp_diff", "is_weight_mean", "is_weight_capped_fraction",
                                     "truncated_fraction", "frac_reward_zero_std")} == {
        "clip_fraction": "policy", "clip_fraction_low": "policy", "clip_fraction_high": "policy",
        "entropy": "policy", "kl": "policy", "sampler_logp_diff": "sampler", "is_weight_mean": "sampler",
        "is_weight_capped_fraction": "sampler", "truncated_fraction": "rollout", "frac_reward_zero_std": "rollout"}


def test_eval_rows_get_their_own_group_drawn_raw(tmp_path):
    from astrai.train.plot import group_of, plot_log_dir

    rows = [{"split": "train", "step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s} for s in range(1, 5)]
    rows += [{"split": "eval", "step": s, "epoch": 0, "eval/accuracy": 0.2 * s, "eval/response_length": 4.0}
             for s in (0, 2, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert group_of("eval/response_length") == "eval" and group_of("eval/reward_mean") == "eval"
    written = {p.name for p in plot_log_dir(tmp_path)}
    assert {"group_eval.png", "eval_accuracy.png", "group_reward.png"} <= written
