"""The routed SwiGLU expert block's two custom ops, ``groupmm::swiglu_up`` and
``groupmm::gated_down`` (fakes, autograd formulas, and their eager ``autograd.Function``
twins), and the forward arithmetic under them: the fused native call or its composition.
The backward's arithmetic and ops (``groupmm::dgated``, ``groupmm::dgated_over_pre``,
``groupmm::gather_k_mm``) are :mod:`groupmm._fused_backward`'s. :mod:`groupmm.fused` calls
them (``_block``); what runs, what the backward keeps and why: its module docstring.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _native, _rows
from ._api import grouped_mm
from ._fused_backward import (
    _dgated,
    _dgated_composed,
    _dgated_over,
    _gather_k,
    _overwrites_pre,
    _up_grads,
    _weight_grad,
    reads_in_gemm,
)
from ._fused_backward import _slabs as _slabs  # re-exported (tests read it here)
from ._fused_backward import gathers_in_gemm as gathers_in_gemm  # re-exported
from ._glue import combine, combine_backward, take_rows, to_rows
from ._library import column_major

# --------------------------------------------------------------------------- the fused parts


def _swiglu_mm(
    x: Tensor, w: Tensor, offs: Tensor, src: Optional[Tensor], up: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """``(pre, act)``: ``pre = x[src] @ w[g]`` (``[R, 2F]``, ``[gate | up]``; ``x @ w[g]``
    without ``src``; with ``up``, ``w`` is the gate ``[E, D, F]`` and ``pre = x[src] @
    [w[g] | up[g]]``) and ``act = silu(gate) * up`` (``[R, F]``). One native call where a
    fused kernel runs (``_native.product("swiglu")``: the two weights read as two operands), else
    the gathered products and the row op. Real tensors only (op implementations)."""
    got = _native.product("swiglu", x, w, offs, (up,), src)
    if got is not None:
        pre, act = got
        return pre, act
    pre = _gathered_mm(x, w, offs, src)
    if up is not None:
        pre = torch.cat([pre, _gathered_mm(x, up, offs, src)], 1)
    return pre, _rows.swiglu(pre)


def _gathered_mm(x: Tensor, w: Tensor, offs: Tensor, src: Optional[Tensor]) -> Tensor:
    """``x[src] @ w[g]`` per group (``x @ w[g]`` without ``src``)."""
    return grouped_mm(x, w, offs=offs) if src is None else _native.gather_mm(x, w, offs, src)


# --------------------------------------------------------------------------- swiglu_up


@torch.library.custom_op("groupmm::swiglu_up", mutates_args=())
def _swiglu_up(
    x: Tensor,
    w_in: Tensor,
    offs: Tensor,
    src: Optional[Tensor],
    inverse: Optional[Tensor],
    up: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    return _swiglu_mm(x, w_in, offs, src, up)


@_swiglu_up.register_fake
def _swiglu_up_fake(x, w_in, offs, src, inverse, up=None):
    rows = (x if src is None else src).shape[0]
    width = w_in.shape[-1] * (1 if up is None else 2)
    return x.new_empty(rows, width), x.new_empty(rows, width // 2)


def _swiglu_up_setup(ctx, inputs, output):
    x, w_in, offs, src, inverse = inputs[:5]
    up = inputs[5] if len(inputs) > 5 else None
    # not pre: gated_down keeps it and drops it after its backward, before this one runs
    ctx.save_for_backward(x, w_in, offs, src, inverse, up)
    # act: a cache of silu(gate)*up of pre; gated_down's backward returns pre's whole
    # gradient, the path through act included
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _swiglu_up_grad(ctx, d_pre, d_act):
    x, w_in, offs, src, inverse, up = ctx.saved_tensors
    need = ctx.needs_input_grad  # up's entry only when it was passed
    none = (None,) * len(need)
    if d_pre is None:
        return none
    need_up = len(need) > 5 and need[5]
    dx, dw_in, dup = _up_grads(d_pre, x, w_in, offs, src, inverse, need[0], need[1], up, need_up)
    return (dx, dw_in, None, None, None, dup)[: len(need)]


_swiglu_up.register_autograd(_swiglu_up_grad, setup_context=_swiglu_up_setup)


# --------------------------------------------------------------------------- gated_down


@torch.library.custom_op("groupmm::gated_down", mutates_args=())
def _gated_down(
    pre: Tensor,
    act: Tensor,
    w_out: Tensor,
    offs: Tensor,
    src: Optional[Tensor],
    inverse: Optional[Tensor],
    weights: Optional[Tensor],
    own_pre: bool = False,
) -> Tensor:
    return _gated_down_forward(act, w_out, offs, inverse, weights)


def _gated_down_forward(act, w_out, offs, inverse, weights):
    """The down projection and the weighted combine (op ``gated_down``'s forward); the
    rows themselves without ``inverse`` (:func:`groupmm.fused._block`)."""
    y = grouped_mm(act, w_out, offs=offs)
    return y if inverse is None else combine(y, inverse, weights)


@_gated_down.register_fake
def _gated_down_fake(pre, act, w_out, offs, src, inverse, weights, own_pre=False):
    return act.new_empty((act if inverse is None else inverse).shape[0], w_out.shape[-1])


def _gated_down_setup(ctx, inputs, output):
    pre, act, w_out, offs, src, inverse, weights = inputs[:7]
    # the memory contract: pre and the inputs, nothing of size [R, D] or [R, F]
    ctx.save_for_backward(pre, w_out, offs, src, inverse, weights)
    # own_pre: no one but this op reads pre (expert_block's), so its backward may write
    # pre's gradient over it (_overwrites_pre)
    ctx.own_pre = len(inputs) > 7 and bool(inputs[7])
    ctx.set_materialize_grads(False)


def _gated_down_grad(ctx, d_out):
    """``(d_pre, None, dw_out, None, None, None, dweights)``: ``d_pre`` is ``pre``'s whole
    gradient (``act = silu(gate)·up`` of ``pre``: its path included), ``act`` gets none."""
    pre, w_out, offs, src, inverse, weights = ctx.saved_tensors
    need = ctx.needs_input_grad  # own_pre's entry only when it was passed
    none = (None,) * len(need)
    need_pre, need_w_out = need[0], need[2]
    need_weights = need[6] and weights is not None
    if d_out is None or not (need_pre or need_w_out or need_weights):
        return none
    rows = pre.shape[0]
    acc = torch.promote_types(pre.dtype, torch.float32)
    if weights is None:
        scale = pre.new_ones(rows, dtype=acc)
    else:  # each row's router weight (rows no copy names: 0)
        scale = to_rows(d_out.new_ones(inverse.shape[0], 1, dtype=acc), inverse, weights, rows)
        scale = scale.view(rows)
    # dy, each routed row's copy of its token's gradient (d_out[src]: every row is named
    # once), read by both products: through src inside their GEMMs where the kernels do
    # (reads_in_gemm), else made once by a row gather and read by both.
    double = _rows.differentiable(d_out, w_out, pre, weights)  # double backward
    dy_src = src if src is not None and not double and reads_in_gemm(d_out) else None
    dy = d_out if src is None or dy_src is not None else take_rows(d_out, src)
    if double:
        d_pre, act_s, row_grad = _dgated_composed(dy, w_out, offs, pre, scale)
    elif _overwrites_pre(ctx.own_pre):
        act_s, row_grad = _dgated_over(dy, w_out, offs, pre, scale, dy_src)
        d_pre = pre  # pre's gradient, where pre was
    else:
        d_pre, act_s, row_grad = _dgated(dy, w_out, offs, pre, scale, dy_src)
    del scale
    dweights = None
    if need_weights and weights is not None and not double:
        # dweights[t, j] = row_grad[inverse[t, j]]: one gather of R floats (the row op
        # row_dots on one column ran a warp per token, 10-100 us a step)
        flat = row_grad.index_select(0, inverse.reshape(-1))
        dweights = flat.view(inverse.shape).to(weights.dtype)
    elif need_weights:
        # double backward: combine's weight gradient, <grad, y>, of the rows' own
        # reductions against a gradient of ones (differentiable, no atomics)
        ones = row_grad.new_ones(inverse.shape[0], 1)
        dweights = combine_backward(ones, row_grad.unsqueeze(1), inverse, weights, False, True)[1]
    del row_grad
    dw_out = None
    if need_w_out and dy_src is not None:
        dw_out = _gather_k(act_s, dy, offs, dy_src, True, column_major(w_out))
    elif need_w_out:
        dw_out = _weight_grad(act_s, dy, offs, w_out)
    del act_s, dy
    grads = (d_pre if need_pre else None), None, dw_out, None, None, None, dweights
    return grads + none[7:]


_gated_down.register_autograd(_gated_down_grad, setup_context=_gated_down_setup)


# --------------------------------------------------------------------------- eager path


class _SwigluUpFn(torch.autograd.Function):
    """Op ``swiglu_up`` on plain eager tensors, without the op's dispatcher round trip:
    the same forward, saved tensors and backward (the functions the op registers). A
    custom op call costs ~0.15 ms of Python on the host (``torch._library``'s wrappers),
    twice a step forward and twice backward: at 4k tokens that put the fused step's host
    time above its GPU time. Compiled and traced calls take the op (``fused._block``)."""

    @staticmethod
    def forward(ctx, x, w_in, offs, src, inverse, up=None):
        out = _swiglu_mm(x, w_in, offs, src, up)
        _swiglu_up_setup(ctx, (x, w_in, offs, src, inverse, up), out)
        return out

    @staticmethod
    def backward(ctx, d_pre, d_act):
        return _swiglu_up_grad(ctx, d_pre, d_act)


class _GatedDownFn(torch.autograd.Function):
    """Op ``gated_down`` on plain eager tensors (as :class:`_SwigluUpFn`)."""

    @staticmethod
    def forward(ctx, pre, act, w_out, offs, src, inverse, weights, own_pre):
        out = _gated_down_forward(act, w_out, offs, inverse, weights)
        _gated_down_setup(ctx, (pre, act, w_out, offs, src, inverse, weights, own_pre), out)
        return out

    @staticmethod
    def backward(ctx, d_out):
        return _gated_down_grad(ctx, d_out)
