"""`astrai report`: the run page of an online GRPO run with tools (refreshed at its checkpoints by
report_html) and of an offline run. No browser is installed here (chromium is not), so the page is
parsed: the reward curve's numbers and panel, the samples table, the config, the checkpoints."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import yaml

from astrai.cli import main as astrai
from astrai.train.cli import main
from astrai.train.traces import read_traces
from astrai.train.trainer import Trainer
from tests.train.rl_runs import write_tool_run
from tests.train.toydata import ToySeqDataset
from tests.train.trainer_utils import tiny_config, tiny_model


class Page(HTMLParser):
    """What the tests read of the page: svg panels (metric -> polylines), sample rows, <pre> texts,
    the embedded metrics, external references (there must be none)."""

    def __init__(self, text: str):
        super().__init__()
        self.panels: dict[str, int] = {}
        self.rows: list[dict[str, str]] = []
        self.pres: list[str] = []
        self.external: list[str] = []
        self.blob = ""
        self._panel = self._pre = self._blob = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("src", "href"):
            if a.get(key, "").startswith(("http", "//")):
                self.external.append(a[key])
        if tag == "svg":
            self._panel = a["data-metric"]
            self.panels[self._panel] = 0
        elif tag == "polyline" and self._panel:
            self.panels[self._panel] += 1
        elif tag == "tr" and a.get("class") == "trace":
            self.rows.append(a)
        elif tag == "pre":
            self._pre = ""
        elif tag == "script" and a.get("id") == "astrai-metrics":
            self._blob = ""

    def handle_endtag(self, tag):
        if tag == "svg":
            self._panel = None
        elif tag == "pre" and self._pre is not None:
            self.pres.append(self._pre)
            self._pre = None
        elif tag == "script" and self._blob is not None:
            self.blob, self._blob = self._blob, None

    def handle_data(self, data):
        if self._pre is not None:
            self._pre += data
        if self._blob is not None:
            self._blob += data


def test_the_run_page_of_an_online_run_with_tools(tmp_path, tok_dir):
    config = write_tool_run(tmp_path, tok_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["log"]["report_html"] = True
    cfg["ckpt"]["ckpt_interval"] = 2
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["--config", str(config)]) == 0
    log = tmp_path / "log"
    refreshed = Page((log / "report.html").read_text())  # written by the run at its end
    assert astrai(["report", str(log)]) == 0
    page = Page((log / "report.html").read_text())
    assert page.rows == refreshed.rows and not page.external
    rewards = [(m["step"], m["reward_mean"]) for m in map(json.loads, (log / "metrics.jsonl").read_text().splitlines())
               if m.get("split") == "train"]
    assert [tuple(p) for p in json.loads(page.blob)["train"]["reward_mean"]] == rewards
    assert page.panels["reward_mean"] >= 1 and page.panels["loss"] == 2  # the EMA over the faint raw curve
    traces = read_traces(log)
    assert [(r["data-step"], r["data-reward"]) for r in page.rows] == [(str(t["step"]), str(t["reward"]))
                                                                        for t in traces]
    assert any("assistant [" in p for p in page.pres)  # each row opens its conversation
    assert any("train_type: online_grpo" in p for p in page.pres)  # the resolved config
    text = (log / "report.html").read_text()
    assert "step_00000002" in text and "step_00000003" in text and "complete (sizes" in text


def test_the_run_page_of_an_offline_run(tmp_path):
    cfg = tiny_config(tmp_path, "--batch_per_device", "4", "--max_steps", "3", "--ckpt_interval", "0")
    Trainer(cfg, model=tiny_model(), train_dataset=ToySeqDataset(16)).train()
    assert astrai(["report", str(tmp_path / "log"), "--verify"]) == 0
    page = Page((tmp_path / "log" / "report.html").read_text())
    assert "loss" in page.panels and not page.rows
    assert len(json.loads(page.blob)["train"]["loss"]) == 3
    assert "checksums verified" in (tmp_path / "log" / "report.html").read_text()  # the end-of-run checkpoint
    assert astrai(["report", str(tmp_path / "nothing")]) == 1
