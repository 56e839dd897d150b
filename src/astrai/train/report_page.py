"""``astrai report LOG_DIR``: one self-contained HTML page of a run, ``LOG_DIR/report.html``.

The end of the training data flow for a person with a browser, beside ``astrai plot``'s PNGs: it
reads what a run leaves in its log_dir (``metrics.jsonl``, ``traces.jsonl``, the resolved
``config.yaml`` the metrics log writes at the start, and through it the checkpoints of
``ckpt_dir``) and writes one file with no network access and no server: the run summary (steps,
last loss and reward, eval accuracy, where the time went: ``time_*`` shares), the curves (inline
SVG, one panel per metric grouped as ``astrai plot`` groups them, EMA-smoothed over the faint raw
curve, validation and eval points raw), the trace samples as a table that a few lines of inline
script filter by split, step and reward, each row opening its conversation (``<details>``, so
that works without script too), the resolved config and the checkpoints with their verification
state (sizes, or checksums with ``--verify``). Every train type gets the page; a run without
traces shows no table. ``ReportPage`` (``report_html: true``) refreshes it after each checkpoint
and at the end of the run.
"""

from __future__ import annotations

import html
import json
import math
import sys
from pathlib import Path
from typing import Any

from astrai.flags import ArgumentParser
from astrai.train.plot import DEFAULT_SMOOTH, GROUPS, constant_metrics, drawn_raw, ema, group_of, read_metrics
from astrai.train.timing import format_time_shares, time_shares
from astrai.train.traces import read_traces, table_row
from astrai.train.traces_cli import format_trace

