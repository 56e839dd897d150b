"""`astrai.model.matmul`: float32 CPU matrix products through oneDNN, everything else through BLAS.

Which kernel ran is read from the profiler (`mkldnn::_linear_pointwise` or not), so a test fails
if the routing silently stops; values are checked against float64 products at float32 tolerance."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from astrai.config import load_config
from astrai.config_values import ConfigError
from astrai.model import matmul

pytestmark = pytest.mark.skipif(not matmul.onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.fixture()
def onednn():
    before = matmul.current_cpu_matmul()
    assert matmul.set_cpu_matmul("onednn") == "onednn"
    yield
    matmul.set_cpu_matmul("auto" if before == "onednn" else "blas")


def kernels(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 2e-6 * scale


def test_functional_products_go_to_onednn_with_float32_accuracy(onednn) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 256, generator=g), torch.randn(256, 80, generator=g)
    bias, c = torch.randn(80, generator=g), torch.randn(96, 80, generator=g)
    want = a.double() @ b.double()
    assert "mkldnn::_linear_pointwise" in kernels(lambda: a @ b)
    assert "mkldnn::_linear_pointwise" in kernels(lambda: torch.addmm(bias, a, b))
    close(a @ b, want)
    close(a.t().contiguous().t() @ b.t().contiguous().t(), want)  # column-major operands (transpose views)
    close(torch.addmm(bias, a, b), want + bias.double())
    close(torch.addmm(c, a, b, beta=0.5, alpha=2.0), 2 * want + 0.5 * c.double())
    close(torch.addmm(c, a, b, beta=0), want)


def test_gapped_or_small_operands_keep_blas(onednn) -> None:
    """Only plain matrices (row- or column-major without gaps) of enough work reach oneDNN; a
    slice with a gap between rows, a float64 or a thin product takes BLAS, with the same values."""
    g = torch.Generator().manual_seed(3)
    wide, b = torch.randn(96, 300, generator=g), torch.randn(256, 80, generator=g)
    a = wide[:, :256]  # rows 300 apart: a gap after each
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: a @ b)
    close(a @ b, a.double() @ b.double())
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: a.double() @ b.double())
    thin = torch.randn(4, 256, generator=g)  # fewer than MIN_ROWS rows
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: thin @ b)
    close(thin @ b, thin.double() @ b.double())
    assert "mkldnn::_linear_pointwise" in kernels(lambda: wide[:, :256].contiguous() @ b)


def test_mm_into_writes_a_onednn_product_into_the_callers_block(onednn) -> None:
    """The chunked head's reused blocks: a row-major left operand goes through oneDNN into `out`;
    a column-major one (the head's weight gradient) keeps BLAS; with blas routing, plain mm.out."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(96, 256, generator=g), torch.randn(256, 80, generator=g)
    out = torch.full((96, 80), float("nan"))
    assert "mkldnn::_linear_pointwise" in kernels(lambda: matmul.mm_into(a, b, out))
    close(out, a.double() @ b.double())
    at = a.t().contiguous().t()  # the same values, column-major
    out.fill_(float("nan"))
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: matmul.mm_into(at, b, out))
    close(out, a.double() @ b.double())
    matmul.set_cpu_matmul("blas")
    out.fill_(float("nan"))
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: matmul.mm_into(a, b, out))
    close(out, a.double() @ b.double())



