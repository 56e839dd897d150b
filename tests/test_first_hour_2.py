"""A new user's first hour, round 2: the tokenizer's shortfall advice and the demo's recipe, train
threads and progress lines, one-line `astrai eval` errors, a closed pipe, and small trust fixes
(serve.sh without Compose, a misplaced YAML section, a mistyped path, `ckpt latest`, the
over-long record's count, warmup past the run, flag suggestions, the demo's docs and report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from astrai.data.tasks import write_task_files
from astrai.data.tokenizer import load_tokenizer
from astrai.data.tokenizer_training import CHAT_ROLE_TEXT, train_tokenizer
from astrai.data.tokenizer_training import main as tokenizer_main

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ["--vocab_size", "300", "--hidden_size", "16", "--intermediate_size", "32", "--num_hidden_layers", "1",
              "--num_attention_heads", "2", "--num_key_value_heads", "1", "--max_position_embeddings", "64"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The demo's task files, small: corpus, SFT records, prompts, eval records."""
    out = tmp_path_factory.mktemp("first_hour")
    write_task_files(out / "data", tasks=("add",), digits=1, num_train=64, num_eval=8, num_corpus=200)
    train_tokenizer([out / "data" / "corpus.jsonl"], 300, out / "tok", chat_roles=True)
    return out


# ---------------------------------------------------------------------------- 1. tokenizer


def test_a_corpus_of_digits_has_nothing_to_merge_and_the_warning_says_so(task_dir, tmp_path, capsys):
    corpus = task_dir / "data" / "corpus.jsonl"
    assert tokenizer_main(["train", "--input", str(corpus), "--vocab_size", "300", "--out", str(tmp_path / "t")]) == 0
    err = capsys.readouterr().err
    assert "259 tokens, not the 300 asked: after 0 merges every piece the pre-tokenizer cut" in err
    assert "neither more of the same text nor a lower --min_frequency adds a token" in err
    assert "--chat_roles" in err and "train on more text" not in err  # the old advice was false here


def test_chat_roles_shorten_a_chat_record_as_the_demo_tokenizer_does(task_dir, tmp_path, capsys):
    corpus = task_dir / "data" / "corpus.jsonl"
    assert tokenizer_main(["train", "--input", str(corpus), "--chat_roles", "--vocab_size", "300",
                           "--out", str(tmp_path / "t")]) == 0
    assert "--chat_roles adds" not in capsys.readouterr().err  # already given: not advised again
    tok = load_tokenizer(tmp_path / "t")
    assert tok.encode("user") == tok.convert_tokens_to_ids(["user"]) and len(tok.encode("assistant")) == 2
    plain = train_tokenizer([corpus], 300)
    chat = [{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "7"}]
    assert (len(tok.apply_chat_template(chat)), len(plain.apply_chat_template(chat))) == (15, 25)
    # the demo's own recipe (texts, then the role names five times) gives the same tokenizer
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    demo = train_tokenizer(texts + [CHAT_ROLE_TEXT] * 5, 300)
    assert tok.backend.get_vocab() == demo.backend.get_vocab()


def test_a_pair_below_min_frequency_keeps_the_more_text_advice(capsys):
    train_tokenizer(["hello world", "hello there"], 512)
    err = capsys.readouterr().err
    assert "no pair of tokens occurs 2 or more times" in err and "lower --min_frequency" in err


# ---------------------------------------------------------------------------- 2, 3, 10. a tiny run's start lines


def _tiny_sft(task_dir: Path, tmp_path: Path, *extra: str) -> tuple[list[str], object]:
    from astrai.train.cli import main as train_main

    return ["--train_type", "sft", "--data_path", str(task_dir / "data" / "sft.jsonl"), "--tokenizer_path",
            str(task_dir / "tok"), "--max_seq_len", "32", "--batch_per_device", "4", "--ckpt_dir",
            str(tmp_path / "ckpt"), "--log_dir", str(tmp_path), "--ckpt_interval", "0", *TINY_MODEL, *extra], train_main


