"""The routed SwiGLU expert block as custom ops (issues 13 and 22), so that the glue
around the grouped GEMMs has one place to be fused into them:

- :func:`expert_block`: the whole block, ``out[t] = sum_j weights[t, j] * y[inverse[t,
  j]]`` with ``y = act @ w_out[g]`` and ``act = silu(x[src] @ w_gate[g]) * (x[src] @
  w_up[g])`` per expert group ``g`` (gather, up projection, SwiGLU, down projection,
  router weights, top-k combine): what :class:`groupmm.moe.MoELayer` and the transformers
  integration run;
- :func:`expert_up`: its up half, ``act`` (gather, up projection, SwiGLU);
- :func:`expert_down`: its down half, ``out`` from ``act`` (down projection, router
  weights, combine).

Each op (``torch.ops.groupmm.swiglu_up`` and ``gated_down``, which make
:func:`expert_block`; ``expert_up``, ``expert_down``) is a ``torch.library`` custom op
with a fake kernel and an autograd formula, so ``torch.compile(fullgraph=True)``,
``opcheck`` and double backward (through differentiable fallbacks) work, on CPU and CUDA.
Eager :func:`expert_block` calls on plain tensors run the two ops' ``autograd.Function``
twins (:class:`_SwigluUpFn`, :class:`_GatedDownFn`: the same forward, saved tensors and
backward, without the custom-op dispatch on the host); ``src`` and ``inverse`` are made
int32 once per call, the form every kernel reads.

What runs, in :func:`expert_block` (two ops, split where SonicMoE splits the layer, so
that autograd frees ``pre`` as soon as the down projection's backward is done):

- op ``swiglu_up``, forward: the up projection with SwiGLU as ONE native call,
  ``_native.swiglu_mm`` (``pre = x[src] @ w_in[g]`` and ``act = silu(gate) * up`` from
  the fp32 accumulators, rows of ``x`` read through ``src``: on Hopper one kernel with a
  SwiGLU epilogue, no ``[R, D]`` copy of ``x``). ``act`` is marked non-differentiable: it
  is a cache of ``silu(gate) * up`` that the same kernel wrote, and ``gated_down``'s
  backward returns the whole gradient of ``pre`` (the path through ``act`` included).
  Saves ``x``, ``w_in`` and the indices, not ``pre``.
- op ``gated_down``, forward: the down projection (``grouped_mm(act, w_out)``) and the
  weighted combine (the row op ``gather_sum``). Saves ``pre``, ``w_out``, the indices and
  the router weights, not ``act``.
- backward of ``gated_down`` (autograd runs it first): ``dy = d_out[src]`` (each routed
  row's copy of its token's gradient, a row gather: ``take_rows``) and the router weights
  scattered to a per-row fp32 ``scale``, then op ``groupmm::dgated`` →
  ``_native.dgated_mm(dy, w_out, offs, pre, scale)`` ("dgated": ``p = dy @ w_out[g]ᵀ`` and
  in its epilogue the scale, dSwiGLU against ``pre`` and the router-weight gradient as a
  per-row reduction; ``p`` is never stored), giving ``d_pre``, ``act_s = scale·act`` and
  the rows' router-weight gradients; then ``dw_out = act_sᵀ·dy``. When it returns,
  ``pre``, ``dy`` and ``act_s`` are freed. (``dgated_mm`` and ``gather_k_mm`` can read
  ``d_out`` through ``src`` instead, with no ``dy``; those kernels run only with
  ``GROUPMM_SM90_GATHER=1``, slower than the copy: cuda/heuristics/choose.cc.)
- backward of ``swiglu_up``: ``dx = sum_copies(d_pre·w_inᵀ)`` (the ``[R, D]`` product
  freed at once), then ``dw_in = x[src]ᵀ·d_pre`` as ``_native.gather_k_mm(x, d_pre,
  offs, src)`` (``x``'s rows gathered first, or read through ``src`` in the GEMM with
  ``GROUPMM_SM90_GATHER=1``). Weight gradients come in their weight's own memory layout.

Nothing of size ``[R, D]`` or ``[R, F]`` (``R = T*k``) is kept for the backward. At OLMoE
sizes (D = 2048, F = 1024, T = 16384, k = 8, bf16: ``pre``/``d_pre``/``dy``/``x[src]``
512 MiB each, ``act_s`` 256, ``dw_in`` 512, ``dw_out`` 256) the backward holds at most
``pre + dy + d_pre + act_s + dw_out`` ≈ 2.0 GiB (while ``dw_out`` is computed), then,
``pre`` freed, ``d_pre + dw_out`` and one ``[R, D]`` product or ``x[src]`` and ``dw_in``.

Where no fused kernel runs (the CPU, other GPUs, fp32/fp64,
unaligned sizes; ``swiglu_mm``/``dgated_mm`` answer None, ``gather_k_mm`` gathers first)
the same results are composed here from groupmm's plain parts (:func:`_swiglu_mm`,
:func:`_dgated_mm`: the gathered product and the row op ``swiglu``; ``d_out``'s rows
gathered, a grouped product, SwiGLU and its gradient as row ops). While autograd records
a graph through the inputs (double backward) every formula is composed from
differentiable ops (``_rows.differentiable``).

:func:`expert_up` runs the same up projection (its op keeps ``pre`` and returns
``act``); :func:`expert_down` runs the down projection and combine with ``y`` kept for
the router-weight gradient.

Determinism: no atomics anywhere; the gradient of ``x`` sums each token's ``k`` rows
through ``inverse``. The glue formulas (:func:`~groupmm._glue.sum_copies`,
:func:`~groupmm._glue.combine` and its backward, :func:`~groupmm._glue.take_rows`,
:func:`~groupmm._glue.to_rows`, :func:`~groupmm._glue.swiglu_grad`) are
``groupmm._glue``'s, shared with ``groupmm.moe`` and the transformers integration.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import List, Optional, Tuple, cast

import torch
from torch import Tensor

from . import _checks as check
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

__all__ = ["expert_block", "expert_down", "expert_up", "swiglu_grad"]


# --------------------------------------------------------------------------- the fused parts


def _swiglu_mm(x: Tensor, w: Tensor, offs: Tensor, src: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(pre, act)``: ``pre = x[src] @ w[g]`` (``[R, 2F]``, ``[gate | up]``; ``x @ w[g]``
    without ``src``) and ``act = silu(gate) * up`` (``[R, F]``). One native call where a
    fused kernel runs (``_native.swiglu_mm``), else the gathered product and the row op.
    Real tensors only (op implementations)."""
    got = _native.swiglu_mm(x, w, offs, src)
    if got is not None:
        return got
    pre = grouped_mm(x, w, offs=offs) if src is None else _native.gather_mm(x, w, offs, src)
    return pre, _rows.swiglu(pre)


