"""report_to: TensorBoard, wandb (offline) and MLflow (file store) receive the numbers of
metrics.jsonl under the same names at the same steps; read back from each store."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from astrai.config import ConfigError, load_config
from astrai.train.reporters import ReportTo, scalar_metrics
from astrai.train.trainer import Trainer
from tests.train.toydata import ToySeqDataset
from tests.train.trainer_utils import tiny_config, tiny_model, without_checkpoints


def expected_series(log_dir: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as name -> {step: value}: what every reporter must hold."""
    out: dict[str, dict[int, float]] = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for name, value in row.items():
            if name not in ("step", "split") and isinstance(value, int | float):
                out.setdefault(name, {})[row["step"]] = float(value)
    return out


def assert_same(found: dict[str, dict[int, float]], expected: dict[str, dict[int, float]], rel: float = 0.0):
    assert sorted(found) == sorted(expected)
    for name, series in expected.items():
        assert sorted(found[name]) == sorted(series), name
        for step, value in series.items():
            assert math.isclose(found[name][step], value, rel_tol=rel, abs_tol=0.0 if rel == 0 else 1e-12), (name, step)


def run_short(tmp_path, *report_to: str) -> Path:
    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--max_steps", "4", "--val_interval", "2",
                      "--report_to", json.dumps(list(report_to)), "--run_name", "tiny-run")
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(16), val_dataset=ToySeqDataset(8, seed=1))
    without_checkpoints(t)
    t.train()
    return tmp_path / "log"


def test_scalar_metrics_keep_the_jsonl_names():
    m = {"step": 3, "epoch": 0, "loss": 1.5, "lr": 1e-3, "val/loss": 2.0, "flag": True, "note": "x"}
    assert scalar_metrics(m) == {"epoch": 0.0, "loss": 1.5, "lr": 1e-3, "val/loss": 2.0}


def test_report_to_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="report_to has 'wandbb'; did you mean 'wandb'"):
        load_config(None, ["--report_to", "[wandbb]"])
    assert load_config(None, []).log.report_to == []


def test_a_missing_package_names_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb, or remove wandb from report_to"):
        load_config(None, ["--report_to", "[wandb]"])


def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = run_short(tmp_path, "tensorboard")
    acc = EventAccumulator(str(log_dir / "tensorboard"))
    acc.Reload()
    found = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert_same(found, expected_series(log_dir), rel=1e-6)  # event files store float32
    assert "val/loss" in found and set(found["val/loss"]) == {2, 4}


def test_mlflow_file_store_equals_metrics_jsonl(tmp_path, monkeypatch):
    """No MLFLOW_TRACKING_URI: the default file store in <log_dir>/mlruns."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # set by the reporter; undone after the test
    log_dir = run_short(tmp_path, "mlflow")
    uri = (log_dir / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("astrai").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-run"
    assert run.data.params["optim.schedule"] == "constant"
    found = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
             for name in run.data.metrics}
    assert_same(found, expected_series(log_dir))


def wandb_history(run_file: Path) -> dict[str, dict[int, float]]:
    """The history records of an offline .wandb file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(pending)
            pending = b""
    out: dict[str, dict[int, float]] = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
        step = items.pop("_step")
        for name, value in items.items():
            if not name.startswith("_"):
                out.setdefault(name, {})[int(step)] = float(value)
    return out


def test_wandb_offline_run_equals_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_dir = run_short(tmp_path, "wandb")
    import wandb

    wandb.teardown()  # run.finish() may return before wandb-core has written the file; its exit flushes it
    (run_file,) = (tmp_path / "wandb_dir").glob("wandb/offline-run-*/run-*.wandb")
    assert_same(wandb_history(run_file), expected_series(log_dir))


def test_report_to_closes_on_error_and_keeps_run_ids():
    closed = []

    class Fake:
        run_id = "abc"

        def log(self, metrics, step):
            pass

        def close(self, failed):
            closed.append(failed)

    cb = ReportTo(["mlflow"], "unused")
    cb.reporters = {"mlflow": Fake()}
    assert cb.state_dict() == {"run_ids": {"mlflow": "abc"}}
    cb.on_error(None, RuntimeError("boom"))
    cb.on_train_end(None)
    cb.on_train_end(None)  # closed once only
    assert closed == [True]
    again = ReportTo(["mlflow"], "unused")
    again.load_state_dict({"run_ids": {"mlflow": "abc"}})
    assert again.run_ids == {"mlflow": "abc"}


