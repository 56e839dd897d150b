"""Which library runs float32 matrix products on the CPU: oneDNN or PyTorch's default BLAS.

PyTorch on x86 sends a float32 `mm` / `addmm` to MKL's sgemm. On the AMD Zen 5 machine the
figures in docs/training.md come from, MKL takes its AVX2 code path and reaches about 100 GFLOPS
per core, while oneDNN, which ships inside the same PyTorch build, runs the same products in
float32 with AVX-512 at 170-240 GFLOPS (decode, training forward, input and weight gradients
alike; `docs/training.md`, "Matrix products on the CPU"). Nearly every matrix product of a step
(`nn.Linear` forward and its autograd backward, the lean blocks' hand-written backward passes,
LoRA, the critic) reaches ATen as the functional `mm` or `addmm`, so this module replaces those
two CPU kernels, process-wide, with one that hands products of float32 matrices with at least
`MIN_ROWS` rows and columns and `MIN_MACS` multiply-adds to oneDNN and everything else to the
BLAS path (a gemv-like product is faster there). Results are float32 and deterministic; they
round differently from MKL's (about 1e-6 relative), as MKL's own kernels do between shapes.
The `out=` and in-place forms (`mm.out`, `addmm.out`, `addmm_`) keep PyTorch's kernels; they are
also the BLAS path this module falls back on, so a fallback never re-enters it (PyTorch's `bmm`
and `baddbmm` may call `addmm_`). A caller that reuses an output block (the chunked lm head)
asks for oneDNN explicitly with `mm_into`.

`set_cpu_matmul("onednn" | "blas" | "auto")` switches (auto: oneDNN when this build has it). The
run builder and the inference engine call it with their `cpu_matmul` field before they build a
model; it is idempotent. GPUs are untouched (only the CPU dispatch key is replaced).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from astrai.config_values import CHOICES

CPU_MATMUL_CHOICES = CHOICES["cpu_matmul"]
MIN_ROWS = 8  # below this many output rows or columns MKL's gemv-like kernels are faster (measured)
MIN_MACS = 1 << 20  # smaller products cost more in oneDNN's call overhead (~13 us) than they gain
_FLOAT32 = torch.float32

_library: torch.library.Library | None = None  # the registered CPU kernels while oneDNN is on


def set_cpu_matmul(choice: str) -> str:
    """Route float32 CPU matrix products to oneDNN or back to BLAS; returns the library now used."""
    global _library
    if choice not in CPU_MATMUL_CHOICES:
        raise ValueError(f"cpu_matmul is {choice!r}; use one of {', '.join(CPU_MATMUL_CHOICES)}")
    available = onednn_available()
    if choice == "onednn" and not available:
        raise ValueError("cpu_matmul is 'onednn' but this PyTorch build has no oneDNN (mkldnn); use 'auto' or 'blas'")
    want_onednn = choice == "onednn" or (choice == "auto" and available)
    if want_onednn and _library is None:
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # replacing a registered kernel is the point
            warnings.simplefilter("ignore")
            library.impl("mm", _mm, "CPU")
            library.impl("addmm", _addmm, "CPU")
        _library = library
    elif not want_onednn and _library is not None:
        _library._destroy()
        _library = None
    return current_cpu_matmul()


def current_cpu_matmul() -> str:
    return "onednn" if _library is not None else "blas"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# -- the kernels ---------------------------------------------------------------------------------
def _takes(a: Tensor, b: Tensor) -> bool:
    """a (M, K) @ b (K, N) goes to oneDNN: float32 CPU matrices, large enough, plainly laid out (row-
    or column-major without gaps: a matrix or its transpose view). Called on every product, so
    written with the fewest tensor calls (mm and addmm take only 2-D matrices)."""
    if a.dtype is not _FLOAT32 or b.dtype is not _FLOAT32 or not a.is_cpu:
        return False
    m, k = a.shape
    n = b.shape[1]
    if m < MIN_ROWS or n < MIN_ROWS or m * k * n < MIN_MACS:
        return False
    (a0, a1), (b0, b1) = a.stride(), b.stride()
    return (a1 == 1 and a0 == k or a0 == 1 and a1 == m) and (b1 == 1 and b0 == n or b0 == 1 and b1 == k)


def bucket_step(n: int) -> int:
    """The granularity token counts are rounded to: an eighth to a sixteenth of `n`'s power of two
    (at least 8), so a count is padded by under 12.5% and a run meets at most 8 per doubling."""
    return max(8, 1 << (n.bit_length() - 4))


def _product(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """a @ b (+ bias over rows) in oneDNN, on shapes rounded to `bucket_step`.

    oneDNN builds a kernel for every new shape and caches it; a training step's products take
    their rows (forward, input gradient) or their reduction (weight gradient) from the micro-
    batch's token count, new almost every step, and building costs more than a small product
    (tiny model, two threads, (900..1800) x 128 x 128 with a new row count each call: 104 GFLOPS,
    against 292 padded to buckets; BLAS 177). So rows are padded with zeros to a bucket (the
    result is the first rows) and a weight gradient's reduction is cut at one, its last few
    terms added by BLAS."""
    m, k = a.shape
    cut = k - k % bucket_step(k)
    if cut != k and a.stride(0) == 1 and b.stride(1) == 1:  # a weight gradient: dy^T x, both cut without a copy
        return _linear(a[:, :cut], b[:cut], bias).addmm_(a[:, cut:], b[cut:])  # `addmm_` keeps BLAS
    step = bucket_step(m)
    if m % step == 0:
        return _linear(a, b, bias)
    padded = a.new_empty(m + step - m % step, k)
    padded[:m] = a
    padded[m:] = 0
    return _linear(padded, b, bias)[:m]


def _linear(a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's linear computes x @ w.T, so w is b's transpose (a view)."""
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


def _mm(a: Tensor, b: Tensor) -> Tensor:
    if _takes(a, b):
        return _product(a, b)
    # the BLAS path: `mm.out` is a kernel of its own, left in place (so is `addmm.out`)
    return torch.mm(a, b, out=a.new_empty(a.size(0), b.size(1)))


def _addmm(c: Tensor, a: Tensor, b: Tensor, *, beta: float = 1, alpha: float = 1) -> Tensor:
    if not _takes(a, b):
        return torch.addmm(c, a, b, beta=beta, alpha=alpha, out=a.new_empty(a.size(0), b.size(1)))
    if beta == 1 and alpha == 1 and c.dim() == 1 and c.dtype == torch.float32:
        return _product(a, b, c)  # the bias added inside the kernel, as nn.Linear's addmm does
    ab = _product(a, b)
    if alpha != 1:
        ab.mul_(alpha)
    return ab.add_(c if beta == 1 else c * beta) if beta != 0 else ab


def mm_into(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """out = a @ b for a caller that reuses `out` (the chunked lm head's logits block and input
    gradient): through oneDNN while it is on and `a` is row-major, its product copied in, else
    `torch.mm(out=)`. A SmolLM2 chunk (341 x 576 x 49,152, two threads): 74 against 126 ms
    forward, 61 against 107 ms for the input gradient. A column-major `a` (the head's weight
    gradient, dz^T h) stays with BLAS: oneDNN would first copy it whole (147 against 110 ms).
    While torch.compile traces, `torch.mm` is what it sees: inductor lowers oneDNN's linear only
    for frozen (constant) weights, and its own `mm` reaches the kernels above when it runs."""
    if _library is not None and not torch.compiler.is_compiling() and out.dtype is _FLOAT32 and a.is_contiguous() \
            and _takes(a, b):
        return out.copy_(_product(a, b))
    return torch.mm(a, b, out=out)
