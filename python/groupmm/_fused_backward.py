"""The routed SwiGLU expert block's backward arithmetic: the down projection's backward
(ops ``groupmm::dgated`` and ``groupmm::dgated_over_pre``: the DGated kernel or its
composition), the weight gradients over routed rows (op ``groupmm::gather_k_mm``, its rows
read through ``src`` or gathered a column slab at a time), and the up projection's input and
weight gradients; :mod:`groupmm._fused_ops`' autograd formulas call them.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
import functools
from typing import List, Optional, Tuple, cast

import torch
from torch import Tensor

from . import _native, _rows
from ._api import grouped_mm
from ._glue import sum_copies, swiglu, swiglu_grad, take_rows
from ._library import column_major, direct, op

# --------------------------------------------------------------------------- the backward parts


def _dgated_mm(
    dy: Tensor, w_out: Tensor, offs: Tensor, pre: Tensor, scale: Tensor, src: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_dgated_run` into a fresh ``dpre``."""
    return _dgated_run(dy, w_out, offs, pre, scale, src, None)


def _dgated_run(
    dy: Tensor,
    w_out: Tensor,
    offs: Tensor,
    pre: Tensor,
    scale: Tensor,
    src: Optional[Tensor],
    out: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dpre, act_s, row_grad)`` of the down projection's backward, with ``p = dy @
    w_out[g]ᵀ`` (``[R, F]``; with ``src``, ``dy [T, D]`` is in token order and row ``r``
    reads ``dy[src[r]]``), ``s = scale`` (``[R]``, float32, float64 for float64) and
    ``[g | u] = pre``: ``dpre = swiglu_grad(s·p, pre)`` (``[R, 2F]``), ``act_s =
    s·silu(g)·u`` (``[R, F]``, the down projection's input scaled by the router weight)
    and ``row_grad[r] = sum_f p[r, f]·silu(g)·u`` (``[R]`` in ``scale``'s dtype: each
    row's router-weight gradient). One native call where a fused kernel runs
    (``_native.product("dgated")``, which never stores ``p``; ``dpre`` written into ``out`` when
    given, which may be ``pre`` itself), else :func:`_dgated_composed` (a fresh ``dpre``,
    ``out`` untouched)."""
    if scale.dtype == torch.float32:  # the kernels' scale (float64 blocks: no kernel)
        got = _native.product("dgated", dy, w_out, offs, (pre, scale), src, out)
        if got is not None:
            dpre, act_s, partial = got  # partial: float32 [ceil(F/64), R] per column tile
            return dpre, act_s, partial.sum(0)
    return _dgated_composed(dy if src is None else take_rows(dy, src), w_out, offs, pre, scale)


def _dgated_composed(
    dy: Tensor, w_out: Tensor, offs: Tensor, pre: Tensor, scale: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_dgated_mm` from plain parts (``dy [R, D]``): a grouped product, then SwiGLU
    and its gradient (row ops; differentiable torch ops while autograd records a graph
    through the inputs, i.e. double backward), the scale applied in ``scale``'s dtype."""
    p = grouped_mm(dy, w_out.transpose(-2, -1), offs=offs)
    if _rows.differentiable(dy, w_out, pre, scale):
        act = swiglu(pre)
    else:
        act = _rows.swiglu(pre)
    acc, s = scale.dtype, scale.unsqueeze(1)
    row_grad = (p.to(acc) * act.to(acc)).sum(1)
    dpre = swiglu_grad((p.to(acc) * s).to(p.dtype), pre)
    del p
    return dpre, (act.to(acc) * s).to(act.dtype), row_grad


def _dgated_fake(dy, w_out, offs, pre, scale, src):
    rows, width = pre.shape
    return dy.new_empty(rows, width), dy.new_empty(rows, width // 2), scale.new_empty(rows)


#: op ``groupmm::dgated`` (no autograd formula: the arithmetic of the block's backward)
_dgated = op("dgated", _dgated_mm, _dgated_fake)


def _dgated_over_pre(
    dy: Tensor, w_out: Tensor, offs: Tensor, pre: Tensor, scale: Tensor, src: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """:func:`_dgated_run` with ``dpre`` written over ``pre`` (the backward's last read of
    it, so that its ``[R, 2F]`` gradient takes no memory of its own): ``(act_s,
    row_grad)``. In place in the DGated kernel (each tile reads its part of ``pre``
    before writing the same part), else copied over it."""
    dpre, act_s, row_grad = _dgated_run(dy, w_out, offs, pre, scale, src, pre)
    if dpre is not pre:  # composed: a fresh dpre
        pre.copy_(dpre)
    elif direct(pre):  # the extension wrote it: autograd's record of the write
        torch.autograd.graph.increment_version(pre)
    return act_s, row_grad


def _dgated_over_pre_fake(dy, w_out, offs, pre, scale, src):
    rows, width = pre.shape
    return dy.new_empty(rows, width // 2), scale.new_empty(rows)


#: op ``groupmm::dgated_over_pre`` (writes ``pre``; used only where nothing reads ``pre``
#: afterwards: :func:`_overwrites_pre`)
_dgated_over = op("dgated_over_pre", _dgated_over_pre, _dgated_over_pre_fake, ("pre",))


def _overwrites_pre(own_pre: bool) -> bool:
    """Whether ``gated_down``'s backward (not a double backward) may write ``pre``'s
    gradient over ``pre``: the block owns ``pre`` (``expert_block``, which never hands it
    out), no compiler tracing (inductor plans the backward's memory itself) and a graph
    that autograd frees after this backward (``retain_graph=False``: nothing reads
    ``pre`` again)."""
    if not own_pre or torch.compiler.is_compiling():
        return False
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep_graph is not None and not keep_graph()


def _gather_k_mm(
    a: Tensor, b: Tensor, offs: Tensor, src: Tensor, gathered_b: bool, transposed: bool
) -> Tensor:
    """``out[g] = sum_r a_rᵀ b_r`` over the rows ``r`` of group ``g`` (``[G, K, N]``),
    with ``a_r = a[src[r]], b_r = b[r]``, or ``a_r = a[r], b_r = b[src[r]]`` with
    ``gathered_b``: a weight gradient whose routed rows are read through ``src``
    (``_native.gather_k_mm``: inside the varlen-K GEMM where a kernel does, no gathered
    copy; gathered first elsewhere). ``transposed``: the values as the transposed view of
    a contiguous ``[G, N, K]`` (a column-major weight's gradient, no transposed copy).

    Where the rows are gathered first (no kernel reads them through ``src``:
    :func:`reads_in_gemm`), ``a``'s gathered copy is made one slab of its columns at a time
    (:func:`_slabs`), each slab's product written in place into its rows of the output: the
    copy is never whole (``[R, K / 2]`` at most, not ``[R, K]``), at the price of reading
    ``b`` once per slab."""
    if gathered_b or reads_in_gemm(a):
        return _native.gather_k_mm(a, b, offs, src, gathered_b, transposed)
    groups, k, n = offs.shape[0], a.shape[1], b.shape[1]
    if transposed:
        out = a.new_empty(groups, n, k).transpose(-2, -1)
    else:
        out = a.new_empty(groups, k, n)
    for c0, c1 in _slabs(k):
        _native.gather_k_mm(a[:, c0:c1], b, offs, src, False, transposed, out[:, c0:c1])
    return out


def reads_in_gemm(t: Tensor) -> bool:
    """Whether the products on ``t``'s device and dtype read routed rows through ``src``
    inside their GEMMs (``_native.gathers_in_gemm``: Hopper, 16-bit; the extension
    decides), so that no ``[R, ·]`` copy of the rows is made for them."""
    device = t.device
    return gathers_in_gemm(device.type, device.index, t.dtype)


def gathers_in_gemm(kind: str, index: Optional[int], dtype: torch.dtype) -> bool:
    """:func:`reads_in_gemm` on a device kind, index and dtype. The extension's answer is
    a constant of the device and dtype: ``torch.compile`` (compiled autograd included)
    takes it once, at trace time, instead of tracing the call."""
    if kind != "cuda":
        return False
    return _gathers_in_gemm(0 if index is None else index, str(dtype))


@torch.compiler.assume_constant_result
@functools.cache
def _gathers_in_gemm(device: int, dtype: str) -> bool:
    try:
        return _native.gathers_in_gemm(device, dtype)
    except RuntimeError:  # a build without CUDA: the product itself says so
        return False


def _slabs(width: int) -> List[Tuple[int, int]]:
    """The column slabs of a gathered operand ``width`` wide: two, split at a multiple of
    64 columns (the kernels' tile edge, 16-byte aligned) near the middle, when each is at
    least 64 wide, else one. Two halve the gathered copy and read the other operand
    twice: the dW product reads it from L2 within a slab, from memory across slabs (on
    the H200 the second read hides under the tensor cores of the dW GEMM)."""
    cut = (width // 2 + 63) // 64 * 64
    if width < 128 or cut >= width:
        return [(0, width)]
    return [(0, cut), (cut, width)]


def _gather_k_mm_fake(a, b, offs, src, gathered_b, transposed):
    groups, k, n = offs.shape[0], a.shape[1], b.shape[1]
    if transposed:
        return a.new_empty(groups, n, k).transpose(-2, -1)
    return a.new_empty(groups, k, n)


#: op ``groupmm::gather_k_mm`` (no autograd formula: the arithmetic of the backwards)
_gather_k = op("gather_k_mm", _gather_k_mm, _gather_k_mm_fake)


def _weight_grad(a: Tensor, grad: Tensor, offs: Tensor, w: Tensor) -> Tensor:
    """``aᵀ · grad`` per group of rows (``[E, K, N]`` from ``a [R, K]``, ``grad [R, N]``),
    in ``w``'s own layout: a column-major ``w`` (a transposed view of ``[E, N, K]``
    weights, as transformers stores them) gets ``(gradᵀ · a)ᵀ``, so its parameter's
    gradient needs no transposed copy. Differentiable (the double-backward path)."""
    if column_major(w):
        return grouped_mm(grad.t(), a, offs=offs).transpose(-2, -1)
    return grouped_mm(a.t(), grad, offs=offs)


def _up_grads(
    d_pre: Tensor,
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    src: Optional[Tensor],
    inverse: Optional[Tensor],
    need_x: bool,
    need_w: bool,
    up: Optional[Tensor] = None,
    need_up: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(dx, dw, dup)`` of ``pre = x[src] @ w[g]`` (``x[src] @ [w[g] | up[g]]`` with
    ``up``) from ``d_pre``: each token's ``k`` rows of ``d_pre·wᵀ`` summed through
    ``inverse`` (the ``[R, D]`` product freed before ``dw`` is made); ``x[src]ᵀ·d_pre``
    (each weight's from its half of ``d_pre``) with the rows of ``x`` read through
    ``src`` (:func:`_gather_k_mm`), or, while autograd records a graph, gathered by torch
    ops."""
    dx = dw = dup = None
    if need_x:
        dx = _input_grad(d_pre, w, up, offs, src, inverse)
    parts = [(w, need_w)] if up is None else [(w, need_w), (up, need_up)]
    width = d_pre.shape[1] // len(parts)
    grads: List[Optional[Tensor]] = []
    for i, (weight, need) in enumerate(parts):
        grad = d_pre if up is None else d_pre[:, i * width : (i + 1) * width]
        if not need:
            grads.append(None)
        elif src is None:  # x's rows are the routed rows
            grads.append(_weight_grad(x, grad, offs, weight))
        elif _rows.differentiable(grad, x):
            grads.append(_weight_grad(x.index_select(0, src), grad, offs, weight))
        else:
            grads.append(_gather_k(x, grad, offs, src, False, column_major(weight)))
    dw = grads[0]
    if up is not None:
        dup = grads[1]
    return dx, dw, dup


def _input_grad(
    d_pre: Tensor,
    w: Tensor,
    up: Optional[Tensor],
    offs: Tensor,
    src: Optional[Tensor],
    inverse: Optional[Tensor],
) -> Tensor:
    """``d_pre·wᵀ`` (``d_pre·[w | up]ᵀ`` with ``up``), each token's ``k`` rows summed
    through ``inverse`` when ``src`` is given. With ``up`` the two halves of ``d_pre`` are
    two products written into one ``[2R, D]`` buffer, summed with the token's ``2k`` rows
    in the same one pass (one more ``[R, D]`` written and read than one product over
    ``[w | up]`` would need, instead of a concatenated copy of the weights)."""
    if up is None:
        dx = grouped_mm(d_pre, w.transpose(-2, -1), offs=offs)
        return dx if src is None else sum_copies(dx, cast(Tensor, inverse))
    rows, width = d_pre.shape[0], d_pre.shape[1] // 2
    halves = (d_pre[:, :width], d_pre[:, width:])
    if _rows.differentiable(d_pre, w, up) or not direct(d_pre, w, up):
        # recorded (double backward) or traced (the compiler plans the memory; an out=
        # view of a buffer of data-dependent rows would need a guard): two products
        parts = [grouped_mm(h, t.transpose(-2, -1), offs=offs) for h, t in zip(halves, (w, up))]
        both = torch.cat(parts)
    else:
        both = d_pre.new_empty(2 * rows, w.shape[1])
        for i, (h, t) in enumerate(zip(halves, (w, up))):
            grouped_mm(h, t.transpose(-2, -1), offs=offs, out=both[i * rows : (i + 1) * rows])
    if src is None:
        return both[:rows] + both[rows:]
    index = cast(Tensor, inverse)
    return sum_copies(both, torch.cat([index, index + rows], 1))