def test_a_stopped_run_closes_its_reporters_cleanly(tmp_path, monkeypatch):
    """A stop request (what SIGTERM becomes) ends the loop through on_train_end: closed, not failed."""
    from astrai.train import reporters

    events = []

    class Fake:
        run_id = None

        def __init__(self, log_dir, start_step):
            events.append(("open", start_step))

        def log(self, metrics, step):
            events.append(("log", step, metrics["loss"]))

        def close(self, failed):
            events.append(("close", failed))

    class StopAt2:
        requested_metrics = frozenset()

        def after_optimizer_step(self, trainer):
            if trainer.ctx.step == 2:
                trainer.ctx.request_stop("SIGTERM")

    monkeypatch.setattr(reporters, "TensorBoardReporter", Fake)
    monkeypatch.setattr(reporters, "missing_package", lambda name: None)
    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--max_steps", "6", "--report_to", "[tensorboard]")
    t = Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(32), callbacks=[StopAt2()])
    without_checkpoints(t)
    t.train()
    losses = expected_series(tmp_path / "log")["loss"]
    assert events == [("open", 0), ("log", 1, losses[1]), ("log", 2, losses[2]), ("close", False)]


TRACES = [{"split": "train", "step": 3, "group": 0, "sample": i, "reward": float(i), "advantage": i - 0.5,
           "prompt": [{"role": "user", "content": "2+2"}],
           "turns": [{"role": "assistant", "text": f"it is {i}", "tokens": 3, "finish_reason": "stop", "tool_calls": []}]}
          for i in range(2)]


def test_trace_lines_reach_every_backend(tmp_path, monkeypatch):
    """Each step's traces.jsonl lines: a wandb table (a fake wandb), TensorBoard text and an MLflow
    artifact (read back from their stores); ReportTo hands a TraceLog's new lines over once."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from astrai.train import reporters
    from astrai.train.traces import TABLE_COLUMNS, TraceLog

    tb = reporters.TensorBoardReporter(tmp_path, 0)
    tb.log_traces(TRACES, 3)
    tb.close(False)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (event,) = acc.Tensors("traces/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "it is 1" in text and text.splitlines()[0] == " | ".join(TABLE_COLUMNS)

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    ml = reporters.MLflowReporter(tmp_path, "astrai", "t", {}, None)
    ml.log_traces(TRACES, 3)
    path = ml.client.download_artifacts(ml.run_id, "traces/step_00000003.jsonl", str(tmp_path / "dl"))
    assert [json.loads(line) for line in Path(path).read_text().splitlines()] == TRACES
    ml.close(False)

    logged = []

    class FakeWandb:
        class Table:
            def __init__(self, columns, data):
                self.columns, self.data = columns, data

        @staticmethod
        def init(**kw):
            class Run:
                id = "r1"

                def log(self, data, step):
                    logged.append((data, step))
            return Run()

    monkeypatch.setattr(reporters, "_require", lambda name: FakeWandb)
    wb = reporters.WandbReporter(tmp_path, "p", "n", {}, None)
    wb.log_traces(TRACES, 3)
    [(data, step)] = logged
    assert step == 3 and data["traces"].columns == list(TABLE_COLUMNS)
    assert [row[TABLE_COLUMNS.index("completion")] for row in data["traces"].data] == ["it is 0", "it is 1"]

    got = []

    class Fake:
        run_id = None

        def log(self, metrics, step):
            pass

        def log_traces(self, lines, step):
            got.append((step, [t["sample"] for t in lines]))

    class Trainer:
        step_metrics = {"step": 3, "loss": 1.0}

        class ctx:
            step = 3

    log = TraceLog(tmp_path, 8)
    cb = ReportTo(["tensorboard"], tmp_path, traces=log)
    cb.reporters = {"tensorboard": Fake()}
    log.write(TRACES)
    cb.after_optimizer_step(Trainer())
    cb.after_optimizer_step(Trainer())  # nothing new: nothing sent
    assert got == [(3, [0, 1])]
