"""The public ops of one fused epilogue each (a rule entry of
src/shape/product/epilogues.rs, run by ``_native.product``), every name of ``__all__``
public in :mod:`groupmm.fused`: each a ``torch.library`` op with its fake, its
composition where the native call answers None, and its autograd formula.

- :func:`row_scaled_mm`: a GroupedM product scaled per row, ``out[r] = scale[r] * (x[r] @
  w[g])`` for the rows ``r`` of group ``g``: e.g. a router weight applied inside the down
  projection. On Hopper one kernel (the ``row_scale`` epilogue: the scale applied to the
  float32 product before it is rounded); elsewhere composed from a plain product. Op
  ``groupmm::row_scaled_mm``.
"""

import torch
from torch import Tensor

from . import _checks as check
from . import _native
from ._api import grouped_mm
from ._library import direct, op

__all__ = ["row_scaled_mm"]


def _scale_dtype(x: Tensor) -> torch.dtype:
    """The dtype the scale is applied in: float32, float64 for float64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _row_scaled(x: Tensor, w: Tensor, offs: Tensor, scale: Tensor) -> Tensor:
    if scale.dtype == torch.float32:  # the kernels' scale (float64: no kernel)
        got = _native.product("row_scale", x, w, offs, (scale,))
        if got is not None:
            return got[0]
    # no kernel runs the epilogue (the CPU, float64): compose it
    y = _native.grouped_mm(x, w, offs)
    return (y.to(scale.dtype) * scale[:, None]).to(x.dtype)


def _row_scaled_fake(x, w, offs, scale):
    return x.new_empty(x.shape[0], w.shape[-1])


op("row_scaled_mm", _row_scaled, _row_scaled_fake)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grad(ctx, d_out):
    """``u = d_out @ w[g]ᵀ``; ``dx = scale * u``, ``dscale = Σ_k x * u`` (the row dot of the
    unscaled product with ``d_out``), ``dw = xᵀ @ (scale * d_out)``: differentiable torch
    ops and grouped products (double backward)."""
    x, w, offs, scale = ctx.saved_tensors
    need_x, need_w, _, need_s = ctx.needs_input_grad
    dx = dw = ds = None
    s = scale[:, None]
    if need_x or need_s:
        u = grouped_mm(d_out, w.transpose(-2, -1), offs=offs).to(s.dtype)
        if need_x:
            dx = (u * s).to(x.dtype)
        if need_s:
            ds = (u * x.to(s.dtype)).sum(-1)
    if need_w:
        dw = grouped_mm(x.transpose(-2, -1), (d_out.to(s.dtype) * s).to(x.dtype), offs=offs)
    return dx, dw, None, ds


torch.library.register_autograd("groupmm::row_scaled_mm", _grad, setup_context=_setup)


class _RowScaledFn(torch.autograd.Function):
    """The op's eager twin on plain tensors: the same forward and backward without the
    custom-op dispatch."""

    @staticmethod
    def forward(ctx, x, w, offs, scale):
        out = _row_scaled(x, w, offs, scale)
        _setup(ctx, (x, w, offs, scale), out)
        return out

    @staticmethod
    def backward(ctx, d_out):
        return _grad(ctx, d_out)


def row_scaled_mm(x: Tensor, w: Tensor, offs: Tensor, scale: Tensor) -> Tensor:
    """``out[r] = scale[r] * (x[r] @ w[g])`` for the rows ``r`` of group ``g``; rows past
    ``offs[-1]`` are zeros.

    Args:
        x: ``[R, K]`` rows in group order (float16, bfloat16, float32 or float64).
        w: ``[E, K, N]`` of ``x``'s dtype and device, any strides.
        offs: int32 ``[E]`` group ends over the ``R`` rows (``F.grouped_mm``'s meaning).
        scale: floating ``[R]``, one value per row (differentiable); applied in float32
            (float64 for float64 inputs) to the float32 product before it is rounded.

    Returns:
        ``[R, N]`` of ``x``'s dtype, with ``grad_fn`` when an input requires grad.
    """
    check.dims("x", x, 2, "[R, K]")
    check.dims("w", w, 3, "[E, K, N]")
    check.index("offs", offs, 1, "[E]")
    # before the op: its fake checks nothing, and the float64 composition never reaches the
    # native rule (same wording: its rule entry, src/shape/product/epilogues.rs)
    check.dims("scale", scale, 1, "[R]")
    check.shape(
        "scale", scale, scale.shape[0] == x.shape[0], "[{}] (one scale per row of x)", x.shape[0]
    )
    if not scale.is_floating_point():
        raise TypeError(f"scale: expected a floating dtype, found {scale.dtype}")
    scale = scale.to(_scale_dtype(x))
    if direct(x, w, offs, scale):
        return _RowScaledFn.apply(x, w, offs, scale)
    return torch.ops.groupmm.row_scaled_mm(x, w, offs, scale)
