"""Shared test setup: offline hub, deterministic torch, small thread count, the CPU matrix-product
library fixed for the whole session (the default, `auto`, as the CLI and the engine set it: so a
test sees the same kernels whichever tests ran before it), `cuda` tests skipped without a CUDA
device."""

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (cuda marker)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
