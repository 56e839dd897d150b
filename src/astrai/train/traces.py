"""Rollout traces: what the policy wrote, sample by sample, in ``<log_dir>/traces.jsonl``.

A side branch of the online data flow, beside the metrics log. The episode runner
(``rl/runner.py``) keeps a light view (``sample_view``: the prompt messages, each turn's text,
token count and finish reason, the tool calls with their arguments and results) of the first
``trace_samples`` episodes of each draw on the ``Rollout`` it packs; after the first optimizer
step on a fresh rollout, ``TraceLog`` (a callback, rank 0) adds what that step knows (each reward
function's score and the total, the advantage (or PPO's return), the sample's mean |trainer -
sampler| log-prob, an entropy estimate, whether it was truncated or masked) and appends one JSON
line per traced sample; the groups dynamic sampling dropped from the draws are traced after them
(``filtered: true``). Evaluation during training (``train/evaluation.py``) writes its greedy
and sampled episodes with the eval step (``split: eval``). Like ``metrics.jsonl``, a fresh run
truncates the file and a resumed one drops the lines past the restored step, so no line is
duplicated or lost; the file is bounded: past ``max_bytes`` (64 MiB) it is renamed
``traces.1.jsonl`` (replacing the older one), so at most twice that stays on disk. Tool
arguments and results are cut at ``TOOL_CHARS`` characters, any other text at ``TEXT_CHARS``.
``astrai traces`` (``traces_cli.py``) reads them back; the ``report_to`` backends get each
step's lines (``reporters.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from astrai.data.tool_calls import parse_tool_calls

TRACE_FILE = "traces.jsonl"
ROTATED_FILE = "traces.1.jsonl"
MAX_BYTES = 64 * 2**20
TOOL_CHARS = 1000  # a tool call's arguments and its result
TEXT_CHARS = 4000  # a prompt message, an assistant turn, an environment message


def cut(text: Any, limit: int) -> str:
    text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


def _turn_ends(logps: list[float | None], stop_ids: set[int], ids: list[int]) -> list[tuple[int, str]]:
    """(tokens, finish reason) of each sampled turn of a row: the runs of positions that carry a
    behaviour log-prob (tokens between turns carry None); a turn ending on a stop token stopped,
    any other was cut at rollout_max_tokens."""
    runs: list[tuple[int, str]] = []
    start = None
    for p, lp in enumerate([*logps, None]):
        if lp is not None and start is None:
            start = p
        elif lp is None and start is not None:
            runs.append((p - start, "stop" if ids[p - 1] in stop_ids else "length"))
            start = None
    return runs


def sample_view(e: Any, stop_ids: set[int]) -> dict[str, Any]:
    """One episode as a trace shows it (``Episode`` of ``rl/episode.py``): the prompt's messages
    and the turns (assistant text with its tokens and finish reason, tool calls with arguments and
    results, environment messages). Built only for the traced episodes."""
    ends = _turn_ends(e.logps, stop_ids, e.ids)
    if ends:  # the last turn's finish reason as the sampler said it
        ends[-1] = (ends[-1][0], e.finish_reason or ends[-1][1])
    messages = list(e.messages)
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    prompt = [{"role": m.get("role"), "content": cut(m.get("content", ""), TEXT_CHARS)} for m in messages[:first]]
    later = messages[first:] or [{"role": "assistant", "content": e.final_text}]  # single-turn: the completion
    names = set(e.tools.functions) if e.tools else set()
    turns: list[dict[str, Any]] = []
    results = iter([])
    n = 0
    for m in later:
        role = m.get("role")
        if role == "assistant":
            tokens, finish = ends[n] if n < len(ends) else (0, None)
            n += 1
            calls = parse_tool_calls(m.get("content", ""), names)[1] if names else []
            turns.append({"role": "assistant", "text": cut(m.get("content", ""), TEXT_CHARS), "tokens": tokens,
                          "finish_reason": finish,
                          "tool_calls": [{"name": c.name, "arguments": cut(c.arguments, TOOL_CHARS)} for c in calls]})
            results = iter(turns[-1]["tool_calls"])
        elif role == "tool":  # results follow their calls in order
            call = next(results, None)
            if call is not None:
                call["result"] = cut(m.get("content", ""), TOOL_CHARS)
            else:
                turns.append({"role": "tool", "name": m.get("name"), "text": cut(m.get("content", ""), TOOL_CHARS)})
        else:
            turns.append({"role": role, "text": cut(m.get("content", ""), TEXT_CHARS)})
    return {"prompt": prompt, "turns": turns, "truncated": bool(e.truncated or e.finish_reason == "length")}


def trace_views(episodes: list[Any], num: int, tokenizer: Any) -> list[dict[str, Any] | None]:
    """The first `num` episodes' views, None for the rest (what a Rollout carries)."""
    if num <= 0:
        return []
    stop_ids = set(getattr(tokenizer, "stop_token_ids", []) or [])
    return [sample_view(e, stop_ids) if i < num else None for i, e in enumerate(episodes)]


