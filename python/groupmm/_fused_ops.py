"""The routed SwiGLU expert block's two custom ops, ``groupmm::swiglu_up`` and
``groupmm::gated_down`` (fakes, autograd formulas, and their eager ``autograd.Function``
twins), and the arithmetic under them: the fused native calls or their composition, and
the backward's ops ``groupmm::dgated``, ``groupmm::dgated_over_pre`` and
``groupmm::gather_k_mm``. :mod:`groupmm.fused` calls them (``_block``); what runs, what the
backward keeps and why: its module docstring.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
import functools
from typing import List, Optional, Tuple, cast

import torch
from torch import Tensor

from . import _native, _rows
from ._api import grouped_mm
from ._glue import (
    combine,
    combine_backward,
    sum_copies,
    swiglu,
    swiglu_grad,
    take_rows,
    to_rows,
)
from ._library import column_major, direct, op

# --------------------------------------------------------------------------- the fused parts


def _swiglu_mm(
    x: Tensor, w: Tensor, offs: Tensor, src: Optional[Tensor], up: Optional[Tensor] = None
) -> Tuple[Tensor, Tensor]:
    """``(pre, act)``: ``pre = x[src] @ w[g]`` (``[R, 2F]``, ``[gate | up]``; ``x @ w[g]``
    without ``src``; with ``up``, ``w`` is the gate ``[E, D, F]`` and ``pre = x[src] @
    [w[g] | up[g]]``) and ``act = silu(gate) * up`` (``[R, F]``). One native call where a
    fused kernel runs (``_native.swiglu_mm``: the two weights read as two operands), else
    the gathered products and the row op. Real tensors only (op implementations)."""
    got = _native.swiglu_mm(x, w, offs, src, up)
    if got is not None:
        return got
    pre = _gathered_mm(x, w, offs, src)
    if up is not None:
        pre = torch.cat([pre, _gathered_mm(x, up, offs, src)], 1)
    return pre, _rows.swiglu(pre)


def _gathered_mm(x: Tensor, w: Tensor, offs: Tensor, src: Optional[Tensor]) -> Tensor:
    """``x[src] @ w[g]`` per group (``x @ w[g]`` without ``src``)."""
    return grouped_mm(x, w, offs=offs) if src is None else _native.gather_mm(x, w, offs, src)


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
    (``_native.dgated_mm``, which never stores ``p``; ``dpre`` written into ``out`` when
    given, which may be ``pre`` itself), else :func:`_dgated_composed` (a fresh ``dpre``,
    ``out`` untouched)."""
    if scale.dtype == torch.float32:  # the kernels' scale (float64 blocks: no kernel)
        got = _native.dgated_mm(dy, w_out, offs, pre, scale, src, out)
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
    inside their GEMMs (``_native.gathers_in_gemm``: Hopper, 16-bit, unless
    ``GROUPMM_SM90_GATHER=0``), so that no ``[R, ·]`` copy of the rows is made for them."""
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
