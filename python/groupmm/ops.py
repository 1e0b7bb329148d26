"""``grouped_mm``: the public function, its autograd shim and its ``torch.library`` ops.

Eager calls go straight to the Rust extension (``groupmm._native``); calls that need
gradients go through :class:`GroupedMM` / :class:`GroupedMMList`
(``torch.autograd.Function``), whose backward calls Rust for both products
(``dA = dC·Bᵀ``, ``dB = Aᵀ·dC``). Under ``torch.compile`` the same work is expressed
with the custom ops ``torch.ops.groupmm.*`` (registered below with fake kernels and
autograd formulas), so a fullgraph trace goes through. The backward is itself built from
differentiable ops, so double backward works.
"""

# NB: no ``from __future__ import annotations`` here: torch.library infers op schemas
# from real annotation objects.
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _native

try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # pragma: no cover - very old torch

    def _get_current_dispatch_mode():
        return None


__all__ = ["grouped_mm", "GroupedMM", "GroupedMMList"]

_is_compiling = torch.compiler.is_compiling
_PLAIN = (Tensor, torch.nn.Parameter)
_native_mm = _native.grouped_mm
_native_mm_bwd = _native.grouped_mm_backward
_native_list = _native.grouped_mm_list
_native_list_bwd = _native.grouped_mm_list_backward


def _direct(*tensors) -> bool:
    """True when the Rust extension may be called directly on ``tensors``: plain eager
    tensors, no compiler, no tracing mode (FakeTensor, functionalization, make_fx).
    Otherwise the work must go through the ``torch.ops.groupmm`` custom ops so that it is
    traced instead of run on data that does not exist."""
    if _is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    # non-tensors (None, numpy arrays, bad arguments) go to the extension, which
    # reports bad ones by name
    for t in tensors:
        if isinstance(t, Tensor) and type(t) not in _PLAIN:
            return False
    return True


