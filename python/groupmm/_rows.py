"""The MoE glue's row ops: one pass each over the rows around the grouped GEMMs of a
routed SwiGLU expert block, in Rust on the CPU and as CUDA kernels on the GPU (one
``_native`` function per op; what each computes and its argument rules:
``src/shape/rows.rs``), deterministic (fixed summation order, no atomics), fp32
arithmetic (fp64 for float64) and one rounding per output element. The extension
normalises the operands (strided rows copied, integer indices converted to int32, once)
and allocates the result.

They are ``torch.library`` custom ops (``torch.ops.groupmm.swiglu`` ...) with fake
kernels, so ``torch.compile`` traces them, and WITHOUT autograd formulas: they are the
arithmetic of forward and backward formulas (``groupmm.moe``, ``groupmm.fused``), which
run them with autograd off. :func:`differentiable` tells those formulas when they must
use differentiable torch ops instead (a graph is being recorded, e.g. double backward).
Eager calls on plain tensors go to the extension directly (no dispatcher round trip), as
``_library`` does for the GEMMs.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import Optional

import torch
from torch import Tensor

from . import _native
from ._library import op

__all__ = [
    "differentiable",
    "gather_sum",
    "row_dots",
    "scatter_rows",
    "swiglu",
    "swiglu_backward",
]


def differentiable(*tensors) -> bool:
    """True when autograd records a graph through ``tensors`` (grad mode on and one of
    them requires grad): the row ops have no autograd formula, so the caller must compose
    differentiable torch ops instead."""
    return torch.is_grad_enabled() and any(
        isinstance(t, Tensor) and t.requires_grad for t in tensors
    )


def _weights(w: Optional[Tensor], rows: Tensor) -> Optional[Tensor]:
    """Router weights in a dtype the kernels read: the rows' dtype or float32. This
    promotion is the ops' contract, decided here before the native call (the extension
    checks it and rejects other dtypes)."""
    if w is None or w.dtype in (rows.dtype, torch.float32):
        return w
    return w.float()


def _swiglu(pre: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``pre = [gate | up]`` (``[R, 2F]`` → ``[R, F]``)."""
    return _native.swiglu(pre)


def _swiglu_fake(pre):
    return pre.new_empty(pre.shape[0], pre.shape[1] // 2)


def _swiglu_backward(grad: Tensor, pre: Tensor) -> Tensor:
    """``[d gate | d up]`` of :func:`swiglu` from its output gradient ``grad [R, F]``."""
    return _native.swiglu_backward(grad, pre)


def _swiglu_backward_fake(grad, pre):
    return torch.empty_like(pre, memory_format=torch.contiguous_format)


def _gather_sum(y: Tensor, inverse: Tensor, weights: Optional[Tensor] = None) -> Tensor:
    """``out[t] = sum_j weights[t, j] * y[inverse[t, j]]`` (a plain sum when ``weights``
    is None): each token's ``k`` rows, summed in the order of ``j``."""
    return _native.gather_sum(y, inverse, _weights(weights, y))


def _gather_sum_fake(y, inverse, weights=None):
    return y.new_empty(inverse.shape[0], y.shape[1])


def _scatter_rows(grad: Tensor, inverse: Tensor, weights: Optional[Tensor], rows: int) -> Tensor:
    """``out[inverse[t, j]] = weights[t, j] * grad[t]`` into ``[rows, D]``, written row by
    row; rows that no index names (padding) are zero."""
    return _native.scatter_rows(grad, inverse, _weights(weights, grad), rows)


def _scatter_rows_fake(grad, inverse, weights, rows):
    return grad.new_empty(rows, grad.shape[1])


def _row_dots(grad: Tensor, y: Tensor, inverse: Tensor, dtype: torch.dtype) -> Tensor:
    """``out[t, j] = <grad[t], y[inverse[t, j]]>`` as ``dtype`` (``grad``'s dtype or
    float32; other dtypes are computed in float32 and cast here)."""
    kernel_dtype = dtype if dtype in (grad.dtype, torch.float32) else torch.float32
    return _native.row_dots(grad, y, inverse, kernel_dtype).to(dtype)


def _row_dots_fake(grad, y, inverse, dtype):
    return grad.new_empty(inverse.shape, dtype=dtype)


swiglu = op("swiglu", _swiglu, _swiglu_fake)
swiglu_backward = op("swiglu_backward", _swiglu_backward, _swiglu_backward_fake)
gather_sum = op("gather_sum", _gather_sum, _gather_sum_fake)
scatter_rows = op("scatter_rows", _scatter_rows, _scatter_rows_fake)
row_dots = op("row_dots", _row_dots, _row_dots_fake)
