"""Reporters: the metrics of ``metrics.jsonl`` sent to TensorBoard, Weights & Biases or MLflow.

A side branch of the training data flow, beside the metrics log: ``report_to: [tensorboard,
wandb, mlflow]`` adds one ``ReportTo`` callback that, on rank 0, hands each backend the same
numbers under the same names as the lines of ``metrics.jsonl`` (``loss``, ``lr``, ``grad_norm``,
... and ``val/loss`` for validation) at the same optimizer steps; only ``step`` (the x axis) and
``split`` are left out. Each backend's package is imported when the run starts, and a missing
one is an error naming the package to install. Backends close at the end of the run, also after
a stop signal (the loops turn SIGTERM into a stop and still call ``on_train_end``), and a failed
run is marked failed where the backend has such a state. The wandb and MLflow run ids are saved in
the checkpoint, so a resumed run continues the same run. With ``trace_samples`` (``traces.py``), each
step's trace lines go along: a wandb table ``traces``, TensorBoard text ``traces`` (a markdown
table) and an MLflow artifact ``traces/step_<N>.jsonl``.

Where they write: TensorBoard events under ``<log_dir>/tensorboard``; wandb under ``$WANDB_DIR``
(default ``<log_dir>``), offline with ``WANDB_MODE=offline``; MLflow to ``$MLFLOW_TRACKING_URI``
(default ``<log_dir>/mlruns``, a local file store; ``MLFLOW_ALLOW_FILE_STORE=true`` is set for it,
as MLflow 3 asks).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from astrai.config_values import REPORTERS as PACKAGES
from astrai.config_values import missing_package
from astrai.train.context import Loop
from astrai.train.traces import TABLE_COLUMNS, table_row

REPORTERS = tuple(PACKAGES)  # report_to's names (the config's closed choice; each is built here)


class Reporter(Protocol):
    """One backend: ``log`` a step's metrics, ``close`` once (``failed`` after an error)."""

    run_id: str | None

    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def log_traces(self, lines: list[dict[str, Any]], step: int) -> None: ...
    def close(self, failed: bool) -> None: ...


def markdown_table(lines: list[dict[str, Any]]) -> str:
    """Trace lines as a markdown table (TensorBoard renders it), one row per sample."""
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str("" if v is None else v)
        return text.replace("|", "\\|").replace("\n", " ")[:200]

    rows = [" | ".join(TABLE_COLUMNS), " | ".join("---" for _ in TABLE_COLUMNS)]
    rows += [" | ".join(cell(table_row(line)[c]) for c in TABLE_COLUMNS) for line in lines]
    return "\n".join(rows)


