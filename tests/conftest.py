"""Shared test setup: offline hub, deterministic torch, small thread count, the CPU matrix-product
library fixed for the whole session (the default, `auto`, as the CLI and the engine set it: so a
test sees the same kernels whichever tests ran before it), `cuda` tests skipped without a CUDA
device; and the small addition task (files, tokenizer, a random model) that tests of several
layers read."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from astrai.model.matmul import set_cpu_matmul  # noqa: E402

set_cpu_matmul("auto")


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)
    yield


# The longest tests (about 100 s, 100 s, 60 s and 45 s alone on the 2-core machine) run first, so
# none started late holds the run open. `make test`'s two workers (xdist's `--dist worksteal`) each
# start with one half of the list, so the second longest heads the second half: the two longest
# start together, each with a core of its own, rather than later beside tests that start several
# processes of their own.
LONGEST_FIRST = ("tests/test_tour.py::test_readme_tour", "tests/test_demo_tools.py::test_tools_demo",
                 "tests/test_demo.py::test_demo_sft", "tests/train/test_run_builder.py::test_compile")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: every other test keeps its collection order
    if len(items) > 4 and rank(items[1]) == 1:
        items.insert(len(items) // 2, items.pop(1))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cuda marker)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def addition_task_dir(tmp_path_factory):
    """The demo's task files, small (1-digit addition: corpus, SFT records, prompts, eval records),
    and a chat-role tokenizer trained on the corpus in `tok/`."""
    from astrai.data.tasks import write_task_files
    from astrai.data.tokenizer_training import train_tokenizer

    out = tmp_path_factory.mktemp("addition_task")
    write_task_files(out / "data", tasks=("add",), digits=1, num_train=64, num_eval=8, num_corpus=200)
    train_tokenizer([out / "data" / "corpus.jsonl"], 300, out / "tok", chat_roles=True)
    return out


@pytest.fixture(scope="session")
def addition_model_dir(addition_task_dir):
    """A random 1-layer model with max_model_len 32 and the addition task's tokenizer."""
    from astrai.data.tokenizer import load_tokenizer
    from astrai.model import CausalLM, ModelConfig
    from astrai.model.hf import save_model

    tok = load_tokenizer(addition_task_dir / "tok")
    config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         eos_token_id=tok.eos_token_id)
    return save_model(CausalLM(config, seed=0), addition_task_dir / "model", tokenizer=tok)
