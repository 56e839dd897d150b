"""`astrai eval` end to end: --tasks writes lm-eval's results dict and prints its table;
--perplexity reports the adapter's rolling log-likelihood; errors are one line, exit 2."""

from __future__ import annotations

import builtins
import json
import math

import pytest

from astrai.cli import main as astrai_main
from tests.eval.conftest import long_text

lm_eval = pytest.importorskip("lm_eval")


def test_tasks_write_the_results_dict_and_print_the_table(model_dir, task_dir, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = astrai_main(["eval", "--model", str(model_dir), "--tasks", "tiny_mc,tiny_gen", "--include_path",
                        str(task_dir), "--limit", "4", "--output", str(out), "--seed", "3"])
    printed = capsys.readouterr().out
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results["results"]) == {"tiny_mc", "tiny_gen"}
    assert 0.0 <= results["results"]["tiny_mc"]["acc,none"] <= 1.0
    assert results["config"]["random_seed"] == 3 and "samples" not in results
    assert "tiny_mc" in printed and "acc" in printed and "|" in printed  # lm-eval's markdown table
    assert "tiny_gen" in printed and "exact_match" in printed


def test_log_samples_keeps_every_request(model_dir, task_dir, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert astrai_main(["eval", "--model", str(model_dir), "--tasks", "tiny_mc", "--include_path", str(task_dir),
                        "--limit", "2", "--output", str(out), "--log_samples"]) == 0
    samples = json.loads(out.read_text())["samples"]["tiny_mc"]
    assert len(samples) == 2 and all(len(s["resps"]) == 4 for s in samples)  # four choices each


def test_unknown_task_is_one_line_naming_include_path_and_a_damaged_yaml_in_it(model_dir, task_dir, tmp_path, capsys):
    import shutil

    shutil.copytree(task_dir, tmp_path / "tasks")  # lm-eval skips a YAML it cannot parse without a word
    (tmp_path / "tasks" / "gen.yaml").write_text("task: tiny_gen\ndataset_path: json\n  test_split: [test\n")
    code = astrai_main(["eval", "--model", str(model_dir), "--tasks", "tiny_mc,no_such_task_xyz,tiny_gen",
                        "--include_path", str(tmp_path / "tasks")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "no_such_task_xyz" in err and "--include_path" in err and "Tasks not found" in err
    assert "Tasks not found: no_such_task_xyz, tiny_gen" in err
    assert f"{tmp_path / 'tasks' / 'gen.yaml'} is not valid YAML" in err and "line 3" in err


def test_a_misspelled_task_names_the_nearest_one(model_dir, task_dir, capsys):
    code = astrai_main(["eval", "--model", str(model_dir), "--tasks", "tiny_mcc", "--include_path", str(task_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert "Tasks not found: tiny_mcc" in err and "tiny_mcc: did you mean tiny_mc?" in err


def test_without_lm_eval_the_message_says_how_to_install_it(model_dir, monkeypatch, capsys):
    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    assert astrai_main(["eval", "--model", str(model_dir), "--tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'astrai eval: lm-eval is not installed; install the eval extra: pip install -e ".[eval]"'


def test_modes_are_mutually_exclusive(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        astrai_main(["eval", "--model", str(model_dir), "--tasks", "x", "--data", str(tmp_path / "d.jsonl")])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        astrai_main(["eval", "--model", str(model_dir)])
    assert "one of the arguments" in capsys.readouterr().err


def test_perplexity_equals_the_adapters_rolling_loglikelihood(model_dir, astrai_lm, tmp_path, capsys):
    from lm_eval.api.instance import Instance

    texts = [long_text(30, 7), long_text(160, 8)]  # the second spans several 64-token windows
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert astrai_main(["eval", "--model", str(model_dir), "--perplexity", str(data)]) == 0
    report = json.loads(capsys.readouterr().out)
    rolling = astrai_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i)
                                               for i, t in enumerate(texts)])
    num_tokens = sum(len(astrai_lm.tok_encode(t)) for t in texts)
    num_bytes = sum(len(t.encode()) for t in texts)
    assert report["num_tokens"] == num_tokens and report["num_bytes"] == num_bytes
    assert abs(report["loglikelihood"] - sum(rolling)) < 1e-4
    assert math.isclose(report["nats_per_token"], -sum(rolling) / num_tokens, rel_tol=1e-6, abs_tol=1e-6)
    assert math.isclose(report["perplexity"], math.exp(report["nats_per_token"]), rel_tol=1e-9)
    assert math.isclose(report["bits_per_byte"], -sum(rolling) / num_bytes / math.log(2), rel_tol=1e-5)


def test_perplexity_of_a_plain_text_file_and_bad_records(model_dir, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text(long_text(20, 9))
    assert astrai_main(["eval", "--model", str(model_dir), "--perplexity", str(text)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_documents"] == 1 and report["perplexity"] > 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "no text field"}) + "\n")
    assert astrai_main(["eval", "--model", str(model_dir), "--perplexity", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bad.jsonl:1" in err and "'text'" in err


def test_the_core_package_does_not_import_lm_eval():
    import subprocess
    import sys

    code = ("import sys, astrai, astrai.cli, astrai.eval, astrai.eval.cli, astrai.eval.perplexity; "
            "assert 'lm_eval' not in sys.modules, 'lm_eval imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


def _eval(args: list[str], capsys) -> tuple[int, str, str]:
    from astrai.eval.cli import main as eval_main

    code = eval_main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_of_a_damaged_model_is_one_line(addition_model_dir, tmp_path, capsys, addition_task_dir):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(addition_model_dir, damaged)
    size = (damaged / "model.safetensors").stat().st_size
    (damaged / "manifest.json").write_text(json.dumps({
        "format": "astrai-checkpoint", "version": 1, "step": 1,
        "files": {"model.safetensors": {"size": size + 7, "sha256": "0" * 64}}}))
    code, _, err = _eval(["--model", str(damaged), "--data", str(addition_task_dir / "data" / "eval.jsonl")], capsys)
    assert code == 2 and err.count("\n") == 1 and "model.safetensors" in err and "Traceback" not in err


def test_eval_skips_and_counts_an_over_long_prompt(addition_model_dir, tmp_path, capsys, addition_task_dir):
    records = [json.loads(line) for line in (addition_task_dir / "data" / "eval.jsonl").read_text().splitlines()][:3]
    records[1]["messages"][-1]["content"] = "1+2 " * 40  # longer than max_model_len 32
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, err = _eval(["--model", str(addition_model_dir), "--data", str(data), "--max_tokens", "4"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert result["num_total"] == 3 and result["num_skipped"] == 1 and len(result["samples"]) == 2
    assert "skipped 1 of 3 prompts" in err and "max_model_len 32" in err


def test_eval_names_the_file_and_line_of_broken_json(addition_model_dir, tmp_path, capsys, addition_task_dir):
    good = (addition_task_dir / "data" / "eval.jsonl").read_text().splitlines()[0]
    data = tmp_path / "eval.jsonl"
    data.write_text(f"{good}\n\n{{\"messages\": [\n")
    code, _, err = _eval(["--model", str(addition_model_dir), "--data", str(data)], capsys)
    assert code == 2 and f"{data}:3: not valid JSON" in err and err.count("\n") == 1
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"text": "1+1=2"}\n{"text": \n')
    code, _, err = _eval(["--model", str(addition_model_dir), "--perplexity", str(docs)], capsys)
    assert code == 2 and f"{docs}:2: not valid JSON" in err


def test_an_unknown_role_in_data_is_one_line_naming_the_file_and_record(addition_model_dir, tmp_path, capsys,
                                                                        addition_task_dir):
    records = [json.loads(line) for line in (addition_task_dir / "data" / "eval.jsonl").read_text().splitlines()][:2]
    records[1]["messages"][0]["role"] = "robot"
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, _, err = _eval(["--model", str(addition_model_dir), "--data", str(data)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{data}: eval record 2 cannot be rendered" in err and "unknown role robot" in err


@pytest.mark.parametrize("mode, name", [("--data", "eval.jsonl"), ("--perplexity", "docs.jsonl"),
                                        ("--perplexity", "doc.txt")])
def test_a_binary_input_file_is_one_line_naming_it(addition_model_dir, tmp_path, capsys, mode, name):
    path = tmp_path / name
    path.write_bytes(b"\n" + bytes(range(128, 256)) + b"\n")  # line 2: no UTF-8
    code, _, err = _eval(["--model", str(addition_model_dir), mode, str(path)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{path}:2: not UTF-8 text (byte 0x80" in err


@pytest.mark.parametrize("answer", ["", None])
def test_answers_that_are_all_empty_warn_that_nothing_can_be_scored(addition_model_dir, tmp_path, capsys,
                                                                    addition_task_dir, answer):
    records = [json.loads(line) for line in (addition_task_dir / "data" / "eval.jsonl").read_text().splitlines()][:2]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({**r, "answer": answer}) + "\n" for r in records))
    code, out, err = _eval(["--model", str(addition_model_dir), "--data", str(data), "--max_tokens", "2"], capsys)
    assert code == 0 and json.loads(out)["num_total"] == 2
    assert f"every 'answer' of the 2 records of {data} is empty or null, so no reply can be scored" in err


@pytest.mark.parametrize("choices, found", [([], "no choices"), (0, "0")])
def test_a_multiple_choice_document_without_choices_is_one_line(model_dir, tmp_path, capsys, choices, found):
    from tests.eval.conftest import MC_YAML, mc_records

    rows = mc_records(3)
    rows[1]["choices"] = choices
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "mc.yaml").write_text(MC_YAML.format(data=tmp_path / "mc.jsonl"))
    code = astrai_main(["eval", "--model", str(model_dir), "--tasks", "tiny_mc", "--include_path", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("astrai eval: lm-eval task tiny_mc: document 1 has "), err
    assert f"has {found} from doc_to_choice" in err

