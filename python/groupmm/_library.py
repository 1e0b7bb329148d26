"""The ``torch.library`` custom ops ``torch.ops.groupmm.*``: what ``torch.compile``,
FakeTensor tracing, functionalization and explicit ``torch.ops`` calls see.

Each op's real kernel is the Rust extension; its fake kernel (``_*_fake``) asks the Rust
shape rule (``_native.packed_out_shape`` / ``_native.list_out_shapes``) for the output
shape, so shape errors have one owner and one message. Under dynamic shapes a size may be
symbolic: the Rust rule then checks the example sizes behind the symbols (or, for
data-dependent sizes, the structure alone), and the table ``_PACKED_OUT`` builds the
symbolic output shape. Dtypes are checked by the real kernel when the graph runs (a
compiled call with mismatched dtypes raises the kernel's TypeError).

The ops carry autograd formulas built from the ops themselves (so double backward and
``torch.compile``'s backward work). The eager backward of the autograd Functions
(``_autograd.py``) shares :func:`backward_products` with them: one backward composition.
"""

# NB: no ``from __future__ import annotations`` here: torch.library infers op schemas
# from real annotation objects.
from typing import List, Optional, Tuple

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

from . import _native

__all__ = [
    "backward_products",
    "direct",
    "list_backward_products",
    "list_out_shapes",
    "packed_out_shape",
]

_is_compiling = torch.compiler.is_compiling
_len_dispatch_stack = torch._C._len_torch_dispatch_stack
_grad_enabled = torch.is_grad_enabled
#: tensor types the extension may read directly (subclasses need the dispatcher)
PLAIN = (Tensor, torch.nn.Parameter)
_native_mm = _native.grouped_mm
_native_mm_bwd = _native.grouped_mm_backward
_native_list = _native.grouped_mm_list
_native_list_bwd = _native.grouped_mm_list_backward


def direct(*tensors) -> bool:
    """True when the Rust extension may be called directly on ``tensors``: plain eager
    tensors, no compiler, no dispatch mode (FakeTensor, functionalization, make_fx,
    compiled autograd). Otherwise the work must go through the ops so that it is traced
    instead of run on data that does not exist. Non-tensors (None, numpy arrays, bad
    arguments) count as direct: the extension reports bad ones by name."""
    if _is_compiling() or _len_dispatch_stack():
        return False
    for t in tensors:
        if type(t) not in PLAIN and isinstance(t, Tensor):
            return False
    return True


def op(name: str, impl, fake, mutates=()):
    """Registers ``impl`` as ``torch.ops.groupmm.<name>`` (writing the arguments named in
    ``mutates``) with ``fake`` and returns the function the callers use: ``impl`` itself
    on plain eager tensors, the op otherwise."""
    registered = torch.library.custom_op(f"groupmm::{name}", mutates_args=mutates)(impl)
    registered.register_fake(fake)

    def call(*args):
        return impl(*args) if direct(*args) else registered(*args)

    call.__name__ = name
    call.__doc__ = impl.__doc__
    return call


# --------------------------------------------------------------------------- shapes


def _hint(d):
    """A size as a plain int: itself, or the example value behind a symbolic size
    (dynamic shapes); None when there is none (data-dependent sizes)."""
    if type(d) is int:
        return d
    h = getattr(getattr(d, "node", None), "hint", None)
    return h if type(h) is int else None


def _hints(shape):
    """Sizes as plain ints, or None when one has no example value."""
    out = [_hint(d) for d in shape]
    return None if None in out else out


#: output shape of each packed form (a.dim(), b.dim()) from the input shapes and the
#: number of groups; only used for symbolic shapes, after the Rust rule accepted the form
_PACKED_OUT = {
    (2, 3): lambda sa, sb, g: [sa[0], sb[2]],
    (2, 2): lambda sa, sb, g: [g, sa[0], sb[1]],
    (3, 2): lambda sa, sb, g: [sa[1], sb[1]],
    (3, 3): lambda sa, sb, g: [sa[0], sa[1], sb[2]],
}


def _concrete(*sizes) -> bool:
    return all(type(d) is int for d in sizes)


