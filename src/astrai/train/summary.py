"""The end-of-run summary: a few plain lines on stderr when a training run finishes or stops.

Every loop (the offline ``Trainer``, the online RL loop) carries ``RunSummary`` among its
default callbacks, after the checkpoint saver, so by its ``on_train_end`` the last checkpoint is
published. On rank 0 it prints, whatever ``progress`` says: how the run ended (finished, or
stopped and why), the final step, the last train and validation loss (and the mean reward of an RL
run), the held-out accuracy of evaluation during training (first -> last, their count and time),
tokens/s and wall time of this process, the last checkpoint this run published (``ckpt_dir`` may
hold older runs' too), the commands that serve it or resume the run, and where the time went (the
shares of the ``time_*`` parts, ``timing.py``). A run that fails prints its error instead (``train/cli.py``).
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astrai.train.context import Loop
from astrai.train.timing import format_time_shares, time_shares


@dataclass
class RunReport:
    """What the summary says; filled by ``RunSummary``, formatted by ``format_summary``."""

    step: int
    total_steps: int
    seconds: float
    tokens: int  # trained tokens (all ranks) in this process's part of the run
    stop_reason: str | None = None  # None: the run finished
    train_loss: tuple[int, float] | None = None  # (step, value) of the last optimizer step
    val_loss: tuple[int, float] | None = None  # (step, value) of the last validation
    reward_mean: float | None = None  # online RL: the last rollout's mean reward
    eval_accuracy: tuple[int, float] | None = None  # (step, value) of the last evaluation (eval_interval)
    eval_first_accuracy: float | None = None  # this process's first evaluation (step 0 of a fresh run)
    eval_seconds: float = 0.0  # all evaluations of this process
    num_evals: int = 0
    checkpoint: Path | None = None
    resume_command: str | None = None  # None: "rerun with --resume"
    hints: bool = True  # the "serve it" and "resume" lines (log.summary_hints)
    reward_model: bool = False  # the checkpoint scores (train_type reward): used as a reward, not served
    time_shares: list[tuple[str, float]] = field(default_factory=list)  # (part, share): timing.time_shares


def format_duration(seconds: float) -> str:
    """`45.2s`, `3m 07s`, `2h 05m`."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def format_summary(r: RunReport) -> str:
    """The summary's lines (no trailing newline)."""
    if r.stop_reason is None:
        head = f"run finished at step {r.step} of {r.total_steps}"
    else:
        saved = "checkpoint published" if r.checkpoint is not None and r.step > 0 else (
            "no optimizer step completed, nothing to save" if r.step == 0 else "no checkpoint")
        head = f"stopped at step {r.step} of {r.total_steps} ({r.stop_reason}); {saved}"
    losses = [f"train loss {r.train_loss[1]:.4f} (step {r.train_loss[0]})" if r.train_loss else "train loss -"]
    losses.append(f"val loss {r.val_loss[1]:.4f} (step {r.val_loss[0]})" if r.val_loss else "val loss - (no validation)")
    if r.reward_mean is not None:
        losses.append(f"reward_mean {r.reward_mean:.4f}")
    lines = [head, "  " + ", ".join(losses)]
    if r.eval_accuracy is not None:
        first = f"{r.eval_first_accuracy:.1%} -> " if r.num_evals > 1 and r.eval_first_accuracy is not None else ""
        lines.append(f"  eval accuracy {first}{r.eval_accuracy[1]:.1%} (step {r.eval_accuracy[0]}; {r.num_evals} "
                     f"evaluation{'s' if r.num_evals != 1 else ''}, {format_duration(r.eval_seconds)})")
    lines.append(f"  {r.tokens / max(r.seconds, 1e-9):,.0f} tokens/s ({r.tokens:,} tokens), wall time "
                 f"{format_duration(r.seconds)}")
    if r.checkpoint is None:
        lines.append("  last checkpoint: none")
    else:
        lines.append(f"  last checkpoint: {r.checkpoint}")
        if r.hints and r.reward_model:
            lines.append(f"  use it:    --rewards {shlex.quote(str(r.checkpoint))} (or --critic_model_path) in an "
                         "online run")
        elif r.hints:
            lines.append(f"  serve it:  astrai serve --model {shlex.quote(str(r.checkpoint))}")
    if r.hints and r.stop_reason is not None and r.step > 0:
        lines.append(f"  resume:    {r.resume_command or 'run the same command with --resume'}")
    if r.time_shares:
        lines.append(f"  time: {format_time_shares(r.time_shares)}")
    return "\n".join(lines)


