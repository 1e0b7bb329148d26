"""The ops of the routed SwiGLU expert block's two halves, ``groupmm::expert_up`` (gather,
up projection, SwiGLU; keeps ``pre``) and ``groupmm::expert_down`` (down projection,
router weights, combine; keeps ``y``), with their fakes and autograd formulas;
:func:`groupmm.fused.expert_up` and :func:`groupmm.fused.expert_down` check their
arguments and call them.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._api import grouped_mm
from ._fused_backward import _up_grads
from ._fused_ops import _swiglu_mm
from ._glue import combine, combine_backward, swiglu_grad

# --------------------------------------------------------------------------- expert_up


@torch.library.custom_op("groupmm::expert_up", mutates_args=())
def _expert_up(
    x: Tensor, w: Tensor, offs: Tensor, src: Tensor, inverse: Tensor
) -> Tuple[Tensor, Tensor]:
    pre, act = _swiglu_mm(x, w, offs, src)
    return act, pre


@_expert_up.register_fake
def _expert_up_fake(x, w, offs, src, inverse):
    rows, width = src.shape[0], w.shape[-1]
    return x.new_empty(rows, width // 2), x.new_empty(rows, width)


def _expert_up_setup(ctx, inputs, output):
    x, w, offs, src, inverse = inputs
    ctx.save_for_backward(x, w, offs, src, inverse, output[1])  # not x[src], not act
    ctx.set_materialize_grads(False)


def _expert_up_grad(ctx, d_act, d_pre):
    x, w, offs, src, inverse, pre = ctx.saved_tensors
    dpre = None if d_act is None else swiglu_grad(d_act, pre)
    if d_pre is not None:  # only when pre is used (double backward)
        dpre = d_pre if dpre is None else dpre + d_pre
    if dpre is None:
        return None, None, None, None, None
    need_x, need_w = ctx.needs_input_grad[:2]
    dx, dw, _ = _up_grads(dpre, x, w, offs, src, inverse, need_x, need_w)
    return dx, dw, None, None, None


_expert_up.register_autograd(_expert_up_grad, setup_context=_expert_up_setup)


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
