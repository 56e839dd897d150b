"""A model's own sampling defaults, applied the way vLLM applies them.

A model directory's `generation_config.json` may carry the sampling its authors recommend
(`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`). With `--generation_config auto`
(the default of `astrai generate`, `astrai chat` and `astrai serve`, as in vLLM) those values fill
every field a request leaves unset; `none` ignores them (SamplingParams' own defaults apply);
a directory path reads the file from there instead. The caller then builds `SamplingParams`
from the merged fields, so a value the user sets always wins.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astrai.model.hf_dir import load_generation_defaults

# generation_config.json name -> SamplingParams field (vLLM applies the same five)
DEFAULT_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty"}
GENERATION_CONFIG_HELP = ("'auto' (default): unset sampling fields take the model's generation_config.json "
                          "values; 'none': SamplingParams' own defaults; or a directory holding a "
                          "generation_config.json")


def generation_defaults(model_dir: str | Path, generation_config: str = "auto") -> dict[str, Any]:
    """SamplingParams fields from the generation_config.json that `generation_config` selects."""
    if generation_config == "none":
        return {}
    source = Path(model_dir if generation_config == "auto" else generation_config)
    if generation_config != "auto" and not (source / "generation_config.json").is_file():
        raise ValueError(f"--generation_config {generation_config!r}: expected 'auto', 'none' or a directory "
                         "holding a generation_config.json")
    found = load_generation_defaults(source)
    return {field: found[name] for name, field in DEFAULT_FIELDS.items() if name in found}


def with_defaults(fields: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`fields` (None = unset) with the unset ones taken from `defaults`; still-unset ones dropped,
    so SamplingParams' own defaults apply to them."""
    merged = {k: v for k, v in defaults.items() if fields.get(k) is None}
    merged.update({k: v for k, v in fields.items() if v is not None})
    return merged


def describe(defaults: dict[str, Any]) -> str:
    """One line for the log: which defaults came from the model."""
    shown = ", ".join(f"{k}={v}" for k, v in defaults.items())
    return f"sampling defaults from generation_config.json: {shown} (--generation_config none to ignore)"
