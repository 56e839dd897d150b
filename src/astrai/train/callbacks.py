"""Callbacks: code that observes the training loop and saves things, never runs its core steps.

The trainer calls the hooks in this order: ``on_train_begin``, then per epoch ``on_epoch_begin``,
per micro-batch ``on_batch_begin`` / ``on_batch_end``, per optimizer step
``before_optimizer_step`` / ``after_optimizer_step`` (``trainer.step_metrics`` holds the step's
metrics there, validation ones included), ``on_epoch_end``; ``on_error`` when the loop raises and
``on_train_end`` always. Built in: metrics log (``metrics.jsonl``), checkpoints, progress (a tqdm bar or periodic lines),
early stopping, the ``report_to`` backends (``reporters.py``: TensorBoard, wandb, MLflow), the
warning of online runs whose rollouts stopped carrying any signal (``FlatRewardsWarning``) and the
end-of-run summary (``summary.py``). Users pass their own objects to ``Trainer(callbacks=...)``;
a callback implements any subset of the hooks, and may offer ``state_dict``/``load_state_dict``
(saved in the checkpoint's trainer state).

Objective metrics (DPO rewards, MoE router statistics, ...) are computed only when some callback
reads them. A callback says which it reads in ``requested_metrics``: a set of names (``val/``
prefixes allowed), or None for all of them; a callback without the attribute is assumed to read
all. The step's core numbers (step, epoch, lr, loss, grad_norm, tokens_per_s, num_loss_units)
are always there.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from astrai.config_values import is_online
from astrai.train.advantages import learns_from_group_differences
from astrai.train.context import Loop
from astrai.train.summary import RunSummary

HOOKS = (
    "on_train_begin", "on_epoch_begin", "on_batch_begin", "on_batch_end", "before_optimizer_step",
    "after_optimizer_step", "on_epoch_end", "on_error", "on_train_end",
)


@runtime_checkable
class Callback(Protocol):
    """Every hook is optional; implement the ones you need with these signatures."""

    def on_train_begin(self, trainer: Loop) -> None: ...
    def on_epoch_begin(self, trainer: Loop) -> None: ...
    def on_batch_begin(self, trainer: Loop, batch: dict[str, Any]) -> None: ...
    def on_batch_end(self, trainer: Loop, batch: dict[str, Any], output: Any) -> None: ...
    def before_optimizer_step(self, trainer: Loop) -> None: ...
    def after_optimizer_step(self, trainer: Loop) -> None: ...
    def on_epoch_end(self, trainer: Loop) -> None: ...
    def on_error(self, trainer: Loop, error: BaseException) -> None: ...
    def on_train_end(self, trainer: Loop) -> None: ...


def requested_metrics(callbacks: Iterable[Any]) -> frozenset[str] | None:
    """Objective metric names any of `callbacks` reads (``val/`` prefixes dropped); None = all."""
    names: set[str] = set()
    for cb in callbacks:
        wanted = getattr(cb, "requested_metrics", None)
        if wanted is None:
            return None
        names.update(name.removeprefix("val/") for name in wanted)
    return frozenset(names)


class CallbackList:
    """Calls one hook on every callback that has it, in list order."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for cb in self.callbacks:
                fn = getattr(cb, hook, None)
                if fn is not None:
                    fn(*args)

        return call

    def state_dict(self) -> dict[str, Any]:
        return {type(cb).__name__: cb.state_dict() for cb in self.callbacks if hasattr(cb, "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for cb in self.callbacks:
            if hasattr(cb, "load_state_dict") and type(cb).__name__ in state:
                cb.load_state_dict(state[type(cb).__name__])


# ------------------------------------------------------------------------------ metrics log


class MetricsLogger:
    """One JSON line per optimizer step in ``<log_dir>/metrics.jsonl`` (rank 0); validation lines too.
    At the start it writes the resolved config beside it (``config.yaml``, read by ``astrai report``).

    On resume, lines past the restored step (written after the last checkpoint by the run that
    was stopped) are dropped, so the file reads as if the run had never been interrupted.
    """

    def __init__(self, log_dir: str | Path, metrics: Iterable[str] | None = None):
        self.path = Path(log_dir) / "metrics.jsonl"
        self.requested_metrics = None if metrics is None else frozenset(metrics)

    def on_train_begin(self, trainer: Loop) -> None:
        if not trainer.is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # the resolved config beside the metrics: what `astrai report` shows (and where ckpt_dir is)
        if getattr(trainer, "config", None) is not None:
            (self.path.parent / "config.yaml").write_text(trainer.config.to_yaml())
        if trainer.ctx.step == 0:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= trainer.ctx.step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def after_optimizer_step(self, trainer: Loop) -> None:
        if not trainer.is_main:
            return
        m = trainer.step_metrics
        train = {k: v for k, v in m.items() if not k.startswith(("val/", "eval/"))}
        lines = [{"split": "train", **train}]
        val = {k: v for k, v in m.items() if k.startswith("val/")}
        if val:
            lines.append({"split": "val", "step": m["step"], "epoch": m["epoch"], **val})
        with self.path.open("a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------------------ checkpoints


class CheckpointSaver:
    """Publishes ``step_N`` after every ``interval`` optimizer steps, and at a stop or the end:
    the loop's model, optimizer, schedule, state, whatever ``extra_state()`` reports and, for a
    loop whose ranks hold state of their own (online RL's rollouts), each rank's ``rank_state()``."""

    requested_metrics = frozenset()

    def __init__(self, interval: int):
        self.interval = interval
        self.last_saved = -1
        self.failed = False

    def _save(self, trainer: Loop) -> None:
        from astrai.train.checkpoint import save_training_checkpoint

        cfg = trainer.config
        rank_state = getattr(trainer, "rank_state", None)  # optional: loops whose ranks differ
        start = time.perf_counter()
        save_training_checkpoint(  # a collective: every rank calls it, rank 0 writes
            cfg.ckpt.ckpt_dir, trainer.ctx.step, model=trainer.raw_model, tokenizer=trainer.tokenizer,
            optimizer=trainer.optimizer, scheduler=trainer.scheduler, trainer_state=trainer.state_dict(),
            extra_state=trainer.extra_state(), rank_state=rank_state() if rank_state is not None else None,
            metrics_path=Path(cfg.log.log_dir) / "metrics.jsonl", keep_last=cfg.ckpt.keep_last,
            background=cfg.ckpt.ckpt_background, base_model_path=cfg.train.param_path,
        )
        self.last_saved = trainer.ctx.step
        trainer.ctx.times.add("checkpoint", time.perf_counter() - start)  # in the next step's time_checkpoint

    def on_train_begin(self, trainer: Loop) -> None:
        self.last_saved = trainer.ctx.step  # a resumed run's start is already on disk

    def after_optimizer_step(self, trainer: Loop) -> None:
        if self.interval and trainer.ctx.step % self.interval == 0:
            self._save(trainer)

    def on_error(self, trainer: Loop, error: BaseException) -> None:
        self.failed = True  # never publish after a failure: the last good checkpoint stays newest

    def on_train_end(self, trainer: Loop) -> None:
        from astrai.train.publish import wait_for_publish

        if not self.failed and trainer.ctx.step != self.last_saved:
            self._save(trainer)
        wait_for_publish()  # a background publish is complete before the run reports success


# ------------------------------------------------------------------------------ progress


class ProgressBar:
    """Progress on rank 0: a tqdm bar (loss, lr, tokens/s, the ETA tqdm derives from the step rate),
    or with ``bar=False`` (``--progress false``) a plain line on stderr every ``1/lines``-th of the run
    and at the first step after ``max_silence_s`` seconds without one, so a log never goes quiet:
    ``step 30/300 (10%): loss 0.8123, reward 0.516, 4,912 tok/s, 0:12 elapsed, eta 1:48``.
    Ten lines a run stay readable in a container log; the time bound (a minute) covers slow steps."""

    requested_metrics = frozenset()

    def __init__(self, total_steps: int, bar: bool = True, lines: int = 10, max_silence_s: float = 60.0,
                 clock: Any = None):
        self.total_steps, self.use_bar, self.max_silence_s = total_steps, bar, max_silence_s
        self.every = max(1, math.ceil(total_steps / max(1, lines)))
        self.bar = None
        self.clock = clock or time.monotonic
        self.start = self.last = 0.0
        self.first_step = 0

    def on_train_begin(self, trainer: Loop) -> None:
        if not trainer.is_main:
            return
        self.start = self.last = self.clock()
        self.first_step = trainer.ctx.step  # a resumed run's rate counts its own steps only
        if self.use_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total_steps, initial=trainer.ctx.step, unit="step",
                            file=sys.stderr, dynamic_ncols=True)

    def after_optimizer_step(self, trainer: Loop) -> None:
        if not trainer.is_main:
            return
        m = trainer.step_metrics
        if self.bar is not None:
            postfix = {"loss": f"{m['loss']:.4f}", "lr": f"{m['lr']:.2e}"}
            if "tokens_per_s" in m:  # offline loops; an online RL step shows its rollout reward
                postfix["tok_s"] = f"{m['tokens_per_s']:.0f}"
            if "reward_mean" in m:
                postfix["reward"] = f"{m['reward_mean']:.3f}"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        else:
            now, step = self.clock(), trainer.ctx.step
            if step % self.every == 0 or step >= self.total_steps or now - self.last >= self.max_silence_s:
                self.last = now
                print(self.line(step, m, now - self.start, step - self.first_step), file=sys.stderr, flush=True)

    def line(self, step: int, m: dict[str, Any], elapsed: float, done: int) -> str:
        """`step 30/300 (10%): loss 0.8123, reward 0.516, 4,912 tok/s, 0:12 elapsed, eta 1:48`."""
        parts = [f"loss {m['loss']:.4f}"] if "loss" in m else []
        if "reward_mean" in m:
            parts.append(f"reward {m['reward_mean']:.3f}")
        speed = m.get("tokens_per_s", m.get("rollout_tokens_per_s"))
        if speed is not None:
            parts.append(f"{speed:,.0f} {'tok/s' if 'tokens_per_s' in m else 'rollout tok/s'}")
        parts.append(f"{_clock_text(elapsed)} elapsed")
        if done > 0 and step < self.total_steps:
            parts.append(f"eta {_clock_text(elapsed / done * (self.total_steps - step))}")
        share = f" ({step / self.total_steps:.0%})" if self.total_steps else ""
        return f"step {step}/{self.total_steps}{share}: " + ", ".join(parts)

    def on_train_end(self, trainer: Loop) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock_text(seconds: float) -> str:
    """1:48, 12:05, 2:03:10."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


# ------------------------------------------------------------------------------ early stopping


class EarlyStopping:
    """Requests a stop after ``patience`` evaluations of ``metric`` without a ``min_delta`` gain."""

    def __init__(self, metric: str, patience: int = 3, min_delta: float = 0.0, mode: str = "min"):
        if mode not in ("min", "max"):
            raise ValueError(f"early_stopping_mode={mode!r}; expected 'min' or 'max'")
        self.metric, self.patience, self.min_delta, self.mode = metric, patience, min_delta, mode
        self.requested_metrics = frozenset([metric])
        self.best: float | None = None
        self.num_bad = 0

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        gain = self.best - value if self.mode == "min" else value - self.best
        return gain > self.min_delta

    def after_optimizer_step(self, trainer: Loop) -> None:
        value = trainer.step_metrics.get(self.metric)
        if value is None:  # no evaluation at this step
            return
        if not math.isnan(value) and self._improved(value):  # NaN never improves
            self.best, self.num_bad = value, 0
        else:
            self.num_bad += 1
            if self.num_bad >= self.patience:
                trainer.ctx.request_stop(f"early stopping: {self.metric} did not improve for {self.patience} evaluations")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "num_bad": self.num_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.num_bad = state["best"], int(state["num_bad"])


FLAT_REWARD_ROLLOUTS = 5  # fresh rollouts in a row without a group whose rewards differ, then one warning


class FlatRewardsWarning:
    """Online runs that learn only from differences within a prompt's group (GRPO's group-relative
    estimators, online DPO): after FLAT_REWARD_ROLLOUTS fresh rollouts in a row where every group's
    samples scored alike (``frac_reward_zero_std`` 1), every advantage was 0 and the policy did not
    move; one warning per such streak says so, names the rewards and what to check."""

    requested_metrics = frozenset({"frac_reward_zero_std", "truncated_fraction"})

    def __init__(self, rewards: list[str], rollouts: int = FLAT_REWARD_ROLLOUTS):
        self.rewards, self.rollouts = list(rewards), rollouts
        self.streak, self.first_step = 0, 0
        self.warnings: list[str] = []

    def after_optimizer_step(self, trainer: Loop) -> None:
        metrics = trainer.step_metrics
        if "frac_reward_zero_std" not in metrics:  # a step on a reused rollout: nothing new was scored
            return
        if metrics["frac_reward_zero_std"] < 1.0:
            self.streak = 0
            return
        self.streak += 1
        self.first_step = trainer.ctx.step if self.streak == 1 else self.first_step
        if self.streak != self.rollouts:
            return
        cut = metrics.get("truncated_fraction", 0.0)
        hint = (f"{cut:.0%} of the completions were cut off at rollout_max_tokens: raise --rollout_max_tokens; "
                if cut >= 0.5 else "")
        line = (f"warning: the last {self.rollouts} rollouts (steps {self.first_step}-{trainer.ctx.step}) had no prompt "
                "whose samples got different rewards (frac_reward_zero_std 1.0), so every advantage was 0 and the "
                f"policy did not learn; check that the rewards ({', '.join(self.rewards) or 'the environment'}) tell "
                "a prompt's samples apart on a few completions (a reward that cannot parse an answer scores every "
                f"sample alike); {hint}or raise --group_size / --rollout_temperature for more varied samples")
        self.warnings.append(line)
        if trainer.is_main:
            print(line, file=sys.stderr)


def default_callbacks(trainer: Loop) -> list[Any]:
    """The built-in callbacks a config asks for; metrics come before checkpoints so that a
    checkpoint's copy of metrics.jsonl holds its own step."""
    cfg = trainer.config
    cbs: list[Any] = [MetricsLogger(cfg.log.log_dir, cfg.log.log_metrics)]
    traces = None
    if cfg.log.trace_samples > 0 and (is_online(cfg.data.train_type) or cfg.train.eval_interval > 0):
        from astrai.train.traces import TraceLog  # before evaluation: a fresh run's file is emptied first

        traces = TraceLog(cfg.log.log_dir, cfg.log.trace_samples)
        cbs.append(traces)
    if cfg.train.eval_interval > 0:  # after the logger: its rows follow the step's train row
        from astrai.train.evaluation import GenerationEval

        cbs.append(GenerationEval(cfg, traces))
    if learns_from_group_differences(cfg.data.train_type, cfg.rl):  # warns when no group has signal for long
        cbs.append(FlatRewardsWarning(list(cfg.rl.rewards)))
    if cfg.train.early_stopping_metric:
        cbs.append(EarlyStopping(cfg.train.early_stopping_metric, cfg.train.early_stopping_patience,
                                 cfg.train.early_stopping_min_delta, cfg.train.early_stopping_mode))
    world = getattr(getattr(trainer, "dist", None), "world_size", 1)
    if world > 1:  # each rank's own step times (and rollout statistics): ranks/rank_<R>.jsonl
        from astrai.train.timing import RankLog

        cbs.append(RankLog(cfg.log.log_dir, trainer.dist.rank))
    cbs.append(ProgressBar(trainer.total_steps, bar=cfg.log.progress))  # or periodic lines (--progress false)
    report_to = list(cfg.log.report_to) + (["tensorboard"] if cfg.log.tensorboard else [])
    if report_to:  # the same numbers as metrics.jsonl, to TensorBoard / wandb / MLflow (reporters.py)
        from astrai.train.reporters import ReportTo

        cbs.append(ReportTo(report_to, cfg.log.log_dir, cfg.log.report_project, cfg.log.run_name,
                            cfg.log.log_metrics, traces=traces))
    cbs.append(CheckpointSaver(cfg.ckpt.ckpt_interval))
    if cfg.log.report_html:  # after the saver: the page shows the checkpoint just published
        from astrai.train.report_page import ReportPage

        cbs.append(ReportPage(cfg.log.log_dir, cfg.ckpt.ckpt_interval))
    cbs.append(RunSummary(trainer.ctx.command))
    return cbs


def arrange_callbacks(built: list[Any], user: list[Any]) -> CallbackList:
    """The built-in observers, then the user's callbacks (they see a step before its checkpoint is
    published), then the checkpoint saver, the run page (``report_html``), then the run summary
    (it names the published checkpoint)."""
    last = [cb for cb in built if isinstance(cb, CheckpointSaver | RunSummary) or getattr(cb, "after_checkpoints", False)]
    return CallbackList([cb for cb in built if cb not in last] + list(user) + last)
