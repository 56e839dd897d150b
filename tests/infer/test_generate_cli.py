"""`astrai generate`: one prompt to stdout, a JSONL file to a JSONL file, clear flag errors."""

from __future__ import annotations

import json

import pytest

from astrai.infer.generate import main
from tests.infer.conftest import tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    from astrai.model.hf import save_model

    out = tmp_path_factory.mktemp("gen_model")
    save_model(tiny_model(seed=7, vocab_size=320), out, tokenizer=tok)
    return out


def test_prompt_prints_the_completion(model_dir, tok, capsys):
    assert main(["--model", str(model_dir), "--prompt", "Hello", "--temperature", "0", "--max_tokens", "4",
                 "--ignore_eos", "--kv_cache_tokens", "256"]) == 0
    text = capsys.readouterr().out
    assert text.endswith("\n") and len(text) > 1


def test_jsonl_in_jsonl_out_with_chat(model_dir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    records = [{"prompt": "The quick", "id": 1}, {"messages": [{"role": "user", "content": "Hi"}], "id": 2}]
    src.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    argv = ["--model", str(model_dir), "--input_jsonl", str(src), "--output_jsonl", str(dst), "--chat",
            "--max_tokens", "3", "--n", "2", "--seed", "1", "--stop", "zz", "--kv_cache_tokens", "512"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["outputs"]) == 2 and r["completion"] == r["outputs"][0]["text"]
        assert all(o["finish_reason"] in ("stop", "length") for o in r["outputs"])


def test_bad_flags_fail_clearly(model_dir, capsys):
    with pytest.raises(SystemExit):
        main(["--model", str(model_dir), "--prompt", "x", "--temprature", "0"])
    assert "unrecognized arguments: --temprature" in capsys.readouterr().err
    assert main(["--model", str(model_dir), "--prompt", "x", "--top_p", "0"]) == 2
    assert "SamplingParams.top_p" in capsys.readouterr().err


def test_scheduling_and_compile_flags():
    from astrai.infer.generate import build_parser

    base = ["--model", "m", "--prompt", "x"]
    args = build_parser().parse_args(base + ["--compile", "--long_prefill_token_threshold", "32"])
    assert args.compile is True and args.long_prefill_token_threshold == 32 and args.max_num_batched_tokens is None
    assert build_parser().parse_args(base + ["--compile", "false"]).compile is False


def test_a_misspelled_model_directory_names_the_nearest_one(model_dir, capsys):
    typo = model_dir.parent / (model_dir.name + "x")
    assert main(["--model", str(typo), "--prompt", "hi"]) != 0
    err = capsys.readouterr().err
    assert f"--model '{typo}' is not a model directory (no config.json); did you mean {model_dir}?" in err