def scalar_metrics(step_metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics.jsonl step (train and ``val/`` keys), without the step itself."""
    return {k: float(v) for k, v in step_metrics.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}


def _require(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(PACKAGES[name][0])
    except ImportError:
        raise ValueError(missing_package(name) or f"report_to has {name!r} but importing {PACKAGES[name][0]} "
                         f"failed; reinstall {PACKAGES[name][1]}") from None


class TensorBoardReporter:
    """Scalars in TensorBoard event files under ``<log_dir>/tensorboard``."""

    def __init__(self, log_dir: Path, start_step: int):
        tb = _require("tensorboard")
        # a resumed run drops the events past its checkpoint, as metrics.jsonl drops those lines
        self.writer = tb.SummaryWriter(str(log_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        self.run_id = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_traces(self, lines: list[dict[str, Any]], step: int) -> None:
        self.writer.add_text("traces", markdown_table(lines), step)

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbReporter:
    """A wandb run (``WANDB_MODE=offline`` writes it under ``$WANDB_DIR`` for a later ``wandb sync``)."""

    def __init__(self, log_dir: Path, project: str, name: str, config: dict[str, Any], run_id: str | None):
        wandb = _require("wandb")
        self.table = wandb.Table
        self.run = wandb.init(project=project, name=name, config=config, dir=os.environ.get("WANDB_DIR", str(log_dir)),
                              id=run_id, resume="allow" if run_id else None, reinit="create_new")
        self.run_id = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_traces(self, lines: list[dict[str, Any]], step: int) -> None:
        rows = [[table_row(line)[c] for c in TABLE_COLUMNS] for line in lines]
        self.run.log({"traces": self.table(columns=list(TABLE_COLUMNS), data=rows)}, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MLflowReporter:
    """An MLflow run in experiment ``project`` (tracking URI ``$MLFLOW_TRACKING_URI``, else a file
    store in ``<log_dir>/mlruns``)."""

    def __init__(self, log_dir: Path, project: str, name: str, config: dict[str, Any], run_id: str | None):
        mlflow = _require("mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local default: a file store (mlflow-skinny has no SQL backend; MLflow 3 asks for opt-in)
            uri = (log_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            for section, values in config.items():  # params: flat section.key strings, as MLflow keeps them
                for key, value in (values or {}).items():
                    self.client.log_param(run_id, f"{section}.{key}", str(value)[:6000])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._metric = mlflow.entities.Metric

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in metrics.items()])

    def log_traces(self, lines: list[dict[str, Any]], step: int) -> None:
        import json

        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        self.client.log_text(self.run_id, text, f"traces/step_{step:08d}.jsonl")

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class ReportTo:
    """The callback behind ``report_to``: opens each backend on rank 0 when the run starts, sends
    every optimizer step's metrics (what ``MetricsLogger`` writes) and closes them at the end."""

    def __init__(self, names: list[str], log_dir: str | Path, project: str | None = None, run_name: str | None = None,
                 metrics: list[str] | None = None, traces: Any = None):
        unknown = [n for n in names if n not in REPORTERS]
        if unknown:
            raise ValueError(f"report_to has {unknown}; choose from {', '.join(REPORTERS)}")
        self.names, self.log_dir = list(dict.fromkeys(names)), Path(log_dir)
        self.project, self.run_name = project, run_name
        self.requested_metrics = None if metrics is None else frozenset(metrics)
        self.reporters: dict[str, Any] = {}
        self.run_ids: dict[str, str] = {}  # from a resumed checkpoint: continue the same wandb / MLflow runs
        self.failed = False
        self.traces = traces  # a TraceLog: its lines of each step go to the backends too
        if traces is not None:
            traces.keep_for_reporters = True

    def on_train_begin(self, trainer: Loop) -> None:
        if not trainer.is_main:
            return
        name = self.run_name or self.log_dir.resolve().name
        config = trainer.config.to_dict()
        try:
            for backend in self.names:
                if backend == "tensorboard":
                    self.reporters[backend] = TensorBoardReporter(self.log_dir, trainer.ctx.step)
                    continue
                env = "WANDB_PROJECT" if backend == "wandb" else "MLFLOW_EXPERIMENT_NAME"
                project = self.project or os.environ.get(env) or "astrai"
                cls = WandbReporter if backend == "wandb" else MLflowReporter
                self.reporters[backend] = cls(self.log_dir, project, name, config, self.run_ids.get(backend))
        except BaseException:
            self.failed = True  # the loop has not started: close what opened, then let the error out
            self.on_train_end(trainer)
            raise
        self._send_traces(trainer.ctx.step)  # the step-0 evaluation's, written before this

    def _send_traces(self, step: int) -> None:
        lines = self.traces.take() if self.traces is not None else []
        if lines:
            for reporter in self.reporters.values():
                if hasattr(reporter, "log_traces"):  # a user's or a test's reporter may log scalars only
                    reporter.log_traces(lines, step)

    def after_optimizer_step(self, trainer: Loop) -> None:
        if self.reporters:
            metrics = scalar_metrics(trainer.step_metrics)
            for reporter in self.reporters.values():
                reporter.log(metrics, trainer.ctx.step)
            self._send_traces(trainer.ctx.step)

    def on_error(self, trainer: Loop, error: BaseException) -> None:
        self.failed = True

    def on_train_end(self, trainer: Loop) -> None:
        reporters, self.reporters = self.reporters, {}
        for reporter in reporters.values():
            reporter.close(self.failed)

    def state_dict(self) -> dict[str, Any]:
        ids = {name: r.run_id for name, r in self.reporters.items() if r.run_id is not None}
        return {"run_ids": {**self.run_ids, **ids}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_ids = dict(state.get("run_ids", {}))