def test_train_sets_threads_before_the_build_prints_them_and_restores_the_callers(task_dir, tmp_path, capsys):
    argv, train_main = _tiny_sft(task_dir, tmp_path, "--max_steps", "4", "--warmup_steps", "10",
                                 "--progress", "false", "--threads", "1")
    before = torch.get_num_threads()
    seen = []
    import astrai.train.cli as cli

    real_run = cli.run

    def spy(cfg, ctx, threads_line=""):
        seen.append(torch.get_num_threads())  # what the model is built with
        return real_run(cfg, ctx, threads_line)

    cli.run = spy
    try:
        assert train_main(argv) == 0
    finally:
        cli.run = real_run
    err = capsys.readouterr().err
    assert seen == [1] and torch.get_num_threads() == before
    assert "threads: 1 (torch intra-op per rank; --num_threads)" in err
    # warmup past the run: one line at the start
    assert err.count("warning: warmup_steps 10 is more than the run's 4 optimizer steps") == 1
    # --progress false: periodic lines with step, loss, speed and an ETA, the last at the end
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/4 (25%): loss ") and "tok/s" in lines[0] and "eta " in lines[0]
    assert lines[-1].startswith("step 4/4 (100%): loss ") and "eta" not in lines[-1]


def test_the_cpu_default_is_one_thread_and_the_flag_has_one_spelling_everywhere(monkeypatch):
    from astrai.config import Config
    from astrai.train import cli

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    before = torch.get_num_threads()
    try:
        assert cli.set_threads(Config(), None).startswith(f"threads: {cli.DEFAULT_CPU_THREADS} (")
        assert torch.get_num_threads() == cli.DEFAULT_CPU_THREADS
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the local launcher's share of the cores for a rank
        assert cli.set_threads(Config(), None).startswith("threads: 2 (torch intra-op per rank; OMP_NUM_THREADS")
    finally:
        torch.set_num_threads(before)
    assert cli.main(["--num_threads", "0"]) == 2
    from astrai.serve.cli import build_parser as serve_parser

    assert serve_parser().parse_args(["--model", "m", "--threads", "1"]).num_threads == 1
    from astrai.demo import main as demo_main

    with pytest.raises(SystemExit):
        demo_main(["--threads", "0"])  # the alias answers, the error names the canonical spelling


# ---------------------------------------------------------------------------- 3. progress lines by steps


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _loop(step: int = 0, is_main: bool = True, **metrics: float) -> SimpleNamespace:
    return SimpleNamespace(is_main=is_main, ctx=SimpleNamespace(step=step), step_metrics=metrics)


def test_progress_lines_every_tenth_of_the_run_and_after_a_silent_minute(capsys):
    from astrai.train.callbacks import ProgressBar

    clock = FakeClock()
    bar = ProgressBar(100, bar=False, clock=clock)
    loop = _loop(0, loss=1.0, lr=1e-3, tokens_per_s=4912.0)
    bar.on_train_begin(loop)
    for step in range(1, 101):
        clock.now += 1.0 if step != 55 else 61.0  # one slow step: a line although 55 is no tenth
        loop.ctx.step = step
        bar.after_optimizer_step(loop)
    lines = capsys.readouterr().err.splitlines()
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [10, 20, 30, 40, 50, 55, 60, 70, 80, 90, 100]
    assert lines[0] == "step 10/100 (10%): loss 1.0000, 4,912 tok/s, 0:10 elapsed, eta 1:30"


