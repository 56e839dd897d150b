"""`astrai serve` flags: loopback by default, the API key from the environment, engine flags."""

from __future__ import annotations

from astrai.serve.app import ServeConfig
from astrai.serve.cli import build_parser, main


def test_defaults_bind_loopback_and_read_the_key_from_env(monkeypatch):
    monkeypatch.setenv("ASTRAI_API_KEY", "from-env")
    args = build_parser().parse_args(["--model", "m"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, "from-env")
    monkeypatch.delenv("ASTRAI_API_KEY")
    assert build_parser().parse_args(["--model", "m"]).api_key is None


def test_engine_config_fields_are_flags():
    args = build_parser().parse_args(["--model", "m", "--max_model_len", "64", "--enable_prefix_caching", "false"])
    assert args.max_model_len == 64 and args.enable_prefix_caching is False
    args = build_parser().parse_args(["--model", "m", "--compile", "--max_num_batched_tokens", "256",
                                      "--long_prefill_token_threshold", "64"])
    assert args.compile is True and (args.max_num_batched_tokens, args.long_prefill_token_threshold) == (256, 64)


def test_model_name_is_the_directory_basename_unless_given(tmp_path):
    assert ServeConfig(str(tmp_path / "my-model")).model_name == "my-model"
    assert ServeConfig(str(tmp_path / "my-model"), served_model_name="alias").model_name == "alias"


def test_missing_model_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_engine_flags_parse_by_the_fields_type_never_by_the_text(capsys):
    """--engine_seed is an int field: "1.0" is refused naming the flag, the value and the fix (it
    once passed as the float 1.0); an optional field takes none, a str field keeps "1" a string."""
    import pytest

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--model", "m", "--engine_seed", "1.0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --engine_seed/--engine-seed: value '1.0' is not int; expected int (e.g. --engine_seed 1)" in err
    args = build_parser().parse_args(["--model", "m", "--engine_seed", "7", "--max_model_len", "none",
                                      "--dtype", "1", "--max_request_kv_share", "1"])
    assert (args.engine_seed, args.max_model_len, args.dtype, args.max_request_kv_share) == (7, None, "1", 1.0)
    assert type(args.max_request_kv_share) is float


def test_an_engine_that_cannot_be_built_exits_2_with_the_reason(model_dir, capsys):
    """The model loads after the socket is bound; an engine that cannot be built (a KV cache
    smaller than one block) stops the server, as a damaged model stops it before binding, instead of
    a server that answers 503 forever."""
    import os
    import signal
    import threading

    from tests.serve.live import GUARD_S

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    guard = threading.Timer(GUARD_S, os.kill, (os.getpid(), signal.SIGTERM))  # a server that stays up: stopped
    guard.start()
    try:  # main installs its own (no-op) handlers for uvicorn to re-raise into
        code = main(["--model", str(model_dir), "--port", "0", "--kv_cache_tokens", "5", "--log_level", "critical"])
    finally:
        guard.cancel()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("astrai serve: error: the model could not be loaded: the KV cache holds 5 tokens")
