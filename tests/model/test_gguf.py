"""`astrai convert --gguf`: clear errors when the GGUF toolchain or the file is missing.
(The real conversion runs in `make real-model`; tests/model/test_real_model.py checks its output.)"""

from __future__ import annotations

import importlib.util

from astrai.model import gguf


def test_missing_gguf_package_is_a_clear_error(tmp_path, monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert gguf.main(["--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "['gguf']" in err and "pip install gguf" in err
    assert not (tmp_path / "out").exists()


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert gguf.main(["--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "out")]) == 1
    assert "nope.gguf: no such file" in capsys.readouterr().err


def test_cli_dispatches_convert(capsys):
    from astrai.cli import main

    try:
        main(["convert", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "--gguf" in capsys.readouterr().out


def test_generation_defaults_from_the_command_line(tmp_path, capsys):
    assert gguf.parse_generation_defaults(["temperature=0.2", "top_p=0.9", "do_sample=true"]) == \
        {"temperature": 0.2, "top_p": 0.9, "do_sample": True}
    assert gguf.main(["--gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "o"),
                      "--generation", "temprature=0.2"]) == 1
    assert "expected KEY=VALUE with KEY one of do_sample, temperature" in capsys.readouterr().err
