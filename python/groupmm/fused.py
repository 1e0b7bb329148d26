"""The two halves of a routed SwiGLU expert block as single operations (issue 13's API),
so that the glue around the grouped GEMMs has one place to be fused into them:

- :func:`expert_up`: ``act = silu(x[src] @ w_gate[g]) * (x[src] @ w_up[g])`` per expert
  group ``g`` (a row gather, the up projection and the activation);
- :func:`expert_down`: ``out[t] = sum_j weights[t, j] * (h @ w_out[g])[inverse[t, j]]``
  (the down projection, the router weights and the top-k combine back to token order).

Both run as ``torch.library`` custom ops with fake kernels and autograd formulas
(``torch.compile(fullgraph=True)``, ``opcheck``, double backward through differentiable
fallbacks), on CPU and CUDA: ``expert_up`` is ``torch.ops.groupmm.swiglu_act`` over
``torch.ops.groupmm.gather_mm`` (two ops, so that autograd frees the pre-activation
before the weight-gradient GEMM), ``expert_down`` is ``torch.ops.groupmm.expert_down``.

What runs: groupmm's grouped GEMMs — the up projection is ``_native.gather_mm``, which
gathers ``x``'s rows through ``src`` with a row kernel and then runs the GEMM (or, with
``GROUPMM_SM90_GATHER=1`` on Hopper, reads them inside the GEMM: measured slower, so off
by default) — with the glue as one-pass row kernels
(``groupmm._rows``: CUDA kernels on the GPU, Rust on the CPU): SwiGLU and its backward,
the weighted top-k combine and its backward (row scatter in row order, router-weight
dot products). Activation memory is lower than the unfused layer's: the backward
re-gathers ``x[src]`` instead of keeping it, keeps the pre-activation and not
``silu(gate)``, and the router-weight gradient reads the down projection's output once.
Not done yet (issue 13): the weight gradient's gather inside the varlen-K GEMM (it still
gathers ``x[src]`` once) and the SwiGLU inside the GEMM (an activation epilogue, which
would remove the ``[R, 2F]`` pre-activation round trip); they go behind these signatures.

Determinism: no atomics anywhere; the gradient of ``x`` sums each token's ``k`` rows
through ``inverse`` (:func:`groupmm.moe.sum_copies`).
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _native, _rows
from ._api import grouped_mm
from .moe import _is_integer, combine, combine_backward, sum_copies
from .nn import _check_tensor

__all__ = ["expert_down", "expert_up", "swiglu_backward"]


def _check(name: str, t, dims: int, what: str, integer: bool = False) -> None:
    _check_tensor(name, t)
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {what}, found shape {list(t.shape)}")
    if integer and not _is_integer(t.dtype):
        raise TypeError(f"{name}: expected an integer tensor, found {t.dtype}")


def swiglu_backward(grad: Tensor, pre: Tensor) -> Tensor:
    """Gradient of ``silu(gate) * up`` w.r.t. ``pre = [gate | up]`` (the last dimension's
    halves): ``d gate = grad * up * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)``,
    ``d up = grad * silu(gate)``. One pass (``_rows.swiglu_backward``) for 2-D operands;
    from differentiable ops while autograd records a graph through them (double
    backward)."""
    if grad.dim() == 2 and pre.dim() == 2 and not _rows.differentiable(grad, pre):
        return _rows.swiglu_backward(grad, pre)
    gate, up = pre.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    d_gate = grad * up * s * (1 + gate * (1 - s))
    d_up = grad * gate * s
    return torch.cat([d_gate, d_up], dim=-1)


# --------------------------------------------------------------------------- expert_up


@torch.library.custom_op("groupmm::gather_mm", mutates_args=())
def _gather_mm(x: Tensor, w: Tensor, offs: Tensor, src: Tensor, inverse: Tensor) -> Tensor:
    # One native call: the rows are gathered, then multiplied (inside the GEMM only with
    # GROUPMM_SM90_GATHER=1, cuda/heuristics/sm90.h).
    return _native.gather_mm(x, w, _rows._index(offs), _rows._index(src))


@_gather_mm.register_fake
def _gather_mm_fake(x, w, offs, src, inverse):
    return x.new_empty(src.shape[0], w.shape[-1])


def _gather_mm_setup(ctx, inputs, output):
    x, w, offs, src, inverse = inputs
    ctx.save_for_backward(x, w, offs, src, inverse)  # not x[src]: re-gathered when needed


def _gather_mm_grad(ctx, d_pre):
    x, w, offs, src, inverse = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = sum_copies(grouped_mm(d_pre, w.transpose(-2, -1), offs=offs), inverse)
    if ctx.needs_input_grad[1]:
        dw = grouped_mm(x.index_select(0, src).t(), d_pre, offs=offs)
    return dx, dw, None, None, None


_gather_mm.register_autograd(_gather_mm_grad, setup_context=_gather_mm_setup)


@torch.library.custom_op("groupmm::swiglu_act", mutates_args=())
def _swiglu_act(pre: Tensor) -> Tensor:
    return _rows.swiglu(pre)


@_swiglu_act.register_fake
def _swiglu_act_fake(pre):
    return pre.new_empty(pre.shape[0], pre.shape[1] // 2)


def _swiglu_act_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_act_grad(ctx, d_act):
    (pre,) = ctx.saved_tensors
    return swiglu_backward(d_act, pre)


_swiglu_act.register_autograd(_swiglu_act_grad, setup_context=_swiglu_act_setup)


def expert_up(x: Tensor, w: Tensor, offs: Tensor, src: Tensor, inverse: Tensor) -> Tensor:
    """The up half of a routed SwiGLU expert block: ``act[r] = silu(a[r] @ w_gate[g]) *
    (a[r] @ w_up[g])`` with ``a[r] = x[src[r]]``, for the rows ``r`` of each group ``g``.

    Args:
        x: ``[T, D]`` tokens, in token order (never copied into expert order).
        w: ``[E, D, 2F]``, columns ``[:F]`` the gate and ``[F:]`` the up projection
            (:class:`groupmm.nn.GroupedExperts`' ``w_in``).
        offs: int32 ``[E]`` group ends over the ``R`` routed rows.
        src: integer ``[R]``, the token of each row (``x`` row ``src[r]``).
        inverse: integer ``[T, k]``, the row of each token's ``j``-th copy (every row
            named once: ``R = T*k``); used by the backward to sum a token's rows.

    Returns:
        ``[R, F]`` in ``x``'s dtype; rows past ``offs[-1]`` are zero.

    :func:`groupmm.moe.permute`'s routing gives ``src``/``inverse`` (``MoELayer`` with
    ``fused=True`` calls this). Index values are not checked (that would need a host
    sync): out-of-range ids give wrong results or a device error.
    """
    _check("x", x, 2, "shape [T, D]")
    _check("w", w, 3, "shape [E, D, 2F]")
    _check("offs", offs, 1, "a 1-D tensor of group ends", integer=True)
    _check("src", src, 1, "shape [R]", integer=True)
    _check("inverse", inverse, 2, "shape [T, k]", integer=True)
    if w.shape[-1] % 2:
        raise ValueError(f"w: expected an even last dimension [gate | up], found {list(w.shape)}")
    if inverse.shape[0] != x.shape[0] or inverse.numel() != src.shape[0]:
        raise ValueError(
            f"inverse: expected shape [T={x.shape[0]}, k] with T*k = R = {src.shape[0]} "
            f"(the length of src), found {list(inverse.shape)}"
        )
    return _swiglu_act(_gather_mm(x, w, offs, src, inverse))


# --------------------------------------------------------------------------- expert_down


@torch.library.custom_op("groupmm::expert_down", mutates_args=())
def _expert_down(
    h: Tensor, w: Tensor, offs: Tensor, inverse: Tensor, weights: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    y = grouped_mm(h, w, offs=offs)
    return combine(y, inverse, weights), y


@_expert_down.register_fake
def _expert_down_fake(h, w, offs, inverse, weights):
    return h.new_empty(inverse.shape[0], w.shape[-1]), h.new_empty(h.shape[0], w.shape[-1])


def _expert_down_setup(ctx, inputs, output):
    h, w, offs, inverse, weights = inputs
    ctx.save_for_backward(h, w, offs, inverse, weights, output[1])
    ctx.set_materialize_grads(False)  # y has no gradient unless used: no zeros for it


def _expert_down_grad(ctx, d_out, d_y):
    h, w, offs, inverse, weights, y = ctx.saved_tensors
    need_h, need_w, _, _, need_weights = ctx.needs_input_grad
    need_y = need_h or need_w
    dy = dweights = dh = dw = None
    if d_out is not None:
        dy, dweights = combine_backward(
            d_out, y, inverse, weights, need_y, weights is not None and need_weights
        )
    if d_y is not None and need_y:  # only when y is used (double backward)
        dy = d_y if dy is None else dy + d_y
    if dy is None:
        return dh, dw, None, None, dweights
    if need_h:
        dh = grouped_mm(dy, w.transpose(-2, -1), offs=offs)
    if need_w:
        dw = grouped_mm(h.t(), dy, offs=offs)
    return dh, dw, None, None, dweights


_expert_down.register_autograd(_expert_down_grad, setup_context=_expert_down_setup)


def expert_down(
    h: Tensor, w: Tensor, offs: Tensor, inverse: Tensor, weights: Optional[Tensor] = None
) -> Tensor:
    """The down half of a routed expert block: ``out[t] = sum_j weights[t, j] *
    y[inverse[t, j]]`` with ``y = h @ w[g]`` per group ``g`` of rows.

    Args:
        h: ``[R, F]`` activations of the routed rows, in expert order.
        w: ``[E, F, D]`` (:class:`groupmm.nn.GroupedExperts`' ``w_out``).
        offs: int32 ``[E]`` group ends over the ``R`` rows.
        inverse: integer ``[T, k]``, the row of each token's ``j``-th copy.
        weights: ``[T, k]`` router weights (differentiable), or None for a plain sum.

    Returns:
        ``[T, D]`` in ``h``'s dtype, in token order.
    """
    _check("h", h, 2, "shape [R, F]")
    _check("w", w, 3, "shape [E, F, D]")
    _check("offs", offs, 1, "a 1-D tensor of group ends", integer=True)
    _check("inverse", inverse, 2, "shape [T, k]", integer=True)
    if weights is not None:
        _check("weights", weights, 2, f"shape {list(inverse.shape)} (the shape of inverse)")
        if weights.shape != inverse.shape:
            raise ValueError(
                f"weights: expected shape {list(inverse.shape)} (the shape of inverse), "
                f"found {list(weights.shape)}"
            )
    return _expert_down(h, w, offs, inverse, weights)[0]