def packed_out_shape(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> list:
    """Output shape of a packed product; raises the Rust shape errors.

    Symbolic sizes (dynamic shapes) are checked with their example values (the call the
    trace is made for; nothing is guarded on them) or, without any, on a skeleton of
    ones, which only exercises the structural rules (numbers of dimensions, whether offs
    is needed); the output shape then comes from ``_PACKED_OUT``."""
    # a non-1-D offs is refused by the kernel when it runs; give the rule a length
    g = None if offs is None else offs.shape[0] if offs.dim() == 1 else offs.numel()
    if _concrete(*a.shape, *b.shape) and (g is None or type(g) is int):
        return _native.packed_out_shape(list(a.shape), list(b.shape), g)
    ha, hb, hg = _hints(a.shape), _hints(b.shape), None if g is None else _hint(g)
    if ha is not None and hb is not None and (g is None or hg is not None):
        _native.packed_out_shape(ha, hb, hg)
    else:
        _native.packed_out_shape([1] * a.dim(), [1] * b.dim(), None if g is None else 1)
    return _PACKED_OUT[(a.dim(), b.dim())](a.shape, b.shape, g)


def list_out_shapes(As: List[Tensor], Bs: List[Tensor]) -> list:
    """Output shapes ``[M_i, N_i]`` of a list product; raises the Rust shape errors
    (symbolic sizes as in :func:`packed_out_shape`)."""
    if _concrete(*(d for x in (*As, *Bs) for d in x.shape)):
        return _native.list_out_shapes([list(x.shape) for x in As], [list(x.shape) for x in Bs])
    ha, hb = [_hints(x.shape) for x in As], [_hints(x.shape) for x in Bs]
    if None not in ha and None not in hb:
        _native.list_out_shapes(ha, hb)
    else:
        _native.list_out_shapes([[1] * x.dim() for x in As], [[1] * x.dim() for x in Bs])
    return [[a.shape[0], b.shape[1]] for a, b in zip(As, Bs)]


# --------------------------------------------------------------------------- packed ops


@torch.library.custom_op("groupmm::grouped_mm", mutates_args=())
def _grouped_mm(
    a: Tensor, b: Tensor, offs: Optional[Tensor], out_dtype: Optional[torch.dtype]
) -> Tensor:
    return _native_mm(a, b, offs, out_dtype)


@_grouped_mm.register_fake
def _grouped_mm_fake(a, b, offs, out_dtype):
    return a.new_empty(packed_out_shape(a, b, offs), dtype=out_dtype or a.dtype)


@torch.library.custom_op("groupmm::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(
    grad: Tensor, a: Tensor, b: Tensor, offs: Optional[Tensor], need_a: bool, need_b: bool
) -> Tuple[Tensor, Tensor]:
    da, db = _native_mm_bwd(grad, a, b, offs, need_a, need_b)
    return (
        da if da is not None else a.new_empty((0,)),
        db if db is not None else b.new_empty((0,)),
    )


def column_major(x: Tensor) -> bool:
    """The Rust rule ``shape::column_major`` (a packed gradient follows its operand's
    layout): the last two dimensions stored column by column, both longer than 1. Traced
    with data-dependent sizes (expert parallelism's received rows), a size or stride the
    trace cannot decide counts as what the real tensor almost surely has (a column-major
    layout is column-major, its extents longer than 1) instead of a guard."""
    if x.dim() < 2:
        return False
    if type(x.shape[-2]) is int and type(x.stride(-1)) is int:  # eager: plain ints
        return x.shape[-2] > 1 and x.shape[-1] > 1 and x.stride(-2) == 1 and x.stride(-1) != 1
    return (
        guard_or_false(x.stride(-2) == 1)
        and guard_or_true(x.stride(-1) != 1)
        and guard_or_true(x.shape[-2] > 1)
        and guard_or_true(x.shape[-1] > 1)
    )


def _grad_like(x: Tensor) -> Tensor:
    """An empty gradient of ``x`` in ``x``'s layout, as the packed backward returns it."""
    if column_major(x):
        return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2])).transpose(-2, -1)
    return x.new_empty(x.shape)


