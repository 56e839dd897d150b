"""Hugging Face Hub ids -> local model directories, through the user's Hub cache.

The first step of every loader that takes a model by name: `astrai generate/chat/serve/eval
--model`, the train config's `param_path`, `tokenizer_path`, `ref_model_path` and
`critic_model_path`, and a LoRA adapter's base. A path that exists locally is always returned as
it is (a local path wins), and a missing one under an existing local folder (`out/ckptt`) is an
error naming the path, never a Hub lookup; otherwise a name shaped like a Hub id (`org/name`, optionally
`org/name@revision`) is resolved by `huggingface_hub.snapshot_download`, which reads the cache
first (`HF_HOME` / `HF_HUB_CACHE`) and honours `HF_HUB_OFFLINE`. Anything else is returned
unchanged, so the caller's own "not a model directory" error still names it. `huggingface_hub`
is not a dependency of astrai: it is imported only when a Hub id is given.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name as the Hub spells repository ids (no leading dot or dash, no "..", at most 96 chars)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}(@[\w./-]+)?$")
# the files a model directory needs; weights in other formats (.bin, .gguf, onnx) are not fetched
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


class HubError(FileNotFoundError):
    """A Hub id that cannot be turned into a local directory; the message names the id and the fix."""


def is_hub_id(name: str) -> bool:
    """True for a string shaped like `org/name` (or `org/name@revision`) that is not a local path."""
    text = str(name)
    return bool(_HUB_ID.match(text)) and ".." not in text and not Path(text).exists()


def resolve_model_path(name: str | os.PathLike, what: str = "--model") -> str:
    """A local directory for `name`: the path itself when it exists, a Hub id's cached snapshot
    (downloaded when online and not cached), else `name` unchanged. `what` names the flag or
    config field in error messages."""
    text = str(name)
    if not is_hub_id(text):
        return text
    first = text.split("/", 1)[0]
    if Path(first).is_dir():  # `out/ckptt`: a mistyped path under a local folder, not an org on the Hub
        raise HubError(f"{what} {text!r} does not exist: there is a local folder {first!r} but nothing named "
                       f"{text.split('/', 1)[1]!r} in it; check the path (a Hub id whose org is also a local "
                       "folder name: run from another directory)")
    repo_id, _, revision = text.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise HubError(f"{what} {text!r} is not a local path, and loading it as a Hugging Face Hub id needs the "
                       "huggingface_hub package: pip install huggingface_hub (or give a local model directory)"
                       ) from None
    try:
        return snapshot_download(repo_id, revision=revision or None, allow_patterns=MODEL_FILES)
    except LocalEntryNotFoundError:
        if _offline():
            raise HubError(f"{what} {text!r} is not a local path and not in the Hugging Face cache "
                           f"({_cache_dir()}), and HF_HUB_OFFLINE is set; download it first with "
                           f"`hf download {repo_id}` (huggingface-cli download {repo_id}) on a machine with "
                           "network access, point HF_HUB_CACHE at a cache that holds it, or unset HF_HUB_OFFLINE"
                           ) from None
        raise HubError(f"{what} {text!r} is not a local path, not in the Hugging Face cache ({_cache_dir()}), "
                       "and the Hub could not be reached; check the network, or download it with "
                       f"`hf download {repo_id}` where the Hub is reachable") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} {text!r} is not a local path, and the Hugging Face Hub has no model {repo_id!r} "
                       "(or it is private: log in with `hf auth login`); check the spelling") from None
    except HFValidationError as e:
        raise HubError(f"{what} {text!r} is neither a local path nor a valid Hub id: {e}") from None
    except Exception as e:  # RevisionNotFoundError, HTTP errors: keep the cause, name the id
        raise HubError(f"{what} {text!r}: fetching it from the Hugging Face Hub failed "
                       f"({type(e).__name__}: {e})") from None


def _offline() -> bool:
    from huggingface_hub import constants  # read at call time, as snapshot_download reads it

    return bool(constants.HF_HUB_OFFLINE)


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)