REPORT_FILE = "report.html"
CONFIG_FILE = "config.yaml"
MAX_TRACES = 2000  # the newest trace lines shown; the file keeps them all
W, H, PAD = 340, 190, 34  # a curve panel's size and margin, in pixels
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:14px 0 4px}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4}.panels{display:flex;flex-wrap:wrap;gap:8px}
svg{background:#fff;border:1px solid #e4e4e4}.raw{stroke-opacity:.25}
pre{white-space:pre-wrap;max-width:1000px;margin:4px 0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.controls{margin:8px 0}.controls label{margin-right:14px}.bad{color:#b00}.ok{color:#070}
"""

SCRIPT = """
function filterTraces(){
  const split=document.getElementById('f-split').value, step=document.getElementById('f-step').value;
  const lo=parseFloat(document.getElementById('f-min').value), hi=parseFloat(document.getElementById('f-max').value);
  let shown=0;
  for(const row of document.querySelectorAll('tr.trace')){
    const r=parseFloat(row.dataset.reward);
    const ok=(split==='all'||row.dataset.split===split)&&(step==='all'||row.dataset.step===step)
      &&(isNaN(lo)||r>=lo)&&(isNaN(hi)||r<=hi);
    row.style.display=ok?'':'none'; shown+=ok;
  }
  document.getElementById('f-count').textContent=shown+' shown';
}
document.addEventListener('DOMContentLoaded',filterTraces);
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return "" if v is None else str(v)


# ------------------------------------------------------------------------------ curves


def _ticks(lo: float, hi: float) -> list[float]:
    return [lo, (lo + hi) / 2, hi] if hi > lo else [lo]


def svg_panel(name: str, series: dict[str, list[tuple[int, float]]], smooth: float) -> str:
    """One metric as an inline SVG: each series a polyline (training: EMA over the faint raw
    curve unless drawn raw), val / eval points as dots."""
    points = [(s, v) for pts in series.values() for s, v in pts if math.isfinite(v)]
    if not points:
        return ""
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    x1 = x1 if x1 > x0 else x0 + 1

    def xy(s: float, v: float) -> str:
        return f"{PAD + (s - x0) / (x1 - x0) * (W - PAD - 8):.1f},{H - 22 - (v - y0) / (y1 - y0) * (H - 44):.1f}"

    parts = [f'<svg width="{W}" height="{H}" role="img" aria-label="{_e(name)}" data-metric="{_e(name)}">',
             f'<text x="{W / 2}" y="14" text-anchor="middle" font-size="12">{_e(name)}</text>']
    for v in _ticks(y0, y1):
        y = xy(x0, v).split(",")[1]
        parts.append(f'<line x1="{PAD}" x2="{W - 8}" y1="{y}" y2="{y}" stroke="#eee"/>'
                     f'<text x="{PAD - 3}" y="{y}" font-size="9" text-anchor="end">{_fmt(v)}</text>')
    for s in _ticks(x0, x1):
        parts.append(f'<text x="{xy(s, y0).split(",")[0]}" y="{H - 8}" font-size="9" text-anchor="middle">'
                     f'{int(round(s))}</text>')
    colors = {"train": "#1f77b4", "val": "#ff7f0e", "eval": "#2ca02c"}
    for label, pts in series.items():
        pts = [(s, v) for s, v in pts if math.isfinite(v)]
        color = colors.get(label, "#555")
        if label != "train" or len(pts) == 1:
            parts += [f'<circle cx="{xy(s, v).split(",")[0]}" cy="{xy(s, v).split(",")[1]}" r="2.5" fill="{color}"/>'
                      for s, v in pts]
            continue
        raw = " ".join(xy(s, v) for s, v in pts)
        if smooth > 0 and not drawn_raw(name):
            smoothed = ema([v for _, v in pts], smooth)
            parts.append(f'<polyline class="raw" fill="none" stroke="{color}" points="{raw}"/>')
            raw = " ".join(xy(s, v) for (s, _), v in zip(pts, smoothed))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{raw}"/>')
    parts.append("</svg>")
    return "".join(parts)


def curves_section(train: dict, val: dict, smooth: float) -> str:
    # a flat reward or loss is a finding (nothing learns): drawn; other constants only listed
    constant = {m: v for m, v in constant_metrics(train, val).items() if not m.startswith(("loss", "reward"))}
    names = [m for m in sorted(set(train) | set(val)) if m not in constant]
    out = ["<h2>Curves</h2>"]
    for group in GROUPS:
        members = [m for m in names if group_of(m) == group]
        if not members:
            continue
        out.append(f"<h3>{_e(group)}</h3><div class='panels'>")
        for m in members:
            series = {("eval" if m.startswith("eval/") else "train"): train.get(m, [])}
            if m in val:
                series["val"] = val[m]
            out.append(svg_panel(m, series, smooth))
        out.append("</div>")
    if constant:
        out.append("<h3>constant</h3><table>" + "".join(f"<tr><td>{_e(k)}</td><td class='num'>{_fmt(v)}</td></tr>"
                                                        for k, v in sorted(constant.items())) + "</table>")
    return "\n".join(out)


# ------------------------------------------------------------------------------ summary


def summary_section(train: dict, val: dict, traces: list[dict[str, Any]]) -> str:
    def last(name: str, src: dict = train) -> str:
        return f"{_fmt(src[name][-1][1])} (step {src[name][-1][0]})" if src.get(name) else "-"

    steps = [s for pts in train.values() for s, _ in pts]
    rows = [("steps logged", str(max(steps)) if steps else "0"), ("last train loss", last("loss")),
            ("last val loss", last("loss", val))]
    if "reward_mean" in train:
        first = train["reward_mean"][0][1]
        rows.append(("reward_mean", f"{_fmt(first)} -> {last('reward_mean')}"))
    if "eval/accuracy" in train:
        rows.append(("eval accuracy", f"{_fmt(train['eval/accuracy'][0][1])} -> {last('eval/accuracy')}"))
    totals = {m: sum(v for _, v in pts) for m, pts in train.items() if m.startswith("time_")}
    if totals.get("time_step"):
        rows.append(("time in steps", f"{totals['time_step']:.1f}s"))
    shares = time_shares(totals)
    if shares:
        rows.append(("where the time went", format_time_shares(shares)))
    rows.append(("traced samples", str(len(traces))))
    return "<h2>Summary</h2><table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + \
        "</table>"


# ------------------------------------------------------------------------------ traces, config, checkpoints


def traces_section(traces: list[dict[str, Any]]) -> str:
    if not traces:
        return "<h2>Samples</h2><p>No traces.jsonl lines (offline runs and trace_samples: 0 write none).</p>"
    shown = traces[-MAX_TRACES:]
    steps = sorted({t.get("step") for t in shown})
    options = "".join(f"<option value='{_e(s)}'{' selected' if s == steps[-1] else ''}>{_e(s)}</option>"
                      for s in steps)
    out = [f"<h2>Samples</h2><p>{len(shown)} of {len(traces)} traced samples (the newest).</p>",
           "<div class='controls'><label>split <select id='f-split' onchange='filterTraces()'><option>all</option>"
           "<option>train</option><option>eval</option></select></label>"
           f"<label>step <select id='f-step' onchange='filterTraces()'><option>all</option>{options}</select></label>"
           "<label>reward &ge; <input id='f-min' size='6' oninput='filterTraces()'></label>"
           "<label>reward &le; <input id='f-max' size='6' oninput='filterTraces()'></label>"
           "<span id='f-count'></span></div>",
           "<table id='samples'><tr><th>split</th><th>step</th><th>group</th><th>sample</th><th>reward</th>"
           "<th>advantage</th><th>finish</th><th>tokens</th><th>tools</th><th>sample</th></tr>"]
    for t in shown:
        r = table_row(t)
        preview = r["completion"][:80].replace("\n", " ")
        out.append(f"<tr class='trace' data-split='{_e(r['split'])}' data-step='{_e(r['step'])}' "
                   f"data-reward='{_e(r['reward'])}'><td>{_e(r['split'])}</td><td class='num'>{_e(r['step'])}</td>"
                   f"<td class='num'>{_e(r['group'])}</td><td class='num'>{_e(r['sample'])}</td>"
                   f"<td class='num'>{_fmt(r['reward'])}</td><td class='num'>{_fmt(r['advantage'])}</td>"
                   f"<td>{_e(r['finish'])}</td><td class='num'>{_e(r['tokens'])}</td>"
                   f"<td class='num'>{_e(r['tool_calls'])}</td><td><details><summary>{_e(preview) or '(empty)'}"
                   f"</summary><pre>{_e(format_trace(t))}</pre></details></td></tr>")
    out.append("</table>")
    return "\n".join(out)


def checkpoints_section(ckpt_dir: str | None, verify: bool) -> str:
    from astrai.model.manifest import ManifestError, check_checkpoint, step_dirs

    if not ckpt_dir:
        return "<h2>Checkpoints</h2><p>No config.yaml in the log_dir: the ckpt_dir is unknown.</p>"
    rows = []
    for step, path in step_dirs(ckpt_dir):
        try:
            check_checkpoint(path, "checksums" if verify else "sizes")
            state = "<span class='ok'>complete, checksums verified</span>" if verify else \
                "<span class='ok'>complete (sizes; astrai report --verify reads every byte)</span>"
        except ManifestError as e:
            state = f"<span class='bad'>{_e(e)}</span>"
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        rows.append(f"<tr><td class='num'>{step}</td><td>{_e(path)}</td><td class='num'>{size / 1e6:.1f} MB</td>"
                    f"<td>{state}</td></tr>")
    if not rows:
        return f"<h2>Checkpoints</h2><p>None in {_e(ckpt_dir)}.</p>"
    return ("<h2>Checkpoints</h2><table><tr><th>step</th><th>directory</th><th>size</th><th>state</th></tr>"
            + "".join(rows) + "</table>")


def read_config(log_dir: Path) -> tuple[str, dict[str, Any]]:
    path = log_dir / CONFIG_FILE
    if not path.exists():
        return "", {}
    import yaml

    text = path.read_text()
    return text, yaml.safe_load(text) or {}


# ------------------------------------------------------------------------------ the page


def build_report(log_dir: str | Path, smooth: float = DEFAULT_SMOOTH, verify: bool = False) -> str:
    log_dir = Path(log_dir)
    metrics = log_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {str(log_dir)!r}; pass the log_dir of a training run")
    train, val = read_metrics(metrics)
    traces = read_traces(log_dir)
    config_text, config = read_config(log_dir)
    ckpt_dir = (config.get("ckpt") or {}).get("ckpt_dir")
    title = f"astrai run: {log_dir.resolve().name}"
    data = {"train": train, "val": val}  # the curves' numbers, for a reader that wants them
    body = [f"<h1>{_e(title)}</h1>",
            f"<p>{_e((config.get('data') or {}).get('train_type', ''))} run, log_dir {_e(log_dir)}</p>",
            summary_section(train, val, traces), curves_section(train, val, smooth), traces_section(traces),
            checkpoints_section(ckpt_dir, verify),
            "<h2>Config</h2>" + (f"<pre>{_e(config_text)}</pre>" if config_text else
                                 "<p>No config.yaml in the log_dir (a run of an older astrai).</p>")]
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{_e(title)}</title><style>{STYLE}</style><script>{SCRIPT}</script></head><body>\n"
            + "\n".join(body)
            + f"\n<script type='application/json' id='astrai-metrics'>{blob}</script>\n</body></html>\n")


def write_report(log_dir: str | Path, out: str | Path | None = None, smooth: float = DEFAULT_SMOOTH,
                 verify: bool = False) -> Path:
    """Write the page (atomically: a reader never sees half of it); returns its path."""
    text = build_report(log_dir, smooth, verify)
    path = Path(out) if out is not None else Path(log_dir) / REPORT_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


class ReportPage:
    """``report_html: true``: rank 0 rewrites ``report.html`` after each checkpoint (placed after
    the checkpoint saver) and at the end of the run. A page that cannot be written is a warning:
    the run goes on."""

    requested_metrics = frozenset()
    after_checkpoints = True  # arrange_callbacks puts it after the saver

    def __init__(self, log_dir: str | Path, interval: int):
        self.log_dir, self.interval = Path(log_dir), interval

    def _write(self, trainer: Any) -> None:
        if not trainer.is_main:
            return
        try:
            write_report(self.log_dir)
        except (OSError, ValueError) as e:
            print(f"warning: report.html not written: {e}", file=sys.stderr)

    def after_optimizer_step(self, trainer: Any) -> None:
        if self.interval and trainer.ctx.step % self.interval == 0:
            self._write(trainer)

    def on_train_end(self, trainer: Any) -> None:
        self._write(trainer)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai report", description="one self-contained HTML page of a run: LOG_DIR/report.html")
    parser.add_argument("log_dir", help="a training run's log_dir")
    parser.add_argument("--out", default=None, help="the HTML file (default: LOG_DIR/report.html)")
    parser.add_argument("--smooth", type=float, default=DEFAULT_SMOOTH, help="EMA factor in [0, 1) for the curves")
    parser.add_argument("--verify", action="store_true", help="recompute the checkpoints' checksums (reads every byte)")
    args = parser.parse_args(argv)
    try:
        path = write_report(args.log_dir, args.out, args.smooth, args.verify)
    except (FileNotFoundError, ValueError) as e:
        print(f"astrai report: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