@_grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(grad, a, b, offs, need_a, need_b):
    packed_out_shape(a, b, offs)  # the forward's shape errors
    return (
        _grad_like(a) if need_a else a.new_empty((0,)),
        _grad_like(b) if need_b else b.new_empty((0,)),
    )


@torch.library.custom_op("groupmm::grouped_mm_out", mutates_args=("out",))
def _grouped_mm_out(
    a: Tensor, b: Tensor, offs: Optional[Tensor], out_dtype: Optional[torch.dtype], out: Tensor
) -> None:
    _native_mm(a, b, offs, out_dtype, out)


@_grouped_mm_out.register_fake
def _grouped_mm_out_fake(a, b, offs, out_dtype, out):
    packed_out_shape(a, b, offs)  # out itself is checked by the kernel, before writing


#: the ops' default overloads, called without the packet's overload resolution
mm_op = torch.ops.groupmm.grouped_mm.default
mm_backward_op = torch.ops.groupmm.grouped_mm_backward.default
mm_out_op = torch.ops.groupmm.grouped_mm_out.default


def backward_products(grad, a, b, offs, need_a, need_b):
    """``(dA, dB)`` of the grouped product ``a @ b`` (``dA = grad·bᵀ``, ``dB = aᵀ·grad``),
    each ``None`` when not needed: the Rust backward directly when nothing records it,
    else the differentiable op (double backward, tracing)."""
    if not (need_a or need_b):
        return None, None
    if grad.dtype != a.dtype:  # out_dtype=float32 from 16-bit inputs
        grad = grad.to(a.dtype)
    if not _grad_enabled() and direct(grad, a, b, offs):
        return _native_mm_bwd(grad, a, b, offs, need_a, need_b)
    da, db = mm_backward_op(grad, a, b, offs, need_a, need_b)
    return (da if need_a else None), (db if need_b else None)


