"""The public function :func:`grouped_mm` (torch face): argument handling, then one of
three paths.

- Plain eager tensors: the Rust extension directly (``_native``), or its autograd shim
  (``_autograd.py``) when an input requires grad; autocast is applied here.
- Anything traced (``torch.compile``, FakeTensor, make_fx, functionalization, tensor
  subclasses): the custom ops ``torch.ops.groupmm.*`` (``_library.py``), which carry
  their own autograd and autocast kernels.
- Anything that is not a torch tensor (numpy arrays, bad arguments): the torch-free path
  of ``_numpy.py``; the extension reports bad arguments by name.
"""

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _autocast, _library, _numpy
from . import _checks as check
from ._autograd import GroupedMMList, apply_grouped_mm
from ._library import direct

__all__ = ["grouped_mm"]

_native_mm = _library._native_mm
_native_list = _library._native_list
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_STRIDED = torch.strided
_autocast_dtype = _autocast.autocast_dtype


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
    if (bias is not None or isinstance(a, (list, tuple))) and _numpy.check_form(a, offs, bias):
        return _grouped_mm_list(a, b, out_dtype, out)
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return _numpy.packed(a, b, offs, out_dtype, out)
    if out_dtype is not None:
        check.out_dtype(out_dtype)  # traced: the ops' schema would refuse it in its words
    if not direct(a, b, offs):
        # compiling or tracing: the ops (autograd and autocast registered on them)
        if out is None:
            return _library.mm_op(a, b, offs, out_dtype)
        check.out(out, (a, b))  # before autograd records the call
        _library.mm_out_op(a, b, offs, out_dtype, out)
        return out
    # plain eager tensors: straight to Rust
    if a.layout is not _STRIDED or a.is_neg():
        a = _dense("a", a)
    if b.layout is not _STRIDED or b.is_neg():
        b = _dense("b", b)
    if isinstance(offs, Tensor) and (offs.layout is not _STRIDED or offs.is_neg()):
        offs = _dense("offs", offs)
    if out is not None:
        # like torch.mm(out=): autocast does not apply to out= calls
        check.out(out, (a, b))  # before autograd records the call
        _dense("out", out, output=True)
        _native_mm(a, b, offs, out_dtype, out)
        _bump_version(out)
        return out
    cast_to = _autocast_dtype(a)
    if cast_to is not None:
        a, b = _autocast.cast(a, cast_to), _autocast.cast(b, cast_to)
    if (a.requires_grad or b.requires_grad) and _grad_enabled():
        return apply_grouped_mm(a, b, offs, out_dtype)
    return _native_mm(a, b, offs, out_dtype)


def _dense(name: str, t: Tensor, output: bool = False) -> Tensor:
    """The extension reads raw strided memory: refuse sparse/other layouts by name, and
    apply a pending negation (``t.is_neg()``, a lazy view) to inputs; an output cannot
    carry one."""
    if t.layout != _STRIDED:
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


def _grouped_mm_list(As: Sequence, Bs: Sequence, out_dtype, out):
    if not isinstance(Bs, (list, tuple)):
        raise TypeError(f"Bs: expected a list of 2-D tensors like As, found {type(Bs).__name__}")
    tensors = all(isinstance(x, Tensor) for x in As) and all(isinstance(x, Tensor) for x in Bs)
    if not tensors or not (As or Bs or _is_compiling()):
        # numpy arrays, no groups at all (torch or numpy: out_dtype may be either kind),
        # or bad arguments that the extension reports by name
        return _numpy.listed(As, Bs, out_dtype, out)
    if out_dtype is not None:
        check.out_dtype(out_dtype)  # traced: the ops' schema would refuse it in its words
    is_direct = direct(*As, *Bs)
    if is_direct:
        As = [_dense(f"As[{i}]", x) for i, x in enumerate(As)]
        Bs = [_dense(f"Bs[{i}]", x) for i, x in enumerate(Bs)]
    if out is not None:
        check.out_list(out, (*As, *Bs))  # before autograd records the call
        if is_direct and direct(*out):
            for i, o in enumerate(out):
                _dense(f"out[{i}]", o, output=True)
            res = list(_native_list(As, Bs, out_dtype, out))
            _bump_version(*out)
            return res
        _library.list_out_op(list(As), list(Bs), out_dtype, list(out))
        return list(out)
    if not is_direct:
        return _library.list_op(list(As), list(Bs), out_dtype)
    if len(As) != len(Bs):
        return list(_native_list(As, Bs, out_dtype))  # raises the length error
    if As:
        cast_to = _autocast_dtype(As[0])
        if cast_to is not None:
            As = [_autocast.cast(x, cast_to) for x in As]
            Bs = [_autocast.cast(x, cast_to) for x in Bs]
    if _grad_enabled() and any(x.requires_grad for x in (*As, *Bs)):
        return list(GroupedMMList.apply(out_dtype, len(As), *As, *Bs))
    return list(_native_list(As, Bs, out_dtype))