def _dgated_mm(
    dy: Tensor, w_out: Tensor, offs: Tensor, pre: Tensor, scale: Tensor
) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`_dgated_run` into a fresh ``dpre``."""
    return _dgated_run(dy, w_out, offs, pre, scale, None)


def _dgated_run(
    dy: Tensor, w_out: Tensor, offs: Tensor, pre: Tensor, scale: Tensor, out: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dpre, act_s, row_grad)`` of the down projection's backward, with ``p = dy @
    w_out[g]ᵀ`` (``[R, F]``), ``s = scale`` (``[R]``, float32, float64 for float64) and
    ``[g | u] = pre``: ``dpre = swiglu_grad(s·p, pre)`` (``[R, 2F]``), ``act_s =
    s·silu(g)·u`` (``[R, F]``, the down projection's input scaled by the router weight)
    and ``row_grad[r] = sum_f p[r, f]·silu(g)·u`` (``[R]`` in ``scale``'s dtype: each
    row's router-weight gradient). One native call where a fused kernel runs
    (``_native.dgated_mm``, which never stores ``p``; ``dpre`` written into ``out`` when
    given, which may be ``pre`` itself), else :func:`_dgated_composed` (a fresh ``dpre``,
    ``out`` untouched)."""
    if scale.dtype == torch.float32:  # the kernels' scale (float64 blocks: no kernel)
        got = _native.dgated_mm(dy, w_out, offs, pre, scale, None, out)
        if got is not None:
            dpre, act_s, partial = got  # partial: float32 [ceil(F/64), R] per column tile
            return dpre, act_s, partial.sum(0)
    return _dgated_composed(dy, w_out, offs, pre, scale)


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


