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
through ``inverse``. The glue formulas (:func:`~groupmm._glue.sum_copies`,
:func:`~groupmm._glue.combine` and its backward, :func:`~groupmm._glue.swiglu_grad`) are
``groupmm._glue``'s, shared with ``groupmm.moe`` and the transformers integration.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _checks as check
from . import _native, _rows
from ._api import grouped_mm
from ._glue import combine, combine_backward, sum_copies, swiglu_grad

__all__ = ["expert_down", "expert_up", "swiglu_grad"]

#: the former name of :func:`swiglu_grad` (the backward formula; ``_rows.swiglu_backward``
#: is the row op it runs), kept so that old imports work
swiglu_backward = swiglu_grad


# --------------------------------------------------------------------------- expert_up


@torch.library.custom_op("groupmm::gather_mm", mutates_args=())
def _gather_mm(x: Tensor, w: Tensor, offs: Tensor, src: Tensor, inverse: Tensor) -> Tensor:
    # One native call: the rows are gathered, then multiplied (inside the GEMM only with
    # GROUPMM_SM90_GATHER=1, cuda/heuristics/choose.h); the extension converts the index.
    return _native.gather_mm(x, w, offs, src)


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
    return swiglu_grad(d_act, pre)


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
    # before the ops: their fakes (torch.compile) check nothing, the indices are
    # converted to int32 before the native call, and only the backward reads inverse
    check.dims("x", x, 2, "[T, D]")
    check.dims("w", w, 3, "[E, D, 2F]")
    check.index("offs", offs, 1, "[E]")
    check.index("src", src, 1, "[R]")
    check.index("inverse", inverse, 2, "[T, k]")
    if w.shape[-1] % 2:
        raise ValueError(f"w: expected an even last dimension [gate | up], found {list(w.shape)}")
    ok = inverse.shape[0] == x.shape[0] and inverse.numel() == src.shape[0]
    what = "[T={}, k] with T*k = R = {} (the length of src)"
    check.shape("inverse", inverse, ok, what, x.shape[0], src.shape[0])
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
    # before the op: its fake (torch.compile) checks nothing, and inverse is converted
    # to int32 before the row ops read it
    check.dims("h", h, 2, "[R, F]")
    check.dims("w", w, 3, "[E, F, D]")
    check.index("offs", offs, 1, "[E]")
    check.index("inverse", inverse, 2, "[T, k]")
    if weights is not None:
        check.tensor("weights", weights)
        check.same_shape("weights", weights, "inverse", inverse)
    return _expert_down(h, w, offs, inverse, weights)[0]