# --------------------------------------------------------------------------- autocast


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype for ``device_type`` when autocast is on there, else None."""
    if device_type not in ("cpu", "cuda"):
        return None
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _cast(t: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    """Autocast's rule (``cached_cast``): floating tensors other than float64 go to
    ``dtype``; the cast is differentiable, so gradients come back in ``t.dtype``."""
    if dtype is None or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


# --------------------------------------------------------------------------- fake shapes


def _concrete(*shapes) -> bool:
    return all(isinstance(d, int) for s in shapes for d in s)


def _packed_out_shape(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> List:
    """Output shape of a packed product; raises the Rust shape errors when shapes are
    concrete (symbolic shapes under dynamic compilation only get the ndim rules)."""
    n_offs = None if offs is None else offs.shape[0]
    if _concrete(a.shape, b.shape, () if offs is None else offs.shape):
        return list(_native.packed_out_shape(list(a.shape), list(b.shape), n_offs))
    nd = (a.dim(), b.dim())
    if nd == (2, 3):
        return [a.shape[0], b.shape[2]]
    if nd == (2, 2):
        return [n_offs, a.shape[0], b.shape[1]]
    if nd == (3, 2):
        return [a.shape[1], b.shape[1]]
    if nd == (3, 3):
        return [a.shape[0], a.shape[1], b.shape[2]]
    raise ValueError(f"a, b: expected 2-D or 3-D tensors, found {a.dim()}-D and {b.dim()}-D")


def _check_fake_dtypes(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> None:
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected dtype {a.dtype} (the dtype of a), found {b.dtype}")
    if offs is not None and offs.dtype != torch.int32:
        raise TypeError(f"offs: expected dtype torch.int32, found {offs.dtype}")


# --------------------------------------------------------------------------- packed ops


@torch.library.custom_op("groupmm::grouped_mm", mutates_args=())
def _op_mm(
    a: Tensor, b: Tensor, offs: Optional[Tensor], out_dtype: Optional[torch.dtype]
) -> Tensor:
    return _native_mm(a, b, offs, out_dtype)


@_op_mm.register_fake
def _(a, b, offs, out_dtype):
    _check_fake_dtypes(a, b, offs)
    return a.new_empty(_packed_out_shape(a, b, offs), dtype=out_dtype or a.dtype)


@torch.library.custom_op("groupmm::grouped_mm_backward", mutates_args=())
def _op_mm_bwd(
    grad: Tensor, a: Tensor, b: Tensor, offs: Optional[Tensor], need_a: bool, need_b: bool
) -> Tuple[Tensor, Tensor]:
    da, db = _native_mm_bwd(grad, a, b, offs, need_a, need_b)
    return (
        da if da is not None else a.new_empty((0,)),
        db if db is not None else b.new_empty((0,)),
    )


@_op_mm_bwd.register_fake
def _(grad, a, b, offs, need_a, need_b):
    _check_fake_dtypes(a, b, offs)
    return (
        a.new_empty(a.shape if need_a else (0,)),
        b.new_empty(b.shape if need_b else (0,)),
    )


@torch.library.custom_op("groupmm::grouped_mm_out", mutates_args=("out",))
def _op_mm_out(
    a: Tensor, b: Tensor, offs: Optional[Tensor], out_dtype: Optional[torch.dtype], out: Tensor
) -> None:
    _native_mm(a, b, offs, out_dtype, out)


@_op_mm_out.register_fake
def _(a, b, offs, out_dtype, out):
    _check_fake_dtypes(a, b, offs)
    shape = _packed_out_shape(a, b, offs)
    if list(out.shape) != list(shape):
        raise ValueError(f"out: expected shape {list(shape)}, found {list(out.shape)}")


def _mm_setup(ctx, inputs, output):
    a, b, offs, _ = inputs
    ctx.save_for_backward(a, b, offs)


def _mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    da, db = _backward_products(grad, a, b, offs, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
    return da, db, None, None


_op_mm.register_autograd(_mm_backward, setup_context=_mm_setup)


def _bwd_setup(ctx, inputs, output):
    grad, a, b, offs, need_a, need_b = inputs
    ctx.save_for_backward(grad, a, b, offs)
    ctx.need = (need_a, need_b)


def _bwd_backward(ctx, g_da, g_db):
    # dA = grad·bᵀ and dB = aᵀ·grad are bilinear; their derivatives are grouped
    # products of the same form, built from the differentiable op (any order).
    grad, a, b, offs = ctx.saved_tensors
    need_a, need_b = ctx.need
    want_grad, want_a, want_b = ctx.needs_input_grad[:3]
    d_grad = d_a = d_b = None
    if need_a:
        if want_grad:
            d_grad = _op_mm_diff(g_da, b, offs)
        if want_b:
            d_b = _op_mm_diff(g_da.mT, grad, offs)
    if need_b:
        if want_grad:
            t = _op_mm_diff(a, g_db, offs)
            d_grad = t if d_grad is None else d_grad + t
        if want_a:
            d_a = _op_mm_diff(grad, g_db.mT, offs)
    return d_grad, d_a, d_b, None, None, None


_op_mm_bwd.register_autograd(_bwd_backward, setup_context=_bwd_setup)


def _op_mm_diff(a: Tensor, b: Tensor, offs: Optional[Tensor]) -> Tensor:
    """A differentiable grouped product (the op, with its registered autograd)."""
    return torch.ops.groupmm.grouped_mm(a, b, offs, None)


def _backward_products(grad, a, b, offs, need_a, need_b):
    """``(dA, dB)`` of ``a @ b`` (grouped), each ``None`` when not needed."""
    if not (need_a or need_b):
        return None, None
    if grad.dtype != a.dtype:  # out_dtype=float32 from 16-bit inputs
        grad = grad.to(a.dtype)
    if torch.is_grad_enabled() or not _direct(grad, a, b, offs):
        da, db = torch.ops.groupmm.grouped_mm_backward(grad, a, b, offs, need_a, need_b)
        return (da if need_a else None), (db if need_b else None)
    return _native_mm_bwd(grad, a, b, offs, need_a, need_b)


class GroupedMM(torch.autograd.Function):
    """Autograd shim of the packed forms: forward and both backward products in Rust."""

    @staticmethod
    def forward(ctx, a, b, offs, out_dtype):
        if _direct(a, b, offs):
            out = _native_mm(a, b, offs, out_dtype)
        else:
            out = torch.ops.groupmm.grouped_mm(a, b, offs, out_dtype)
        ctx.save_for_backward(a, b, offs)
        return out

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        da, db = _backward_products(
            grad, a, b, offs, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return da, db, None, None


# --------------------------------------------------------------------------- list ops


@torch.library.custom_op("groupmm::grouped_mm_list", mutates_args=())
def _op_list(As: List[Tensor], Bs: List[Tensor], out_dtype: Optional[torch.dtype]) -> List[Tensor]:
    return list(_native_list(As, Bs, out_dtype))


@_op_list.register_fake
def _(As, Bs, out_dtype):
    if len(As) != len(Bs):
        raise ValueError(
            f"As and Bs: expected sequences of the same length, found {len(As)} and {len(Bs)}"
        )
    return [
        a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)
        for a, b in _check_fake_list(As, Bs)
    ]


def _check_fake_list(As, Bs):
    for i, (a, b) in enumerate(zip(As, Bs)):
        if a.dim() != 2:
            raise ValueError(f"As[{i}]: expected a 2-D tensor [M, K], found {a.dim()}-D")
        if b.dim() != 2:
            raise ValueError(f"Bs[{i}]: expected a 2-D tensor [K, N], found {b.dim()}-D")
        if _concrete(a.shape, b.shape) and b.shape[0] != a.shape[1]:
            raise ValueError(
                f"Bs[{i}]: expected shape [K={a.shape[1]}, N] (K = As[{i}].shape[1]), "
                f"found {list(b.shape)}"
            )
        if a.dtype != As[0].dtype or b.dtype != As[0].dtype:
            raise TypeError(f"As[{i}], Bs[{i}]: expected dtype {As[0].dtype} (the dtype of As[0])")
    return list(zip(As, Bs))


@torch.library.custom_op("groupmm::grouped_mm_list_out", mutates_args=("out",))
def _op_list_out(
    As: List[Tensor], Bs: List[Tensor], out_dtype: Optional[torch.dtype], out: List[Tensor]
) -> None:
    _native_list(As, Bs, out_dtype, out)


@_op_list_out.register_fake
def _(As, Bs, out_dtype, out):
    if len(As) != len(Bs) or len(out) != len(As):
        raise ValueError(
            f"As, Bs and out: expected sequences of the same length, found {len(As)}, "
            f"{len(Bs)} and {len(out)}"
        )
    for i, (a, b) in enumerate(_check_fake_list(As, Bs)):
        if _concrete(out[i].shape, a.shape, b.shape) and list(out[i].shape) != [
            a.shape[0],
            b.shape[1],
        ]:
            raise ValueError(
                f"out[{i}]: expected shape {[a.shape[0], b.shape[1]]}, found {list(out[i].shape)}"
            )


@torch.library.custom_op("groupmm::grouped_mm_list_backward", mutates_args=())
def _op_list_bwd(
    grads: List[Tensor], As: List[Tensor], Bs: List[Tensor], need_a: bool, need_b: bool
) -> Tuple[List[Tensor], List[Tensor]]:
    da, db = _native_list_bwd(grads, As, Bs, need_a, need_b)
    return (list(da) if da is not None else []), (list(db) if db is not None else [])


@_op_list_bwd.register_fake
def _(grads, As, Bs, need_a, need_b):
    return (
        [a.new_empty(a.shape) for a in As] if need_a else [],
        [b.new_empty(b.shape) for b in Bs] if need_b else [],
    )


def _list_setup(ctx, inputs, output):
    As, Bs, _ = inputs
    ctx.n = len(As)
    ctx.save_for_backward(*As, *Bs)


def _list_backward(ctx, grads):
    n = ctx.n
    saved = ctx.saved_tensors
    As, Bs = list(saved[:n]), list(saved[n:])
    need_a = any(ctx.needs_input_grad[0]) if n else False
    need_b = any(ctx.needs_input_grad[1]) if n else False
    da, db = _list_backward_products(list(grads), As, Bs, need_a, need_b)
    # register_autograd wants a list (of tensors or None) for each List[Tensor] input
    return (da if da is not None else [None] * n), (db if db is not None else [None] * n), None


_op_list.register_autograd(_list_backward, setup_context=_list_setup)


def _list_bwd_setup(ctx, inputs, output):
    grads, As, Bs, need_a, need_b = inputs
    ctx.n = len(As)
    ctx.need = (need_a, need_b)
    ctx.save_for_backward(*grads, *As, *Bs)


def _list_bwd_backward(ctx, g_da, g_db):
    n = ctx.n
    saved = ctx.saved_tensors
    grads, As, Bs = list(saved[:n]), list(saved[n : 2 * n]), list(saved[2 * n :])
    need_a, need_b = ctx.need
    mm = torch.ops.groupmm.grouped_mm_list
    d_grads = d_as = d_bs = None
    if need_a:
        d_grads = mm(list(g_da), Bs, None)
        d_bs = mm([g.mT for g in g_da], grads, None)
    if need_b:
        t = mm(As, list(g_db), None)
        d_grads = t if d_grads is None else [x + y for x, y in zip(d_grads, t)]
        d_as = mm(grads, [g.mT for g in g_db], None)
    none = [None] * n
    return (
        none if d_grads is None else d_grads,
        none if d_as is None else d_as,
        none if d_bs is None else d_bs,
        None,
        None,
    )


_op_list_bwd.register_autograd(_list_bwd_backward, setup_context=_list_bwd_setup)


def _list_backward_products(grads, As, Bs, need_a, need_b):
    grads = [g if g.dtype == a.dtype else g.to(a.dtype) for g, a in zip(grads, As)]
    if torch.is_grad_enabled() or not _direct(*grads, *As, *Bs):
        da, db = torch.ops.groupmm.grouped_mm_list_backward(grads, As, Bs, need_a, need_b)
        return (da if need_a else None), (db if need_b else None)
    da, db = _native_list_bwd(grads, As, Bs, need_a, need_b)
    return (list(da) if da is not None else None), (list(db) if db is not None else None)


class GroupedMMList(torch.autograd.Function):
    """Autograd shim of the list form (inputs flattened: ``out_dtype, G, *As, *Bs``)."""

    @staticmethod
    def forward(ctx, out_dtype, n, *tensors):
        As, Bs = list(tensors[:n]), list(tensors[n:])
        if _direct(*As, *Bs):
            outs = _native_list(As, Bs, out_dtype)
        else:
            outs = torch.ops.groupmm.grouped_mm_list(As, Bs, out_dtype)
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
        da, db = _list_backward_products(list(grads), As, Bs, need_a, need_b)
        da = [None] * n if da is None else [d if nig[i] else None for i, d in enumerate(da)]
        db = [None] * n if db is None else [d if nig[n + i] else None for i, d in enumerate(db)]
        return (None, None, *da, *db)


# --------------------------------------------------------------------------- public API


def grouped_mm(
    a,
    b,
    offs: Optional[Tensor] = None,
    *,
    bias: None = None,
    out_dtype: Optional[torch.dtype] = None,
    out=None,
):
    """Grouped matrix multiply.

    **List form** — ``grouped_mm(As, Bs)``: ``As[i]`` is ``[M_i, K_i]``, ``Bs[i]`` is
    ``[K_i, N_i]`` (any per-group sizes, 0 included); returns the list of ``As[i] @ Bs[i]``.

    **Packed forms** — the meaning of ``torch.nn.functional.grouped_mm``:

    ==============  ===============  ======  ============  ===========================
    a               b                offs    out           use
    ==============  ===============  ======  ============  ===========================
    ``[T, K]``      ``[G, K, N]``    ``[G]`` ``[T, N]``    MoE expert forward, dX
    ``[M, T]``      ``[T, N]``       ``[G]`` ``[G, M, N]`` dW (groups along reduction)
    ``[G, M, K]``   ``[K, N]``       ``[G]`` ``[M, N]``    groups along N
    ``[G, M, K]``   ``[G, K, N]``    none    ``[G, M, N]`` batched
    ==============  ===============  ======  ============  ===========================

    ``offs`` (int32, same device) holds the cumulative END of each group; rows/columns
    past ``offs[-1]`` are zero in the output and get zero gradient.

    Args:
        a, b: tensors (float16, bfloat16, float32, float64; any strides) or numpy
            arrays (CPU, no autograd), or sequences of 2-D tensors for the list form.
        offs: group ends for the packed forms that need them.
        bias: accepted for signature compatibility with ``F.grouped_mm``; must be None.
        out_dtype: ``torch.float32`` to get float32 output from 16-bit inputs.
        out: optional output (a tensor, or a list of tensors for the list form) written
            in place; only when no input requires grad.

    Returns:
        A tensor (packed forms) or a list of tensors (list form); outputs carry
        ``grad_fn`` when an input requires grad.
    """
    if bias is not None:
        raise ValueError("bias: not supported by groupmm.grouped_mm; add it to the output instead")
    if isinstance(a, (list, tuple)):
        if offs is not None:
            raise ValueError("offs: must be None for the list form grouped_mm(As, Bs)")
        return _grouped_mm_list(a, b, out_dtype, out)
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        # numpy arrays, or bad arguments that the extension reports by name
        return _native_mm(a, b, offs, out_dtype, out)
    _check_out_dtype(out_dtype)
    direct = _direct(a, b, offs)
    if direct:
        a, b = _dense("a", a), _dense("b", b)
        if isinstance(offs, Tensor):
            offs = _dense("offs", offs)
    if out is not None:
        if not isinstance(out, Tensor):
            raise TypeError(f"out: expected a torch.Tensor, found {type(out).__name__}")
        _check_out_grad(out, (a, b))
        if direct:
            _dense("out", out, output=True)
        # like torch.mm(out=): autocast does not apply to out= calls
        if direct:
            _native_mm(a, b, offs, out_dtype, out)
            _bump_version(out)
            return out
        torch.ops.groupmm.grouped_mm_out(a, b, offs, out_dtype, out)
        return out
    if not direct:
        # compiling or tracing: the custom op (autograd and autocast registered on it)
        return torch.ops.groupmm.grouped_mm(a, b, offs, out_dtype)
    cast = _autocast_dtype("cuda" if a.is_cuda else "cpu" if a.is_cpu else "")
    if cast is not None:
        a, b = _cast(a, cast), _cast(b, cast)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return GroupedMM.apply(a, b, offs, out_dtype)
    return _native_mm(a, b, offs, out_dtype)


def _dense(name: str, t: Tensor, output: bool = False) -> Tensor:
    """The extension reads raw strided memory: refuse sparse/other layouts by name, and
    apply a pending negation (``t.is_neg()``, a lazy view) to inputs; an output cannot
    carry one."""
    if t.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense (strided) tensor, found layout {t.layout}")
    if output and t.is_inference() and not torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{name}: is an inference tensor; like any in-place update it can only be "
            "written inside torch.inference_mode()"
        )
    if t.is_neg():
        if output:
            raise ValueError(f"{name}: is a lazily negated view (is_neg()); pass a plain tensor")
        return t.resolve_neg()
    return t


def _bump_version(*outs: Tensor) -> None:
    """Written in place behind autograd's back: bump the version counters (as any
    in-place torch op does) so that a graph that saved ``out`` notices the change."""
    for o in outs:
        torch.autograd.graph.increment_version(o)


def _check_out_dtype(out_dtype) -> None:
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(
            f"out_dtype: expected a torch.dtype or None, found {type(out_dtype).__name__}"
        )


def _check_out_grad(out, inputs) -> None:
    """``out=`` is not differentiable (like ``torch.mm(out=)``)."""
    if not torch.is_grad_enabled():
        return
    if any(isinstance(x, Tensor) and x.requires_grad for x in inputs):
        raise RuntimeError(
            "out: grouped_mm(..., out=...) does not support automatic differentiation, "
            "but an input requires grad"
        )
    outs = out if isinstance(out, (list, tuple)) else (out,)
    if any(isinstance(o, Tensor) and o.requires_grad for o in outs):
        raise RuntimeError(
            "out: grouped_mm(..., out=...) does not support automatic differentiation, "
            "but out requires grad"
        )


def _grouped_mm_list(As: Sequence, Bs: Sequence, out_dtype, out):
    if not isinstance(Bs, (list, tuple)):
        raise TypeError(f"Bs: expected a list of 2-D tensors like As, found {type(Bs).__name__}")
    tensors = all(isinstance(x, Tensor) for x in As) and all(isinstance(x, Tensor) for x in Bs)
    if not tensors or not (As or Bs or _is_compiling()):
        # numpy arrays, no groups at all (torch or numpy: out_dtype may be either kind),
        # or bad arguments that the extension reports by name
        return list(_native_list(As, Bs, out_dtype, out))
    _check_out_dtype(out_dtype)
    direct = _direct(*As, *Bs)
    if direct:
        As = [_dense(f"As[{i}]", x) for i, x in enumerate(As)]
        Bs = [_dense(f"Bs[{i}]", x) for i, x in enumerate(Bs)]
    if out is not None:
        if not isinstance(out, (list, tuple)):
            raise TypeError(
                f"out: expected a list of tensors (one per group) for the list form, "
                f"found {type(out).__name__}"
            )
        if not all(isinstance(o, Tensor) for o in out):
            bad = next(i for i, o in enumerate(out) if not isinstance(o, Tensor))
            raise TypeError(f"out[{bad}]: expected a torch.Tensor, found {type(out[bad]).__name__}")
        _check_out_grad(out, (*As, *Bs))
        if direct and _direct(*out):
            for i, o in enumerate(out):
                _dense(f"out[{i}]", o, output=True)
            res = list(_native_list(As, Bs, out_dtype, out))
            _bump_version(*out)
            return res
        torch.ops.groupmm.grouped_mm_list_out(list(As), list(Bs), out_dtype, list(out))
        return list(out)
    if not direct:
        return torch.ops.groupmm.grouped_mm_list(list(As), list(Bs), out_dtype)
    if len(As) != len(Bs):
        return list(_native_list(As, Bs, out_dtype))  # raises the length error
    if As:
        x = As[0]
        cast = _autocast_dtype("cuda" if x.is_cuda else "cpu" if x.is_cpu else "")
        if cast is not None:
            As = [_cast(x, cast) for x in As]
            Bs = [_cast(x, cast) for x in Bs]
    if torch.is_grad_enabled() and any(x.requires_grad for x in (*As, *Bs)):
        return list(GroupedMMList.apply(out_dtype, len(As), *As, *Bs))
    return list(_native_list(As, Bs, out_dtype))


# --------------------------------------------------------------------------- autocast kernels


def _register_autocast() -> "torch.library.Library":
    """Autocast kernels for the forward ops (what ``torch.library.register_autocast``
    does, but following the *current* autocast dtype rather than a fixed one): cast the
    floating inputs, then run the op with this device's autocast key excluded so that it
    does not come back here. Used when the op is called through the dispatcher
    (``torch.compile``, tracing, ``torch.ops.groupmm.*``); eager calls cast in Python."""
    lib = torch.library.Library("groupmm", "FRAGMENT")
    for device_type in ("cpu", "cuda"):
        if not torch._C._is_autocast_available(device_type):
            continue
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def mm_kernel(_ks, a, b, offs, out_dtype, _dev=device_type, _keyset=keyset):
            cast = torch.get_autocast_dtype(_dev)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return torch.ops.groupmm.grouped_mm.default(
                    _cast(a, cast), _cast(b, cast), offs, out_dtype
                )

        def list_kernel(_ks, As, Bs, out_dtype, _dev=device_type, _keyset=keyset):
            cast = torch.get_autocast_dtype(_dev)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return torch.ops.groupmm.grouped_mm_list.default(
                    [_cast(x, cast) for x in As], [_cast(x, cast) for x in Bs], out_dtype
                )

        lib.impl("grouped_mm", mm_kernel, key, with_keyset=True)
        lib.impl("grouped_mm_list", list_kernel, key, with_keyset=True)
    return lib


try:
    _autocast_lib = _register_autocast()
except (AttributeError, RuntimeError):  # pragma: no cover - torch without these hooks
    _autocast_lib = None  # eager calls still cast in Python
