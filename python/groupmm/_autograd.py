"""The eager autograd shims: ``torch.autograd.Function`` subclasses whose forward and
backward call the Rust extension directly (one call each way; the backward computes both
products in one call). :func:`groupmm.grouped_mm` uses them when an input requires grad
and nothing traces the call; otherwise the ops of ``_library.py`` carry the autograd.
The backward composition itself lives in ``_library.py`` (:func:`backward_products`),
shared with the ops' registered autograd.
"""

import torch

from . import _library
from ._library import backward_products, direct, list_backward_products

__all__ = ["GroupedMM", "GroupedMMList", "apply_grouped_mm"]

_native_mm = _library._native_mm
_native_list = _library._native_list
_functorch_active = torch._C._are_functorch_transforms_active


class GroupedMM(torch.autograd.Function):
    """Autograd shim of the packed forms: ``GroupedMM.apply(a, b, offs, out_dtype)``.

    The forward runs the Rust kernel when ``a``, ``b`` and ``offs`` are plain eager
    tensors and the custom op otherwise; the backward computes the needed products of
    ``dA = grad·bᵀ``, ``dB = aᵀ·grad`` (double backward goes through the ops).
    """

    @staticmethod
    def forward(ctx, a, b, offs, out_dtype, is_direct=None):
        # is_direct: the caller (grouped_mm) already knows the inputs are plain eager
        # tensors; other callers leave it None and the check runs here
        if is_direct or (is_direct is None and direct(a, b, offs)):
            out = _native_mm(a, b, offs, out_dtype)
        else:
            out = _library.mm_op(a, b, offs, out_dtype)
        ctx.save_for_backward(a, b, offs)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        need = ctx.needs_input_grad
        da, db = backward_products(grad, a, b, offs, need[0], need[1])
        return da, db, None, None, None


#: ``torch.autograd.Function.apply`` without its Python wrapper, whose work (binding
#: default arguments for ``setup_context``, functorch dispatch, unwrapping dead functorch
#: wrappers) does not apply to plain tensors outside functorch transforms
_apply_grouped_mm = super(torch.autograd.Function, GroupedMM).apply


def apply_grouped_mm(a, b, offs, out_dtype):
    """``GroupedMM.apply`` for plain eager tensors (what ``grouped_mm`` calls)."""
    if _functorch_active():
        return GroupedMM.apply(a, b, offs, out_dtype, True)
    return _apply_grouped_mm(a, b, offs, out_dtype, True)


class GroupedMMList(torch.autograd.Function):
    """Autograd shim of the list form: ``GroupedMMList.apply(out_dtype, G, *As, *Bs)``
    (inputs flattened so that autograd sees every tensor)."""

    @staticmethod
    def forward(ctx, out_dtype, n, *tensors):
        As, Bs = list(tensors[:n]), list(tensors[n:])
        if direct(*As, *Bs):
            outs = _native_list(As, Bs, out_dtype)
        else:
            outs = _library.list_op(As, Bs, out_dtype)
        ctx.n = n
        ctx.save_for_backward(*As, *Bs)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        saved = ctx.saved_tensors
        As, Bs = list(saved[:n]), list(saved[n:])
        nig = ctx.needs_input_grad[2:]
        need_a, need_b = any(nig[:n]), any(nig[n:])
        da, db = list_backward_products(list(grads), As, Bs, need_a, need_b)
        da = [None] * n if da is None else [d if nig[i] else None for i, d in enumerate(da)]
        db = [None] * n if db is None else [d if nig[n + i] else None for i, d in enumerate(db)]
        return (None, None, *da, *db)
