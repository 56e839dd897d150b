"""``astrai plot LOG_DIR``: PNG curves from ``LOG_DIR/metrics.jsonl`` (matplotlib, Agg backend).

The end of the training data flow for humans: the metrics log written by the trainer's
MetricsLogger becomes one PNG per metric (loss, lr, grad_norm, tokens_per_s and every objective
metric) plus ``curves.png`` with all of them on one page. A validation metric is drawn over its
training counterpart (``val/loss`` on the ``loss`` plot).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from astrai.flags import ArgumentParser

SKIP = {"step", "epoch", "split", "num_loss_units"}


def read_metrics(path: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, float]]]]:
    """(train, val) series: metric name -> [(step, value)]; val names without the 'val/' prefix."""
    train: dict[str, list[tuple[int, float]]] = {}
    val: dict[str, list[tuple[int, float]]] = {}
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


def _file_name(metric: str) -> str:
    return metric.replace("/", "_") + ".png"


def _draw(ax, metric: str, train: list[tuple[int, float]] | None, val: list[tuple[int, float]] | None) -> None:
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1.2)
    if val:
        ax.plot(*zip(*val), label="val", marker="o", markersize=3, linewidth=1.2)
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if train and val:
        ax.legend()


def plot_log_dir(log_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the PNGs; returns their paths. Raises FileNotFoundError when there is no log."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    log_dir = Path(log_dir)
    path = log_dir / "metrics.jsonl" if log_dir.is_dir() else log_dir
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(log_dir)!r}; pass the log_dir of a training run")
    train, val = read_metrics(path)
    if not train and not val:
        raise ValueError(f"{path} holds no metrics yet")
    out = Path(out_dir) if out_dir is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    first = [m for m in ("loss", "lr", "grad_norm", "tokens_per_s") if m in train or m in val]
    metrics = first + sorted((set(train) | set(val)) - set(first))
    written = []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, metric, train.get(metric), val.get(metric))
        fig.tight_layout()
        fig.savefig(out / _file_name(metric), dpi=100)
        plt.close(fig)
        written.append(out / _file_name(metric))
    cols = min(3, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        _draw(ax, metric, train.get(metric), val.get(metric))
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)
    written.append(out / "curves.png")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai plot", description="PNG curves from LOG_DIR/metrics.jsonl")
    parser.add_argument("log_dir", help="a training run's log_dir (or a metrics.jsonl file)")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: LOG_DIR)")
    args = parser.parse_args(argv)
    try:
        written = plot_log_dir(args.log_dir, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"astrai plot: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {len(written)} plots to {written[-1].parent}")
    return 0