def _grouped_mm_setup(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_grad(ctx, grad):
    a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    da, db = backward_products(grad, a, b, offs, need_a, need_b)
    return da, db, None, None


_grouped_mm.register_autograd(_grouped_mm_grad, setup_context=_grouped_mm_setup)


def _grouped_mm_backward_setup(ctx, inputs, output):
    grad, a, b, offs, need_a, need_b = inputs
    ctx.save_for_backward(grad, a, b, offs)
    ctx.need = (need_a, need_b)


def _grouped_mm_backward_grad(ctx, g_da, g_db):
    # dA = grad·bᵀ and dB = aᵀ·grad are bilinear; their derivatives are grouped
    # products of the same form, built from the differentiable op (any order).
    grad, a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.need
    want_grad, want_a, want_b = ctx.needs_input_grad[:3]
    d_grad = d_a = d_b = None
    if need_a:
        if want_grad:
            d_grad = mm_op(g_da, b, offs, None)
        if want_b:
            d_b = mm_op(g_da.mT, grad, offs, None)
    if need_b:
        if want_grad:
            t = mm_op(a, g_db, offs, None)
            d_grad = t if d_grad is None else d_grad + t
        if want_a:
            d_a = mm_op(grad, g_db.mT, offs, None)
    return d_grad, d_a, d_b, None, None, None


_grouped_mm_backward.register_autograd(
    _grouped_mm_backward_grad, setup_context=_grouped_mm_backward_setup
)


# --------------------------------------------------------------------------- list ops


@torch.library.custom_op("groupmm::grouped_mm_list", mutates_args=())
def _grouped_mm_list(
    As: List[Tensor], Bs: List[Tensor], out_dtype: Optional[torch.dtype]
) -> List[Tensor]:
    return list(_native_list(As, Bs, out_dtype))


@_grouped_mm_list.register_fake
def _grouped_mm_list_fake(As, Bs, out_dtype):
    return [
        a.new_empty(shape, dtype=out_dtype or a.dtype)
        for a, shape in zip(As, list_out_shapes(As, Bs))
    ]


@torch.library.custom_op("groupmm::grouped_mm_list_out", mutates_args=("out",))
def _grouped_mm_list_out(
    As: List[Tensor], Bs: List[Tensor], out_dtype: Optional[torch.dtype], out: List[Tensor]
) -> None:
    _native_list(As, Bs, out_dtype, out)


@_grouped_mm_list_out.register_fake
def _grouped_mm_list_out_fake(As, Bs, out_dtype, out):
    list_out_shapes(As, Bs)  # out itself is checked by the kernel, before writing


@torch.library.custom_op("groupmm::grouped_mm_list_backward", mutates_args=())
def _grouped_mm_list_backward(
    grads: List[Tensor], As: List[Tensor], Bs: List[Tensor], need_a: bool, need_b: bool
) -> Tuple[List[Tensor], List[Tensor]]:
    da, db = _native_list_bwd(grads, As, Bs, need_a, need_b)
    return (list(da) if da is not None else []), (list(db) if db is not None else [])


@_grouped_mm_list_backward.register_fake
def _grouped_mm_list_backward_fake(grads, As, Bs, need_a, need_b):
    list_out_shapes(As, Bs)  # the forward's shape errors
    return (
        [a.new_empty(a.shape) for a in As] if need_a else [],
        [b.new_empty(b.shape) for b in Bs] if need_b else [],
    )


list_op = torch.ops.groupmm.grouped_mm_list.default
list_backward_op = torch.ops.groupmm.grouped_mm_list_backward.default
list_out_op = torch.ops.groupmm.grouped_mm_list_out.default


def list_backward_products(grads, As, Bs, need_a, need_b):
    """``(dAs, dBs)`` of the list product, each a list or ``None`` when not needed."""
    grads = [g if g.dtype == a.dtype else g.to(a.dtype) for g, a in zip(grads, As)]
    if not _grad_enabled() and direct(*grads, *As, *Bs):
        da, db = _native_list_bwd(grads, As, Bs, need_a, need_b)
        return (list(da) if da is not None else None), (list(db) if db is not None else None)
    da, db = list_backward_op(grads, As, Bs, need_a, need_b)
    return (da if need_a else None), (db if need_b else None)


def _grouped_mm_list_setup(ctx, inputs, output):
    As, Bs, _ = inputs
    ctx.n = len(As)
    ctx.save_for_backward(*As, *Bs)


def _grouped_mm_list_grad(ctx, grads):
    n = ctx.n
    saved = ctx.saved_tensors
    As, Bs = list(saved[:n]), list(saved[n:])
    need_a = any(ctx.needs_input_grad[0]) if n else False
    need_b = any(ctx.needs_input_grad[1]) if n else False
    da, db = list_backward_products(list(grads), As, Bs, need_a, need_b)
    # register_autograd wants a list (of tensors or None) for each List[Tensor] input
    return (da if da is not None else [None] * n), (db if db is not None else [None] * n), None


_grouped_mm_list.register_autograd(_grouped_mm_list_grad, setup_context=_grouped_mm_list_setup)


def _grouped_mm_list_backward_setup(ctx, inputs, output):
    grads, As, Bs, need_a, need_b = inputs
    ctx.n = len(As)
    ctx.need = (need_a, need_b)
    ctx.save_for_backward(*grads, *As, *Bs)


def _grouped_mm_list_backward_grad(ctx, g_da, g_db):
    n = ctx.n
    saved = ctx.saved_tensors
    grads, As, Bs = list(saved[:n]), list(saved[n : 2 * n]), list(saved[2 * n :])
    need_a, need_b = ctx.need
    d_grads = d_as = d_bs = None
    if need_a:
        d_grads = list_op(list(g_da), Bs, None)
        d_bs = list_op([g.mT for g in g_da], grads, None)
    if need_b:
        t = list_op(As, list(g_db), None)
        d_grads = t if d_grads is None else [x + y for x, y in zip(d_grads, t)]
        d_as = list_op(grads, [g.mT for g in g_db], None)
    none = [None] * n
    return (
        none if d_grads is None else d_grads,
        none if d_as is None else d_as,
        none if d_bs is None else d_bs,
        None,
        None,
    )


_grouped_mm_list_backward.register_autograd(
    _grouped_mm_list_backward_grad, setup_context=_grouped_mm_list_backward_setup
)