def _dgated_fake(dy, w_out, offs, pre, scale):
    rows, width = pre.shape
    return dy.new_empty(rows, width), dy.new_empty(rows, width // 2), scale.new_empty(rows)


#: op ``groupmm::dgated`` (no autograd formula: the arithmetic of the block's backward)
_dgated = op("dgated", _dgated_mm, _dgated_fake)


def _dgated_over_pre(
    dy: Tensor, w_out: Tensor, offs: Tensor, pre: Tensor, scale: Tensor
) -> Tuple[Tensor, Tensor]:
    """:func:`_dgated_run` with ``dpre`` written over ``pre`` (the backward's last read of
    it, so that its ``[R, 2F]`` gradient takes no memory of its own): ``(act_s,
    row_grad)``. In place in the DGated kernel (each tile reads its part of ``pre``
    before writing the same part), else copied over it."""
    dpre, act_s, row_grad = _dgated_run(dy, w_out, offs, pre, scale, pre)
    if dpre is not pre:  # composed: a fresh dpre
        pre.copy_(dpre)
    elif direct(pre):  # the extension wrote it: autograd's record of the write
        torch.autograd.graph.increment_version(pre)
    return act_s, row_grad


def _dgated_over_pre_fake(dy, w_out, offs, pre, scale):
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

    Where the rows are gathered first (no kernel reads them through ``src``: the default),
    ``a``'s gathered copy is made one slab of its columns at a time (:func:`_slabs`), each
    slab's product written in place into its rows of the output: the copy is never whole
    (``[R, K / 2]`` at most, not ``[R, K]``), at the price of reading ``b`` once per
    slab."""
    if gathered_b:
        return _native.gather_k_mm(a, b, offs, src, gathered_b=True, transposed=transposed)
    groups, k, n = offs.shape[0], a.shape[1], b.shape[1]
    if transposed:
        out = a.new_empty(groups, n, k).transpose(-2, -1)
    else:
        out = a.new_empty(groups, k, n)
    for c0, c1 in _slabs(k):
        _native.gather_k_mm(a[:, c0:c1], b, offs, src, False, transposed, out[:, c0:c1])
    return out


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
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(dx, dw)`` of ``pre = x[src] @ w[g]`` from ``d_pre``: each token's ``k`` rows of
    ``d_pre·wᵀ`` summed through ``inverse`` (the ``[R, D]`` product freed before ``dw``
    is made); ``x[src]ᵀ·d_pre`` with the rows of ``x`` read through ``src``
    (:func:`_gather_k_mm`), or, while autograd records a graph, gathered by torch ops."""
    dx = dw = None
    if need_x:
        dx = grouped_mm(d_pre, w.transpose(-2, -1), offs=offs)
        if src is not None:  # with src, inverse too (_block)
            dx = sum_copies(dx, cast(Tensor, inverse))
    if need_w:
        if src is None:  # x's rows are the routed rows
            dw = _weight_grad(x, d_pre, offs, w)
        elif _rows.differentiable(d_pre, x):
            dw = _weight_grad(x.index_select(0, src), d_pre, offs, w)
        else:
            dw = _gather_k(x, d_pre, offs, src, False, column_major(w))
    return dx, dw


def _check_routes(x: Tensor, offs: Tensor, src: Tensor, inverse: Tensor) -> None:
    """``offs [E]``, ``src [R]``, ``inverse [T, k]`` with ``T`` the rows of ``x`` and
    ``T*k = R`` (every routed row named once)."""
    check.index("offs", offs, 1, "[E]")
    check.index("src", src, 1, "[R]")
    check.index("inverse", inverse, 2, "[T, k]")
    ok = inverse.shape[0] == x.shape[0] and inverse.numel() == src.shape[0]
    what = "[T={}, k] with T*k = R = {} (the length of src)"
    check.shape("inverse", inverse, ok, what, x.shape[0], src.shape[0])


def _int32(index: Tensor) -> Tensor:
    """``index`` as int32, the form every kernel reads, made once per block call (the ops
    and their backwards then hand it to each native call as it is, instead of each call
    converting an int64 index again)."""
    return index if index.dtype == torch.int32 else index.to(torch.int32)


def _check_gate_up(name: str, w: Tensor) -> None:
    if w.shape[-1] % 2:
        raise ValueError(
            f"{name}: expected an even last dimension [gate | up], found {list(w.shape)}"
        )


# --------------------------------------------------------------------------- swiglu_up


@torch.library.custom_op("groupmm::swiglu_up", mutates_args=())
def _swiglu_up(
    x: Tensor, w_in: Tensor, offs: Tensor, src: Optional[Tensor], inverse: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    return _swiglu_mm(x, w_in, offs, src)


@_swiglu_up.register_fake
def _swiglu_up_fake(x, w_in, offs, src, inverse):
    rows, width = (x if src is None else src).shape[0], w_in.shape[-1]
    return x.new_empty(rows, width), x.new_empty(rows, width // 2)


def _swiglu_up_setup(ctx, inputs, output):
    x, w_in, offs, src, inverse = inputs
    # not pre: gated_down keeps it and drops it after its backward, before this one runs
    ctx.save_for_backward(x, w_in, offs, src, inverse)
    # act: a cache of silu(gate)*up of pre; gated_down's backward returns pre's whole
    # gradient, the path through act included
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _swiglu_up_grad(ctx, d_pre, d_act):
    x, w_in, offs, src, inverse = ctx.saved_tensors
    if d_pre is None:
        return None, None, None, None, None
    need_x, need_w_in = ctx.needs_input_grad[:2]
    dx, dw_in = _up_grads(d_pre, x, w_in, offs, src, inverse, need_x, need_w_in)
    return dx, dw_in, None, None, None


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
    rows themselves without ``inverse`` (:func:`_block`)."""
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
    # once), is made once, by a row gather, and read by both products: the kernels that read
    # d_out through src (GROUPMM_SM90_GATHER=1) are slower than this copy plus the TMA
    # kernels (cuda/heuristics/choose.cc), and each would gather it again where they do not
    # run.
    dy = d_out if src is None else take_rows(d_out, src)
    if _rows.differentiable(d_out, w_out, pre, weights):  # double backward
        d_pre, act_s, row_grad = _dgated_composed(dy, w_out, offs, pre, scale)
    elif _overwrites_pre(ctx.own_pre):
        act_s, row_grad = _dgated_over(dy, w_out, offs, pre, scale)
        d_pre = pre  # pre's gradient, where pre was
    else:
        d_pre, act_s, row_grad = _dgated(dy, w_out, offs, pre, scale)
    del scale
    dweights = None
    if need_weights:
        # dweights[t, j] = row_grad[inverse[t, j]]: combine's weight gradient, <grad, y>,
        # of the rows' own reductions against a gradient of ones
        ones = row_grad.new_ones(inverse.shape[0], 1)
        dweights = combine_backward(ones, row_grad.unsqueeze(1), inverse, weights, False, True)[1]
    del row_grad
    dw_out = _weight_grad(act_s, dy, offs, w_out) if need_w_out else None
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
    time above its GPU time. Compiled and traced calls take the op (:func:`expert_block`)."""

    @staticmethod
    def forward(ctx, x, w_in, offs, src, inverse):
        out = _swiglu_mm(x, w_in, offs, src)
        _swiglu_up_setup(ctx, (x, w_in, offs, src, inverse), out)
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


# --------------------------------------------------------------------------- expert_block


def expert_block(
    x: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    offs: Tensor,
    src: Tensor,
    inverse: Tensor,
    weights: Optional[Tensor] = None,
) -> Tensor:
    """A whole routed SwiGLU expert block: ``out[t] = sum_j weights[t, j] * y[inverse[t,
    j]]`` with ``y[r] = act[r] @ w_out[g]``, ``act[r] = silu(a[r] @ w_gate[g]) * (a[r] @
    w_up[g])`` and ``a[r] = x[src[r]]``, for the rows ``r`` of each group ``g``.

    Args:
        x: ``[T, D]`` tokens, in token order (never copied into expert order).
        w_in: ``[E, D, 2F]``, columns ``[:F]`` the gate and ``[F:]`` the up projection
            (:class:`groupmm.nn.GroupedExperts`' ``w_in``; any strides).
        w_out: ``[E, F, D]`` (``GroupedExperts``' ``w_out``; any strides).
        offs: int32 ``[E]`` group ends over the ``R`` routed rows.
        src: integer ``[R]``, the token of each row (``x`` row ``src[r]``).
        inverse: integer ``[T, k]``, the row of each token's ``j``-th copy (every row
            named once: ``R = T*k``).
        weights: ``[T, k]`` router weights (differentiable), or None for a plain sum.

    Returns:
        ``[T, D]`` in ``x``'s dtype, in token order. Rows past ``offs[-1]`` (e.g.
        expert-parallel placeholders) contribute nothing.

    Two ops, ``torch.ops.groupmm.swiglu_up`` then ``gated_down``; what runs and what the
    backward keeps: the module docstring. :func:`groupmm._glue.routes` gives
    ``offs``/``src``/``inverse`` (``MoELayer`` calls this). An index out of range is an
    error: at once on the CPU, at the device's next call on CUDA (no host sync); it is
    never read.
    """
    # before the ops: their fakes (torch.compile) check nothing, the indices are converted
    # to int32 before the native calls, only the backward reads some operands, and the
    # GEMMs would name w_in and w_out "w" and "b"
    _check_experts(x, w_in, w_out)
    _check_routes(x, offs, src, inverse)
    _check_expert_count(x, w_in, w_out, offs.shape[0])
    if weights is not None:
        check.tensor("weights", weights)
        check.same_shape("weights", weights, "inverse", inverse)
    return _block(x, w_in, w_out, offs, _int32(src), _int32(inverse), weights)


def _check_experts(x: Tensor, w_in: Tensor, w_out: Tensor) -> None:
    """The ranks of ``x``, ``w_in`` and ``w_out`` and ``w_in``'s even width."""
    check.dims("x", x, 2, "[T, D]")
    check.dims("w_in", w_in, 3, "[E, D, 2F]")
    check.dims("w_out", w_out, 3, "[E, F, D]")
    _check_gate_up("w_in", w_in)


def _check_expert_count(
    x: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    experts: int,
    x_name: str = "x",
    experts_of: str = "offs",
) -> None:
    """``w_in [E, D, 2F]`` and ``w_out [E, F, D]`` with ``E = experts`` (the length of
    ``experts_of``) and ``D`` the width of ``x`` (called ``x_name``), in ``x``'s dtype and
    on its device (checked here, so that the native rules never name them "w" and "b")."""
    width = x.shape[1]
    ok = w_in.shape[0] == experts and w_in.shape[1] == width
    what = "[E={}, D={}, 2F] (E = len({}), D = {}.shape[1])"
    check.shape("w_in", w_in, ok, what, experts, width, experts_of, x_name)
    ok = w_out.shape == (experts, w_in.shape[2] // 2, width)
    what = "[E={}, F={}, D={}] (E = len({}), 2F = w_in.shape[2], D = {}.shape[1])"
    check.shape("w_out", w_out, ok, what, experts, w_in.shape[2] // 2, width, experts_of, x_name)
    for name, t in (("w_in", w_in), ("w_out", w_out)):
        check.dtype(name, t, x.dtype, x_name)
        check.device(name, t, x.device, x_name)


def _block(
    x: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    offs: Tensor,
    src: Optional[Tensor],
    inverse: Optional[Tensor],
    weights: Optional[Tensor],
) -> Tensor:
    """The two ops of :func:`expert_block` on checked arguments (int32 indices). Also
    what :func:`groupmm.parallel.expert_compute` runs on rows already in expert order:
    ``src`` None (``x``'s rows are the routed rows: no gather, ``dy = d_out``) with
    ``inverse`` None (the output is the rows ``y`` themselves: no combine, no
    ``weights``) or ``arange(R)`` as ``[R, 1]`` (each row scaled by its weight)."""
    # pre is the block's own: gated_down's backward may write its gradient over it
    if direct(x, w_in, w_out, offs, src, inverse, weights):
        pre, act = _SwigluUpFn.apply(x, w_in, offs, src, inverse)
        return _GatedDownFn.apply(pre, act, w_out, offs, src, inverse, weights, True)
    pre, act = _swiglu_up(x, w_in, offs, src, inverse)
    return _gated_down(pre, act, w_out, offs, src, inverse, weights, True)


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
    dx, dw = _up_grads(dpre, x, w, offs, src, inverse, need_x, need_w)
    return dx, dw, None, None, None


_expert_up.register_autograd(_expert_up_grad, setup_context=_expert_up_setup)


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

    One op, ``torch.ops.groupmm.expert_up`` (the up projection and SwiGLU in one native
    call where a fused kernel runs; it keeps the pre-activation ``[R, 2F]`` for the
    backward). :func:`expert_block` is the whole block (ops ``swiglu_up``, ``gated_down``).
    :func:`groupmm._glue.routes` gives ``src``/``inverse``. An index out of range is
    an error: at once on the CPU, at the device's next call on CUDA (no host sync).
    """
    # before the op: its fake (torch.compile) checks nothing, the indices are converted
    # to int32 before the native call, and only the backward reads inverse
    check.dims("x", x, 2, "[T, D]")
    check.dims("w", w, 3, "[E, D, 2F]")
    _check_routes(x, offs, src, inverse)
    _check_gate_up("w", w)
    return _expert_up(x, w, offs, _int32(src), _int32(inverse))[0]


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
    return _expert_down(h, w, offs, _int32(inverse), weights)[0]
