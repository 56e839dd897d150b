"""``astrai traces LOG_DIR``: a run's rollout traces (``traces.jsonl``, ``train/traces.py``) in the terminal.

Picks the lines of one step (``--step N``; default the last traced training step, or with
``--split eval`` the last eval step), optionally only those whose text holds ``--grep TEXT``,
sorted by reward (``--worst K`` / ``--best K``: the K lowest / highest), and prints each sample
as a header (step, group, sample, reward with each function's score, advantage, policy version
and lag, flags) followed by its conversation, one role per block, tool calls as
``name(arguments) -> result``.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from astrai.flags import ArgumentParser
from astrai.train.traces import read_traces


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:+.3f}" if isinstance(v, float) else str(v)


def header(t: dict[str, Any]) -> str:
    terms = ", ".join(f"{k} {v:.3f}" for k, v in t.get("rewards", {}).items())
    parts = [f"step {t.get('step')}", f"group {t.get('group')}", f"sample {t.get('sample')}",
             f"reward {t.get('reward', 0.0):.3f}" + (f" ({terms})" if terms else "")]
    if "advantage" in t or "return" in t:
        parts.append(f"advantage {_num(t.get('advantage'))}" if "advantage" in t else f"return {_num(t['return'])}")
    if "draw" in t:
        parts.append(f"eval {t['draw']}, correct {t.get('correct', 0.0):.0f}")
    if "policy_lag" in t:
        parts.append(f"v{t.get('policy_version')} lag {t['policy_lag']}")
    flags = [name for name in ("truncated", "masked") if t.get(name)]
    if t.get("group_has_signal") is False:
        flags.append("flat group")
    if t.get("filtered"):
        flags.append("dropped by dynamic sampling")
    return "  ".join(parts) + (f"  [{', '.join(flags)}]" if flags else "")


def _block(role: str, text: str, width: int = 100) -> list[str]:
    body = textwrap.indent("\n".join(textwrap.fill(p, width) if p else "" for p in text.splitlines()) or "''",
                           "      ")
    return [f"  {role}:", body]


def format_trace(t: dict[str, Any]) -> str:
    lines = [header(t)]
    for m in t.get("prompt", []):
        lines += _block(m.get("role", "?"), m.get("content", ""))
    for turn in t.get("turns", []):
        if turn.get("role") == "assistant":
            lines += _block(f"assistant [{turn.get('tokens')} tokens, {turn.get('finish_reason')}]", turn.get("text", ""))
            for call in turn.get("tool_calls", []):
                lines.append(f"    tool {call['name']}({call['arguments']}) -> {call.get('result', '(no result)')}")
        else:
            lines += _block(turn.get("role", "?") + (f" {turn['name']}" if turn.get("name") else ""), turn.get("text", ""))
    return "\n".join(lines)


def select(traces: list[dict[str, Any]], step: int | None = None, split: str = "train", worst: int | None = None,
           best: int | None = None, grep: str | None = None) -> list[dict[str, Any]]:
    """The lines of `split` at `step` (default: its last traced step), filtered and sorted."""
    lines = [t for t in traces if t.get("split", "train") == split]
    if not lines:
        return []
    step = max(t.get("step", 0) for t in lines) if step is None else step
    lines = [t for t in lines if t.get("step") == step]
    if grep:
        lines = [t for t in lines if grep.lower() in json.dumps(t, ensure_ascii=False).lower()]
    if worst is not None:
        return sorted(lines, key=lambda t: t.get("reward", 0.0))[:worst]
    if best is not None:
        return sorted(lines, key=lambda t: -t.get("reward", 0.0))[:best]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="astrai traces", description="print a run's rollout traces (LOG_DIR/traces.jsonl)")
    parser.add_argument("log_dir", help="a training run's log_dir")
    parser.add_argument("--step", type=int, default=None, help="the step to show (default: the last traced one)")
    parser.add_argument("--split", choices=("train", "eval"), default="train",
                        help="training rollouts or evaluation episodes (default train)")
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--worst", type=int, default=None, metavar="K", help="the K lowest-reward samples")
    order.add_argument("--best", type=int, default=None, metavar="K", help="the K highest-reward samples")
    parser.add_argument("--grep", default=None, metavar="TEXT", help="only samples whose text holds TEXT (any case)")
    args = parser.parse_args(argv)
    log_dir = Path(args.log_dir)
    try:
        traces = read_traces(log_dir)
    except ValueError as e:
        print(f"astrai traces: error: {e}", file=sys.stderr)
        return 1
    if not traces:
        print(f"astrai traces: error: no traces.jsonl lines in {str(log_dir)!r}; pass the log_dir of an online run "
              "(or one with eval_interval) whose trace_samples is above 0", file=sys.stderr)
        return 1
    chosen = select(traces, args.step, args.split, args.worst, args.best, args.grep)
    if not chosen:
        steps = sorted({t.get("step") for t in traces if t.get("split", "train") == args.split})
        print(f"astrai traces: no {args.split} sample matches (step {args.step}, grep {args.grep!r}); traced "
              f"{args.split} steps: {steps[:20]}{' ...' if len(steps) > 20 else ''}", file=sys.stderr)
        return 1
    print("\n\n".join(format_trace(t) for t in chosen))
    return 0