def test_mm_into_compiles(onednn) -> None:
    """torch.compile traces through `mm_into` (the chunked head's forward is traced with the
    model): inductor lowers oneDNN's linear only for constant weights and failed on the head's
    (`--compile true` SFT on a CPU); while tracing it sees `torch.mm`, and the compiled product
    equals the eager one."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(96, 256, generator=g), torch.randn(256, 80, generator=g)

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return matmul.mm_into(a, b, a.new_empty(a.size(0), b.size(1))) * 2

    torch._dynamo.reset()
    got = torch.compile(product, fullgraph=True)(a, b)
    close(got, 2 * a.double() @ b.double())

def onednn_shapes(fn) -> list[list[int]]:
    """The (rows, reduction) of each product oneDNN ran inside `fn`."""
    with profile(record_shapes=True) as prof:
        fn()
    return [e.input_shapes[0] for e in prof.events() if e.name == "mkldnn::_linear_pointwise"]


@pytest.mark.parametrize("rows", [37, 100, 1000, 1337])
def test_token_counts_reach_onednn_rounded_to_buckets(onednn, rows) -> None:
    """Rows of every count (a micro-batch's tokens) run as a bucket's rows, so oneDNN builds a kernel
    per bucket, not per count; the result is the first rows, equal to the float64 product. A weight
    gradient (dy^T x: column-major left, the tokens its reduction) runs its reduction cut at a bucket
    and adds the rest through BLAS."""
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 128, generator=g), torch.randn(256, 128, generator=g)
    step = matmul.bucket_step(rows)
    assert 8 <= step and step * 8 <= max(rows, 64)
    shapes = onednn_shapes(lambda: x @ w.t())
    assert shapes == [[rows + (-rows) % step, 128]]
    y = x @ w.t()
    assert y.shape == (rows, 256) and y.is_contiguous()
    close(y, x.double() @ w.double().t())
    dy = torch.randn(rows, 256, generator=g)
    cut = rows - rows % step
    shapes = onednn_shapes(lambda: dy.t() @ x)
    assert shapes == [[256, cut]]
    close(dy.t() @ x, dy.double().t() @ x.double())
    bias = torch.randn(256, generator=g)
    close(torch.addmm(bias, x, w.t()), x.double() @ w.double().t() + bias.double())


def test_a_run_of_changing_token_counts_meets_few_onednn_shapes(onednn) -> None:
    """200 different counts between 900 and 1,800 rows: at most 8 bucketed shapes per doubling."""
    w = torch.randn(64, 32)
    seen = set()
    for rows in range(900, 1800, 9):
        seen.update(tuple(s) for s in onednn_shapes(lambda rows=rows: torch.randn(rows, 32) @ w.t()))
    assert len(seen) <= 9, sorted(seen)


def test_products_off_the_cpu_never_reach_the_onednn_kernel(onednn) -> None:
    """oneDNN's linear runs on CPU tensors only: the chunked head calls `mm_into` on the GPU too
    (a device run failed there with 'Could not run mkldnn::_linear_pointwise ... CUDA'). Meta
    tensors stand in for a device: the kernel has a meta form, so only the routing can keep them off."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    a, b = torch.empty(96, 256, device="meta"), torch.empty(256, 80, device="meta")
    with Ops() as ops:
        matmul.mm_into(a, b, torch.empty(96, 80, device="meta"))
        torch.mm(a, b)
        torch.nn.functional.linear(a, b.t())
    assert ops.seen and not any("mkldnn" in op for op in ops.seen), ops.seen


def test_out_and_inplace_forms_keep_pytorchs_kernels(onednn) -> None:
    g = torch.Generator().manual_seed(2)
    a, b, c = torch.randn(96, 256, generator=g), torch.randn(256, 80, generator=g), torch.randn(96, 80, generator=g)
    out = torch.empty(96, 80)
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: torch.mm(a, b, out=out))
    close(out, a.double() @ b.double())
    acc = c.clone()
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: acc.addmm_(a, b))
    close(acc, a.double() @ b.double() + c.double())
    # bf16 products through bmm/baddbmm reach addmm_ inside PyTorch: no re-entry, no recursion
    x = torch.randn(4, 64, 64, dtype=torch.bfloat16)
    assert torch.baddbmm(x, x, x).shape == (4, 64, 64)
    assert torch.addmm(x[0], x[1], x[2]).dtype == torch.bfloat16


def test_small_and_non_float32_products_stay_on_blas(onednn) -> None:
    g = torch.Generator().manual_seed(1)
    row, w = torch.randn(1, 576, generator=g), torch.randn(576, 1536, generator=g)  # a gemv: BLAS is faster
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: row @ w)
    close(row @ w, row.double() @ w.double())
    a64, b64 = torch.randn(64, 256, dtype=torch.float64), torch.randn(256, 64, dtype=torch.float64)
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: a64 @ b64)
    assert torch.allclose(a64 @ b64, torch.einsum("ik,kj->ij", a64, b64))
    ints = torch.arange(12).view(3, 4) @ torch.ones(4, 2, dtype=torch.long)
    assert ints.tolist() == [[6, 6], [22, 22], [38, 38]]
    strided = torch.randn(64, 512, generator=g)[:, ::2]  # a gap between columns: not a plain matrix
    assert "mkldnn::_linear_pointwise" not in kernels(lambda: strided @ w[:256])
    close(strided @ w[:256], strided.double() @ w[:256].double())


def test_blas_restores_pytorchs_own_kernels(onednn) -> None:
    a, b = torch.randn(128, 256), torch.randn(256, 128)
    assert matmul.set_cpu_matmul("blas") == "blas"
    names = kernels(lambda: a @ b)
    assert "mkldnn::_linear_pointwise" not in names
    assert matmul.set_cpu_matmul("auto") == "onednn"  # and back, idempotent
    assert matmul.set_cpu_matmul("auto") == "onednn"
    assert "mkldnn::_linear_pointwise" in kernels(lambda: a @ b)


def test_linear_forward_and_backward_match_blas_and_repeat_bit_for_bit(onednn) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(384, 192)
    x = torch.randn(4, 40, 384, requires_grad=True)

    def run() -> list[torch.Tensor]:
        x.grad, lin.weight.grad, lin.bias.grad = None, None, None
        y = lin(x)
        y.square().sum().backward()
        return [y.detach(), x.grad, lin.weight.grad, lin.bias.grad]

    first, again = run(), run()
    assert all(torch.equal(p, q) for p, q in zip(first, again))  # deterministic
    matmul.set_cpu_matmul("blas")
    reference = run()
    for got, want in zip(first, reference):
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_a_bad_choice_names_the_field_and_the_choices() -> None:
    with pytest.raises(ValueError, match="cpu_matmul is 'mkl'; use one of auto, onednn, blas"):
        matmul.set_cpu_matmul("mkl")
    with pytest.raises(ConfigError, match="cpu_matmul"):
        load_config(None, ["--cpu_matmul", "mkl"])
    assert load_config(None, ["--cpu_matmul", "blas"]).train.cpu_matmul == "blas"