def resume_command(command: list[str] | None, config: Any, checkpoint: Path | None) -> str | None:
    """The `astrai train` command line that continues this run from `checkpoint`: the original
    one plus `--resume`. When the run's param_path names a training checkpoint (a run chained
    from another run's checkpoint), --resume would pick that one, so the command names ours."""
    if command is None or checkpoint is None:
        return None
    from astrai.train.resume import TRAINING_STATE_FILES

    words = ["astrai", "train", *command]
    if not config.train.resume:
        words.append("--resume")
    init = config.train.param_path
    if init is not None and Path(init).resolve() != checkpoint.resolve() and \
            any((Path(init) / name).exists() for name in TRAINING_STATE_FILES):
        words += ["--param_path", str(checkpoint)]
    return shlex.join(words)


class RunSummary:
    """Callback: tracks the last losses, tokens and time of the run; prints the summary at the end
    (rank 0, after the checkpoint saver). `command` is the `astrai train` argv (for the resume line)."""

    requested_metrics = frozenset()  # loss, val/loss and reward_mean are always in a step's metrics

    def __init__(self, command: list[str] | None = None, stream: Any = None):
        self.command = command
        self.stream = stream
        self.failed = False
        self.report: RunReport | None = None

    def on_train_begin(self, trainer: Loop) -> None:
        self._t0, self._tokens0 = time.perf_counter(), trainer.ctx.tokens_seen
        self._train: tuple[int, float] | None = None
        self._val: tuple[int, float] | None = None
        self._reward: float | None = None
        self._evals: list[tuple[int, float, float]] = []  # (step, eval/accuracy, eval/seconds)
        self._times: dict[str, float] = {}  # summed time_* metrics (train/timing.py)
        self._note_eval(trainer.step_metrics if isinstance(getattr(trainer, "step_metrics", None), dict) else {},
                        trainer.ctx.step)  # the step-0 evaluation runs in on_train_begin, before this

    def after_optimizer_step(self, trainer: Loop) -> None:
        m = trainer.step_metrics
        if "loss" in m:
            self._train = (m["step"], float(m["loss"]))
        if "val/loss" in m:
            self._val = (m["step"], float(m["val/loss"]))
        if "reward_mean" in m:
            self._reward = float(m["reward_mean"])
        self._note_eval(m, m.get("step", trainer.ctx.step))
        for k, v in m.items():
            if k.startswith("time_"):
                self._times[k] = self._times.get(k, 0.0) + float(v)

    def _note_eval(self, m: dict[str, Any], step: int) -> None:
        if "eval/accuracy" in m:
            self._evals.append((step, float(m["eval/accuracy"]), float(m.get("eval/seconds", 0.0))))

    def on_error(self, trainer: Loop, error: BaseException) -> None:
        self.failed = True  # the error is the run's last word

    def on_train_end(self, trainer: Loop) -> None:
        if not trainer.is_main or self.failed:
            return
        from astrai.train.publish import last_published, latest_checkpoint

        last_save = trainer.ctx.times.pending.get("checkpoint", 0.0)  # the final checkpoint, after the last line
        self._times["time_checkpoint"] = self._times.get("time_checkpoint", 0.0) + last_save

        ctx, cfg = trainer.ctx, trainer.config
        # this run's own: ckpt_dir may hold other runs' checkpoints, even of later steps
        checkpoint = last_published(cfg.ckpt.ckpt_dir)
        if checkpoint is None and cfg.train.resume:  # resumed, then stopped before its first save
            checkpoint = latest_checkpoint(cfg.ckpt.ckpt_dir)
        self.report = RunReport(
            step=ctx.step, total_steps=trainer.total_steps,
            seconds=time.perf_counter() - self._t0, tokens=ctx.tokens_seen - self._tokens0,
            stop_reason=(ctx.stop_reason or "requested") if ctx.stop_requested and ctx.step < trainer.total_steps
            else None,
            train_loss=self._train, val_loss=self._val, reward_mean=self._reward, checkpoint=checkpoint,
            eval_accuracy=self._evals[-1][:2] if self._evals else None,
            eval_first_accuracy=self._evals[0][1] if self._evals else None,
            eval_seconds=sum(e[2] for e in self._evals), num_evals=len(self._evals),
            resume_command=resume_command(self.command, cfg, checkpoint), hints=cfg.log.summary_hints,
            reward_model=getattr(getattr(cfg, "data", None), "train_type", None) == "reward",
            time_shares=time_shares(self._times))
        print(format_summary(self.report), file=self.stream or sys.stderr, flush=True)
