"""``astrai plot LOG_DIR``: PNG curves from ``LOG_DIR/metrics.jsonl`` (matplotlib, Agg backend).

The end of the training data flow for humans: the metrics log written by the trainer's
MetricsLogger becomes one PNG per metric (loss, lr, grad_norm, tokens_per_s and every objective
metric), one PNG per metric group (``group_loss.png``, ``group_lr.png``, ``group_grad_norm.png``,
``group_throughput.png``, ``group_reward.png``, ``group_length.png``, ``group_time.png``
(``time_*`` and ``*_seconds``: where the steps' time went), ``group_eval.png`` (the
``eval/`` rows of evaluation during training), and for online RL
``group_policy.png``, ``group_sampler.png``, ``group_rollout.png``; ``group_other.png``: the
group's metrics side by side) and ``curves.png`` with all of them on one page, into
``LOG_DIR/plots`` unless ``--out`` says otherwise. Noisy training curves are smoothed by an
exponential moving average (``--smooth``, TensorBoard's debiased form) with the raw curve drawn
faint behind; schedules and counters (``lr``, ``policy_version``, ...) and ``eval/`` points are
drawn raw; a validation metric is drawn raw over its training counterpart (``val/loss`` on the
``loss`` plot). Gradient norms use a log y-scale. A metric whose value never changed gets no panel:
``constants.txt`` lists each with its value.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

from astrai.flags import ArgumentParser

SKIP = {"step", "epoch", "split", "num_loss_units"}
DEFAULT_SMOOTH = 0.6

# metric groups, first match wins; each becomes group_<name>.png
GROUPS: dict[str, Callable[[str], bool]] = {
    # evaluation during training (eval_interval): held-out accuracy, reward, length, seconds
    "eval": lambda m: m.startswith("eval/"),
    "loss": lambda m: "loss" in m,
    "lr": lambda m: m == "lr" or m.endswith("_lr"),
    "grad_norm": lambda m: "grad_norm" in m,
    "throughput": lambda m: m.endswith("_per_s"),
    "reward": lambda m: m.startswith("reward") or m.startswith("rewards/"),
    "length": lambda m: "length" in m,
    # online RL: how much the update is clipped and how spread the policy is
    "policy": lambda m: m.startswith("clip_fraction") or m in ("entropy", "kl"),
    # online RL: the sampler-trainer agreement and the importance weights that correct it
    "sampler": lambda m: m.startswith(("sampler_", "is_weight")),
    # online RL: whether a rollout can teach anything (cut-off completions, groups without signal)
    "rollout": lambda m: m in ("truncated_fraction", "frac_reward_zero_std", "skipped_prompts", "skipped_groups"),
    # where each step's seconds went (train/timing.py)
    "time": lambda m: m.startswith("time_") or m.endswith("_seconds"),
    "other": lambda m: True,
}
LOG_SCALE_GROUPS = {"grad_norm"}
# schedules and counters: exact values with nothing to average away, drawn raw
RAW = {"lr", "policy_version", "rollout_policy_version", "tokens_seen", "nonfinite_steps", "skipped_prompts"}


def drawn_raw(metric: str) -> bool:
    return metric in RAW or metric.endswith("_lr") or metric.startswith("eval/")

Series = list[tuple[int, float]]


def read_metrics(path: Path) -> tuple[dict[str, Series], dict[str, Series]]:
    """(train, val) series: metric name -> [(step, value)]; val names without the 'val/' prefix."""
    train: dict[str, Series] = {}
    val: dict[str, Series] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n} is not a JSON line; is this a metrics.jsonl written by astrai train?") from None
        target = val if row.get("split") == "val" else train
        for key, value in row.items():
            if key in SKIP or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            name = key.removeprefix("val/") if target is val else key
            target.setdefault(name, []).append((int(row.get("step", 0)), float(value)))
    return train, val


def ema(values: list[float], smooth: float) -> list[float]:
    """Debiased exponential moving average, as TensorBoard draws it:
    s_t = smooth * s_{t-1} + (1 - smooth) * x_t (s_0 = 0), shown as s_t / (1 - smooth^t).
    ``smooth`` 0 returns the values; a non-finite value is shown as it is and does not enter the average."""
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth={smooth} must be within [0, 1); 0 draws the raw curve, 0.6 is TensorBoard's default")
    out, acc, n = [], 0.0, 0
    for x in values:
        if not math.isfinite(x):
            out.append(x)
            continue
        acc, n = smooth * acc + (1.0 - smooth) * x, n + 1
        out.append(acc / (1.0 - smooth**n))
    return out


def group_of(metric: str) -> str:
    return next(name for name, match in GROUPS.items() if match(metric))


def _file_name(metric: str) -> str:
    return metric.replace("/", "_") + ".png"


def _draw(ax, metric: str, train: Series | None, val: Series | None, smooth: float, log_y: bool) -> None:
    if train:
        steps, values = zip(*train)
        if smooth > 0:
            line, = ax.plot(steps, values, linewidth=1.0, alpha=0.25)  # raw, faint
            ax.plot(steps, ema(list(values), smooth), color=line.get_color(), label="train", linewidth=1.4)
        elif metric.startswith("eval/"):
            ax.plot(steps, values, label="eval", marker="o", markersize=3, linewidth=1.2)
        else:
            ax.plot(steps, values, label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), label="val", marker="o", markersize=3, linewidth=1.2)
    positive = all(v > 0 for _, v in (train or []) + (val or []) if math.isfinite(v))
    if log_y and positive:
        ax.set_yscale("log")
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if train and val:
        ax.legend()


def _page(plt, metrics: list[str], train: dict[str, Series], val: dict[str, Series], smooth: float, path: Path):
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    width, height = 5 * cols, 3.5 * rows
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False)
    # fixed margins in inches (room for tick labels, a title, the step label): `tight_layout`
    # measures every text's extent, and took 40% of the time of a run's 60 plots
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.35 / height,
                        wspace=0.3, hspace=0.45)
    for ax, metric in zip(axes.flat, metrics):
        # eval/ points are few and each is an exact measurement; schedules and counters are not noisy
        _draw(ax, metric, train.get(metric), val.get(metric), 0.0 if drawn_raw(metric) else smooth,
              group_of(metric) in LOG_SCALE_GROUPS)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def constant_metrics(train: dict[str, Series], val: dict[str, Series]) -> dict[str, float]:
    """Metrics logged at two or more points (train and val together) whose every value is the
    same: name -> value."""
    out = {}
    for metric in set(train) | set(val):
        points = train.get(metric, []) + val.get(metric, [])
        values = {v for _, v in points}
        if len(points) > 1 and len(values) == 1 and math.isfinite(value := next(iter(values))):
            out[metric] = value
    return out


def plot_log_dir(log_dir: str | Path, out_dir: str | Path | None = None, smooth: float = DEFAULT_SMOOTH) -> list[Path]:
    """Write the PNGs; returns their paths. Raises FileNotFoundError when there is no log."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    ema([], smooth)  # checks the factor before any file is written
    log_dir = Path(log_dir)
    path = log_dir / "metrics.jsonl" if log_dir.is_dir() else log_dir
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(log_dir)!r}; pass the log_dir of a training run")
    train, val = read_metrics(path)
    if not train and not val:
        raise ValueError(f"{path} holds no metrics yet")
    out = Path(out_dir) if out_dir is not None else path.parent / "plots"
    out.mkdir(parents=True, exist_ok=True)
    constant = constant_metrics(train, val)
    first = [m for m in ("loss", "lr", "grad_norm", "tokens_per_s") if (m in train or m in val) and m not in constant]
    metrics = first + sorted((set(train) | set(val)) - set(first) - set(constant))
    written = []
    if constant:
        (out / "constants.txt").write_text("".join(f"{m} = {v:g}\n" for m, v in sorted(constant.items())))
        written.append(out / "constants.txt")
    if not metrics:
        return written
    for metric in metrics:
        _page(plt, [metric], train, val, smooth, out / _file_name(metric))
        written.append(out / _file_name(metric))
    for group in GROUPS:
        members = [m for m in metrics if group_of(m) == group]
        if members:
            _page(plt, members, train, val, smooth, out / f"group_{group}.png")
            written.append(out / f"group_{group}.png")
    _page(plt, metrics, train, val, smooth, out / "curves.png")
    written.append(out / "curves.png")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai plot", description="PNG curves from LOG_DIR/metrics.jsonl")
    parser.add_argument("log_dir", help="a training run's log_dir (or a metrics.jsonl file)")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: LOG_DIR/plots)")
    parser.add_argument("--smooth", type=float, default=DEFAULT_SMOOTH,
                        help=f"EMA factor in [0, 1) for training curves, raw curve drawn faint; 0 = raw only "
                             f"(default {DEFAULT_SMOOTH})")
    args = parser.parse_args(argv)
    try:
        written = plot_log_dir(args.log_dir, args.out, args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"astrai plot: error: {e}", file=sys.stderr)
        return 1
    pngs = [p for p in written if p.suffix == ".png"]
    line = f"wrote {len(pngs)} plots to {written[0].parent}"
    for p in written:
        if p.name == "constants.txt":
            line += f"; {len(p.read_text().splitlines())} constant metrics listed in {p.name}, not drawn"
    print(line)
    return 0
