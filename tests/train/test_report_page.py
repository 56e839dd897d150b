"""`astrai report`: the run page of an online GRPO run with tools (refreshed at its checkpoints by
report_html) and of an offline run. The page is parsed (the reward curve's numbers and panel, the
samples table, the config, the checkpoints) and, where chromium is installed, rendered by it
headless: its script runs and filters the samples table."""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
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


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, tok_dir):
    """The log_dir of a short online GRPO run with tools, report_html on, checkpoints every 2 steps."""
    tmp_path = tmp_path_factory.mktemp("run")
    config = write_tool_run(tmp_path, tok_dir)
    cfg = yaml.safe_load(config.read_text())
    cfg["log"]["report_html"] = True
    cfg["ckpt"]["ckpt_interval"] = 2
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["--config", str(config)]) == 0
    return tmp_path / "log"


def test_the_run_page_of_an_online_run_with_tools(tool_run):
    log = tool_run
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


def render(browser: str, page) -> str:
    """The DOM after the page's scripts ran, as headless chromium dumps it."""
    run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def test_a_headless_browser_renders_the_run_page_and_its_filter_works(tool_run, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium here (apt-get install chromium); the page is parsed by the test above")
    assert astrai(["report", str(tool_run)]) == 0
    text = (tool_run / "report.html").read_text()
    rows = Page(text).rows
    last = [r for r in rows if r["data-step"] == rows[-1]["data-step"]]
    dom = render(browser, tool_run / "report.html")
    assert Page(dom).panels["reward_mean"] >= 1 and len(Page(dom).rows) == len(rows) > len(last) > 0
    # the script ran on load: the newest step is selected, the other steps' rows hidden
    assert f"{len(last)} shown" in dom and dom.count('style="display: none;"') == len(rows) - len(last)

    def driven(step: str, minimum: float) -> str:  # the filter, set as a user would set it
        page = tmp_path / "driven.html"
        page.write_text(text.replace("</body>", "<script>document.addEventListener('DOMContentLoaded',()=>{"
                                     f"document.getElementById('f-step').value='{step}';"
                                     f"document.getElementById('f-min').value='{minimum}';filterTraces();}});"
                                     "</script></body>"))
        return render(browser, page)

    assert f"{len(rows)} shown" in driven("all", -1.0)
    top = max(float(r["data-reward"]) for r in rows)
    best = sum(float(r["data-reward"]) >= top for r in rows)
    assert f"{best} shown" in driven("all", top) and "0 shown" in driven("all", top + 1)
