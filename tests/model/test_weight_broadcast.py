"""The broadcast weight transport's shared half (model/weight_broadcast.py), on the CPU: the backend
choice (NCCL only when the trainer and every server are on CUDA with NCCL), where tensors sit on the
wire (device memory for NCCL, checked on the meta device; the host for gloo), and a gloo group of two
ranks in threads: a tensor crosses it, and a rank that never comes is one clear line within the
timeout, at the rendezvous and in the broadcast, never a hang."""

from __future__ import annotations

import threading

import pytest
import torch

from astrai.model import weight_broadcast as wb
from tests.serve.conftest import free_port

GUARD_S = 30.0  # a bound against a hang, never a measured duration


def test_nccl_only_when_every_end_is_on_cuda_with_nccl():
    both = ["gloo", "nccl"]
    assert wb.choose_backend("cuda:0", [both, both], nccl=True) == "nccl"
    assert wb.choose_backend("cuda:1", [both, ["gloo"]], nccl=True) == "gloo"  # one server on the CPU
    assert wb.choose_backend("cpu", [both], nccl=True) == "gloo"  # the trainer on the CPU
    assert wb.choose_backend("cuda:0", [both], nccl=False) == "gloo"  # a torch without NCCL
    assert wb.choose_backend("cuda:0", [both, both], nccl=True, gpus=["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    assert wb.choose_backend("cuda:0", [both], nccl=True, gpus=["GPU-a", "GPU-a"]) == "gloo"  # one GPU, two ranks
    assert wb.backends_here("cpu") == ["gloo"] and wb.gpu_id("cpu") is None


def test_backends_here_offers_nccl_for_cuda_weights(monkeypatch):
    monkeypatch.setattr(wb, "nccl_available", lambda: True)
    assert wb.backends_here("cuda:0") == ["gloo", "nccl"] and wb.backends_here("cpu") == ["gloo"]
    monkeypatch.setattr(wb, "nccl_available", lambda: False)
    assert wb.backends_here("cuda:0") == ["gloo"]


def test_tensors_stay_on_the_device_for_nccl_and_go_through_the_host_for_gloo():
    assert wb.wire_device("nccl", "cuda:1") == torch.device("cuda:1")
    assert wb.wire_device("gloo", "cuda:1") == torch.device("cpu")
    on_device = torch.empty(4, 3, device="meta")  # stands for CUDA memory: any copy to the host would fail
    assert wb.send_view(on_device, "nccl").device.type == "meta"
    assert wb.receive_buffer((4, 3), torch.bfloat16, "meta", "nccl").device.type == "meta"
    received = wb.receive_buffer((4, 3), torch.bfloat16, "meta", "gloo")
    assert received.device.type == "cpu" and received.dtype == torch.bfloat16 and received.shape == (4, 3)
    host = torch.randn(4, 3)
    assert wb.send_view(host, "gloo").data_ptr() == host.data_ptr()  # a host tensor is sent as it is
    sent = wb.send_view(host.t(), "gloo")
    assert sent.is_contiguous() and torch.equal(sent, host.t())
    assert wb.wire_dtype("bfloat16") is torch.bfloat16 and wb.dtype_name(torch.float16) == "float16"
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        wb.wire_dtype("int8")


def _pair(timeout_s: float) -> list:
    port, groups = free_port(), [None, None]

    def join(rank: int) -> None:
        groups[rank] = wb.open_group("gloo", "127.0.0.1", port, rank, 2, timeout_s)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD_S)
    assert all(g is not None for g in groups)
    return groups


def test_a_gloo_pair_carries_a_tensor_and_a_missing_rank_is_one_line():
    sender, receiver = _pair(timeout_s=1.0)
    sent, got = torch.arange(6.0).view(2, 3), torch.zeros(2, 3)
    receiving = threading.Thread(target=wb.broadcast, args=(receiver, got, GUARD_S), daemon=True)
    receiving.start()
    wb.broadcast(sender, sent, GUARD_S)
    receiving.join(GUARD_S)
    assert torch.equal(got, sent)
    with pytest.raises(wb.WeightBroadcastError, match="gloo broadcast") as err:  # nobody receives
        wb.broadcast(sender, torch.ones(4), 1.0)
    assert "\n" not in str(err.value)
    with pytest.raises(wb.WeightBroadcastError, match=r"forming the gloo weight group at 127.0.0.1:\d+ as rank 0 of 2"):
        wb.open_group("gloo", "127.0.0.1", free_port(), 0, 2, 1.0)  # the other rank never comes
    with pytest.raises(ValueError, match="'mpi' is not one of gloo, nccl"):
        wb.open_group("mpi", "127.0.0.1", 1, 0, 2, 1.0)


def test_first_line_drops_the_cpp_location():
    exc = RuntimeError("[/w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                       "[127.0.0.1]:53157.\nException raised from ...\nframe #0")
    assert wb.first_line(exc) == "Connection closed by peer [127.0.0.1]:53157."
