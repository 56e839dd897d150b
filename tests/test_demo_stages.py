"""The demos' stage runner: a stage cut short by a signal is never marked finished."""

from __future__ import annotations

import os
import signal

import pytest

from astrai.demo_stages import run_stage, stage_done
from astrai.train import signals


def test_a_stage_stopped_by_a_signal_is_not_marked_finished(tmp_path):
    """`astrai train` answers SIGTERM / Ctrl-C with a checkpoint and exit 0; the demo must not then
    publish the half-trained stage as finished (a re-run would reuse it) nor go on to the next."""
    logs: list[str] = []
    signals.install_signal_handlers()
    try:
        def stage() -> dict:
            os.kill(os.getpid(), signal.SIGTERM)
            while signals.last_signal() is None:  # the handler runs at the next bytecode boundary
                pass
            return {"steps": 3}

        with pytest.raises(SystemExit) as stopped:
            run_stage("sft", tmp_path / "sft", stage, logs.append)
        assert stopped.value.code == 128 + signal.SIGTERM
        assert stage_done(tmp_path / "sft") is None
        assert "stopped by SIGTERM" in logs[-1] and "run the demo again" in logs[-1]
    finally:
        signals.uninstall_signal_handlers()
    assert run_stage("sft", tmp_path / "sft", lambda: {"steps": 3}, logs.append)["steps"] == 3
    assert stage_done(tmp_path / "sft")["steps"] == 3


def test_final_is_published_with_a_manifest_and_a_damaged_one_never_loads(tmp_path, capsys):
    """A stage's `final/` model directory carries the manifest of the checkpoint it came from; a
    byte flipped in its weights is refused at load and by `astrai ckpt verify`."""
    from astrai.demo_stages import publish_final
    from astrai.model import CausalLM, ModelConfig
    from astrai.model.hf import load_model, save_model
    from astrai.model.hf_config import HFFormatError
    from astrai.model.manifest import ManifestError, read_manifest
    from astrai.train.ckpt_cli import main as ckpt_main
    from astrai.train.publish import publish

    model = CausalLM(ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32), seed=0)
    publish(tmp_path / "ckpt", 7, lambda d: save_model(model, d))
    final = publish_final(tmp_path / "ckpt", tmp_path / "final")
    manifest = read_manifest(final)
    assert manifest["step"] == 7 and {"config.json", "model.safetensors"} <= set(manifest["files"])
    assert load_model(final).config.hidden_size == 16
    assert ckpt_main(["verify", str(final)]) == 0
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises((ManifestError, HFFormatError, ValueError), match="model.safetensors"):
        load_model(final)
    capsys.readouterr()
    assert ckpt_main(["verify", str(final)]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert publish_final(tmp_path / "ckpt", tmp_path / "final") == final  # published again over the damaged copy
    assert load_model(final).config.hidden_size == 16
