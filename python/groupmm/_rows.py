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

:func:`topk_ids` is the router's row op: the int64 ids of each row's ``k`` largest scores
(``torch.topk``'s indices, with ties and NaNs ordered by rule), one warp per row on CUDA;
:func:`topk_ids_applies` says where the router may call it (else ``torch.topk``).
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
    "topk_ids",
    "topk_ids_applies",
    "topk_ids_takes",
]

#: the widest rows :func:`topk_ids` takes on CUDA (one warp holds a row: 32 values a
#: lane); the bound is the Rust rule's (``shape::TOPK_CUDA_MAX_COLS``), read from there
TOPK_CUDA_MAX_COLS: int = _native.TOPK_CUDA_MAX_COLS
#: the dtypes :func:`topk_ids` reads (on either device)
TOPK_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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


def _topk_ids(scores: Tensor, k: int) -> Tensor:
    """int64 ``[T, k]``: row ``t`` holds the columns of the ``k`` largest values of
    ``scores[t]`` (``[T, E]``, any float dtype, any strides), best first: a greater value
    first, NaN greater than every number (as ``torch.topk`` ranks it), equal values (NaNs
    among themselves, ``-0.0 == 0.0``) lower column first. On rows of distinct numbers,
    ``torch.topk(scores, k).indices``. ``1 <= k <= E``; on CUDA ``E <=``
    :data:`TOPK_CUDA_MAX_COLS`. Not differentiable (ids)."""
    return _native.topk_ids(scores, k)


def _topk_ids_fake(scores, k):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int64)


#: whether this build holds the CUDA kernels: read once, at import, so that the router's
#: choice below is a constant to ``torch.compile`` (a call into the extension on the
#: traced path would be a graph break, or an error under ``fullgraph=True``)
CUDA_BUILD: bool = bool(_native.build_info()["cuda"])


def topk_ids_applies(scores: Tensor) -> bool:
    """Whether :func:`topk_ids` takes ``scores``: a 2-D tensor of a float dtype on the CPU,
    or on CUDA in a build with CUDA and rows of at most :data:`TOPK_CUDA_MAX_COLS`. Where
    it does not, the router uses ``torch.topk`` (the same ids on rows without ties)."""
    return topk_ids_takes(scores.device.type, scores.dtype, scores.dim(), scores.shape[-1])


def topk_ids_takes(kind: str, dtype: torch.dtype, dims: int, cols) -> bool:
    """:func:`topk_ids_applies` on the tensor's device kind, dtype, dimensions and row
    width: module constants and these alone, so ``torch.compile`` traces it for every
    device (a call into the extension here would break ``fullgraph=True`` on that
    device only)."""
    if dims != 2 or dtype not in TOPK_DTYPES:
        return False
    if kind == "cpu":
        return True
    return kind == "cuda" and CUDA_BUILD and cols <= TOPK_CUDA_MAX_COLS


swiglu = op("swiglu", _swiglu, _swiglu_fake)
swiglu_backward = op("swiglu_backward", _swiglu_backward, _swiglu_backward_fake)
gather_sum = op("gather_sum", _gather_sum, _gather_sum_fake)
scatter_rows = op("scatter_rows", _scatter_rows, _scatter_rows_fake)
row_dots = op("row_dots", _row_dots, _row_dots_fake)
topk_ids = op("topk_ids", _topk_ids, _topk_ids_fake)