def test_progress_lines_show_the_reward_and_only_rank_0_prints(capsys):
    from astrai.train.callbacks import ProgressBar

    bar = ProgressBar(4, bar=False, clock=FakeClock())
    for rank0 in (False, True):
        loop = _loop(0, is_main=rank0, loss=0.5, lr=1e-4, reward_mean=0.516, rollout_tokens_per_s=900.0)
        bar.on_train_begin(loop)
        loop.ctx.step = 4
        bar.after_optimizer_step(loop)
    assert capsys.readouterr().err.splitlines() == [
        "step 4/4 (100%): loss 0.5000, reward 0.516, 900 rollout tok/s, 0:00 elapsed"]


# ---------------------------------------------------------------------------- 4. astrai eval errors


@pytest.fixture(scope="module")
def model_dir(task_dir) -> Path:
    from astrai.model import CausalLM, ModelConfig
    from astrai.model.hf import save_model

    tok = load_tokenizer(task_dir / "tok")
    config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         eos_token_id=tok.eos_token_id)
    return save_model(CausalLM(config, seed=0), task_dir / "model", tokenizer=tok)


def _eval(args: list[str], capsys) -> tuple[int, str, str]:
    from astrai.eval.cli import main as eval_main

    code = eval_main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_of_a_damaged_model_is_one_line(model_dir, tmp_path, capsys, task_dir):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    size = (damaged / "model.safetensors").stat().st_size
    (damaged / "manifest.json").write_text(json.dumps({
        "format": "astrai-checkpoint", "version": 1, "step": 1,
        "files": {"model.safetensors": {"size": size + 7, "sha256": "0" * 64}}}))
    code, _, err = _eval(["--model", str(damaged), "--data", str(task_dir / "data" / "eval.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "model.safetensors" in err and "Traceback" not in err


def test_eval_skips_and_counts_an_over_long_prompt(model_dir, tmp_path, capsys, task_dir):
    records = [json.loads(line) for line in (task_dir / "data" / "eval.jsonl").read_text().splitlines()][:3]
    records[1]["messages"][-1]["content"] = "1+2 " * 40  # longer than max_model_len 32
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = _eval(["--model", str(model_dir), "--data", str(data), "--max_tokens", "4"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["num_total"] == 3 and result["num_skipped"] == 1 and len(result["samples"]) == 2
    assert "skipped 1 of 3 prompts" in err and "max_model_len 32" in err


def test_eval_names_the_file_and_line_of_broken_json(model_dir, tmp_path, capsys, task_dir):
    good = (task_dir / "data" / "eval.jsonl").read_text().splitlines()[0]
    data = tmp_path / "eval.jsonl"
    data.write_text(f"{good}\n\n{{\"messages\": [\n")
    code, _, err = _eval(["--model", str(model_dir), "--data", str(data)], capsys)
    assert code == 2 and f"{data}:3: not valid JSON" in err and err.count("\n") == 1
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "1+1=2"}\n{"text": \n')
    code, _, err = _eval(["--model", str(model_dir), "--perplexity", str(docs)], capsys)
    assert code == 2 and f"{docs}:2: not valid JSON" in err


@pytest.mark.parametrize("args", [["--help"], ["eval", "--model", "MODEL", "--data", "DATA"]])
def test_output_into_a_closed_pipe_ends_quietly(args, model_dir, task_dir):
    args = [str(model_dir) if a == "MODEL" else str(task_dir / "data" / "eval.jsonl") if a == "DATA" else a
            for a in args]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes a byte: `| head` that already quit
    try:
        done = subprocess.run([sys.executable, "-m", "astrai", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


# ---------------------------------------------------------------------------- 5. smaller


def test_serve_sh_says_when_the_compose_plugin_is_missing(tmp_path):
    from tests.ops.fakes import base_env, calls, run_script

    env = base_env(tmp_path)
    docker = Path(env["PATH"].split(os.pathsep)[0]) / "docker"
    docker.write_text(docker.read_text() + (
        "if sys.argv[1:2] == ['compose']:\n"
        "    print(\"unknown shorthand flag: 'f' in -f\", file=sys.stderr)\n"
        "    sys.exit(125)\n"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = run_script("serve.sh", ["--model", str(model), "up"], env, tmp_path)
    assert r.returncode == 1 and "the Compose plugin is missing" in r.stderr and "shorthand" not in r.stderr
    assert [c["argv"][:2] for c in calls(tmp_path)] == [["compose", "version"]]  # never `compose -f ... up`


def test_a_misplaced_optimizer_section_suggests_optim(tmp_path):
    from astrai.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("optimizer:\n  max_lr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"unknown config section 'optimizer'; did you mean 'optim'\?"):
        load_config(str(path), [])
    path.write_text("optimizer: muon\n")  # the flat key at the top level still works
    assert load_config(str(path), []).optim.optimizer == "muon"


def test_a_mistyped_local_path_is_missing_not_a_hub_id(tmp_path, monkeypatch):
    from astrai.model import hub
    from astrai.model.manifest import model_argument

    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub, "_offline", lambda: pytest.fail("looked up on the Hub"))
    with pytest.raises(FileNotFoundError, match="'out/ckptt' does not exist: there is a local folder 'out'"):
        model_argument("out/ckptt", "astrai eval")
    assert hub.is_hub_id("org/name")  # a Hub id whose org is no local folder is still one


def test_ckpt_latest_of_an_empty_folder_says_no_checkpoint(tmp_path, capsys):
    from astrai.train.ckpt_cli import main as ckpt_main

    assert ckpt_main(["latest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no checkpoint in {tmp_path} (no step_* directory in it)" in err and "--resume" not in err


def test_an_over_long_sft_record_warning_gives_its_real_length(task_dir):
    from astrai.data.records import RecordError, encode_record

    tok = load_tokenizer(task_dir / "tok")
    record = {"messages": [{"role": "user", "content": "1+1 " * 30}, {"role": "assistant", "content": "2"}]}
    num_tokens = len(tok.encode_chat(record["messages"])[0])
    with pytest.raises(RecordError, match=f"record has {num_tokens} tokens, over max_seq_len 16"):
        encode_record(record, "sft", tok, 16)
    assert num_tokens > 16


def test_warmup_warning_only_past_the_run():
    from astrai.config import OptimConfig
    from astrai.train.optim import warmup_warning

    assert warmup_warning(OptimConfig(warmup_steps=10), 10) is None
    assert "ends at 50% of max_lr" in warmup_warning(OptimConfig(warmup_steps=20), 10)


@pytest.mark.parametrize("module, argv, nearest", [
    ("astrai.infer.generate", ["--model", "m", "--prompt", "hi", "--max_tokns", "5"], "--max_tokens"),
    ("astrai.serve.cli", ["--model", "m", "--prot", "8000"], "--port"),
])
def test_serve_and_generate_suggest_the_nearest_flag(module, argv, nearest, capsys):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).build_parser().parse_args(argv)
    assert f"did you mean {nearest}?" in capsys.readouterr().err


def test_operations_doc_states_the_demos_real_flags_and_task():
    from astrai.demo import BUDGET_MINUTES, TASK

    text = (ROOT / "docs" / "operations.md").read_text()
    assert f"[--minutes {BUDGET_MINUTES:g}]" in text and f"({TASK['digits']}-digit addition)" in text


def test_the_reports_budget_line_is_not_a_run_time(tmp_path):
    from astrai.demo import write_report

    ev = {"accuracy": 0.5, "num_correct": 1, "num_total": 2, "tokens_per_s": 1.0, "samples": []}
    stages = {name: {"seconds": 1.0} for name in ("data", "tokenizer", "pretrain", "sft")}
    stages["eval"] = {"pretrained": ev, "sft": ev, "seconds": 1.0}
    stages["rl-grpo"] = {"eval": ev, "seconds": 1.0}
    text = write_report(tmp_path, stages, 8.0, "grpo").read_text()
    assert "Step budget: --minutes 8 (scales the training steps" in text and "Budget: 8.0 min" not in text