def _per_sample(values: torch.Tensor, mask: torch.Tensor, i: int) -> float | None:
    """A sample's value: itself (per-sample tensors) or its mean over its sampled tokens."""
    if values.dim() == 1:
        return float(values[i])
    m = mask[i]
    return float(values[i][m].float().mean()) if m.any() else None


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def rollout_records(rollout: Any, step: int, policy_version: int, num: int) -> list[dict[str, Any]]:
    """The trace lines of a fresh rollout after its first optimizer step (`step`; `policy_version`
    the version that step trained). At most `num` samples, those the runner kept a view of; then, as
    many again at most, samples of the groups dynamic sampling dropped (``filtered: true``, never
    trained on; their ``group`` counts the dropped groups of the step)."""
    out = _sample_lines(rollout, step, policy_version, num)
    offset = 0
    for part in getattr(rollout, "filtered", []):
        lines = _sample_lines(part, step, policy_version, num - sum(line.get("filtered", False) for line in out))
        for line in lines:
            line.update(group=line["group"] + offset, filtered=True, masked=True)
        out += lines
        offset += part.rewards.size(0)
    return out


def _sample_lines(rollout: Any, step: int, policy_version: int, num: int) -> list[dict[str, Any]]:
    mask = rollout.labels != -100  # IGNORE_INDEX
    G = rollout.group_size
    rewards = rollout.rewards.reshape(-1)
    signal = ~torch.isclose(rollout.rewards, rollout.rewards[:, :1]).all(dim=1)  # (B,)
    out: list[dict[str, Any]] = []
    for i, view in enumerate(rollout.samples):
        if len(out) >= num:
            break
        if view is None:
            continue
        sampled = rollout.old_logps[i][mask[i]]
        line = {"split": "train", "step": step, "policy_version": rollout.policy_version,
                "policy_lag": policy_version - rollout.policy_version, "group": i // G, "sample": i % G,
                "reward": float(rewards[i]),
                "rewards": {k: float(v.reshape(-1)[i]) for k, v in rollout.reward_terms.items()}}
        if "advantages" in rollout.pinned:
            line["advantage"] = _finite(_per_sample(rollout.pinned["advantages"], mask, i))
        if "returns" in rollout.pinned:  # PPO: the return at the response's first token
            first = mask[i].nonzero()
            line["return"] = float(rollout.pinned["returns"][i, first[0, 0]]) if len(first) else None
        if rollout.trainer_logps is not None and mask[i].any():  # pinned by the first step on the rollout
            diff = (rollout.trainer_logps[i][mask[i]] - sampled).abs().mean()
            line["sampler_logp_diff"] = _finite(float(diff))
        # the mean -log p of its sampled tokens: an unbiased estimate of the sampler's per-token entropy
        line["entropy_estimate"] = float(-sampled.mean()) if len(sampled) else None
        keep = rollout.pinned.get("keep")
        line.update({"group_has_signal": bool(signal[i // G]), "masked": bool(keep is not None and not keep[i]),
                     "num_tokens": int(mask[i].sum()), **view})
        out.append(line)
    return out


def eval_records(step: int, policy_version: int, draw: str, answers: Any, num: int,
                 tokenizer: Any) -> list[dict[str, Any]]:
    """The trace lines of one evaluation draw (``Answers`` of ``train/evaluation.py``)."""
    stop_ids = set(getattr(tokenizer, "stop_token_ids", []) or [])
    G = max(1, len(answers.episodes) // max(1, len({e.prompt_index for e in answers.episodes})))
    out = []
    for i, e in enumerate(answers.episodes[:num]):
        out.append({"split": "eval", "draw": draw, "step": step, "policy_version": policy_version,
                    "group": i // G, "sample": i % G, "reward": float(answers.rewards.reshape(-1)[i]),
                    "rewards": {k: float(v.reshape(-1)[i]) for k, v in answers.terms.items()},
                    "correct": float(answers.correct[i]), **sample_view(e, stop_ids)})
    return out


class TraceLog:
    """The callback writing ``traces.jsonl`` on rank 0 (module docstring). ``pending`` holds the
    lines written since a reporter last took them (``take``), when ``keep_for_reporters``."""

    requested_metrics = frozenset()

    def __init__(self, log_dir: str | Path, num: int, max_bytes: int = MAX_BYTES):
        self.dir, self.num, self.max_bytes = Path(log_dir), num, max_bytes
        self.path, self.rotated = self.dir / TRACE_FILE, self.dir / ROTATED_FILE
        self.is_main = True
        self.keep_for_reporters = False
        self.pending: list[dict[str, Any]] = []

    def on_train_begin(self, trainer: Any) -> None:
        self.is_main = trainer.is_main
        runner = getattr(trainer, "runner", None)  # online RL: the runner keeps views of this many samples
        if runner is not None and trainer.is_main:  # only rank 0's rollout is traced
            runner.trace_samples = self.num
        if not self.is_main:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        step = trainer.ctx.step
        for path in (self.rotated, self.path):
            if step == 0:
                path.unlink(missing_ok=True)
            elif path.exists():  # lines a stopped run wrote after its last checkpoint
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= step]
                path.write_text("".join(line + "\n" for line in kept))

    def after_optimizer_step(self, trainer: Any) -> None:
        rollout = getattr(trainer, "rollout", None)
        if rollout is None or rollout.num_uses != 1 or not getattr(rollout, "samples", None):
            return  # offline, a reused rollout, or a rollout restored from a checkpoint (traced before)
        self.write(rollout_records(rollout, trainer.ctx.step, trainer.ctx.policy_version - 1, self.num))

    def write(self, lines: list[dict[str, Any]]) -> None:
        if not self.is_main or not lines:
            return
        if self.path.exists() and self.path.stat().st_size >= self.max_bytes:
            self.path.replace(self.rotated)
        with self.path.open("a") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        if self.keep_for_reporters:
            self.pending += lines

    def take(self) -> list[dict[str, Any]]:
        lines, self.pending = self.pending, []
        return lines


def read_traces(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every trace line of a run, oldest first (the rotated file, then the current one)."""
    log_dir = Path(log_dir)
    lines = []
    for path in (log_dir / ROTATED_FILE, log_dir / TRACE_FILE):
        if path.exists():
            for n, text in enumerate(path.read_text().splitlines(), 1):
                if text.strip():
                    try:
                        lines.append(json.loads(text))
                    except json.JSONDecodeError:
                        raise ValueError(f"{path}:{n} is not a JSON line; is it a traces.jsonl of astrai train?") \
                            from None
    return lines


TABLE_COLUMNS = ("split", "step", "group", "sample", "reward", "advantage", "finish", "tokens", "tool_calls",
                 "prompt", "completion")


def table_row(line: dict[str, Any]) -> dict[str, Any]:
    """A trace line as one flat table row (reporters' tables, the run page): the last user
    message as the prompt, the last assistant turn as the completion."""
    assistant = [t for t in line.get("turns", []) if t.get("role") == "assistant"]
    users = [m for m in line.get("prompt", []) if m.get("role") == "user"] or line.get("prompt", []) or [{}]
    last = assistant[-1] if assistant else {}
    return {"split": line.get("split", "train"), "step": line.get("step"), "group": line.get("group"),
            "sample": line.get("sample"), "reward": line.get("reward"),
            "advantage": line.get("advantage", line.get("return")), "finish": last.get("finish_reason"),
            "tokens": sum(t.get("tokens", 0) for t in assistant),
            "tool_calls": sum(len(t.get("tool_calls", [])) for t in assistant),
            "prompt": users[-1].get("content", ""), "completion": last.get("text", "")}
