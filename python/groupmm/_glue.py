"""The MoE glue: the index and row work around the grouped GEMMs of a routed expert block,
one implementation of each piece, shared by every MoE path (``moe``: ``permute``,
``unpermute``, ``MoELayer``; ``fused``: ``expert_up``, ``expert_down``; and
``integrations.transformers``):

- routing, :func:`routes`: the expert order of the ``T*k`` routed copies of ``T`` tokens
  (optionally with expert-parallel placeholders);
- dispatch, :class:`Dispatch` / :func:`dispatch`: ``rows = tokens[src]`` in expert order;
  its backward :func:`sum_copies`;
- combine, :func:`combine` / :class:`Combine`: each token's ``k`` rows, weighted and
  summed back in token order; its backward :func:`combine_backward` (whose ``y`` half,
  :func:`to_rows`, ``groupmm.fused.expert_block`` also runs on its own);
- SwiGLU, :func:`swiglu`: ``act(gate) * up``; its backward :func:`swiglu_grad`.

One name per index: ``src`` [R], the routed-row index (the token whose row each routed
row is, ``rows = tokens[src]``); ``inverse`` [T, k], the routed row of each token's
``j``-th copy; ``order`` [T*k], the copy ``t*k + j`` at each sorted position.

The backward formulas and :func:`combine` run the one-pass row ops of ``_rows``
(deterministic: fixed summation order, no atomics), or, while autograd records a graph
through their inputs (double backward), differentiable torch ops: that choice is
``_rows.differentiable``'s. Nothing here synchronises with the host; output shapes depend
only on the input shapes, so everything traces under ``torch.compile(fullgraph=True)``.

This module imports only ``_rows`` below it; ``moe``, ``fused``, ``nn`` and the
integrations import it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _rows

__all__ = [
    "Combine",
    "Dispatch",
    "Routes",
    "combine",
    "combine_backward",
    "dispatch",
    "routes",
    "sum_copies",
    "swiglu",
    "swiglu_grad",
    "take_rows",
    "to_rows",
]

# --------------------------------------------------------------------------- routing


class Routes(NamedTuple):
    """The expert order of the ``n = T*k`` routed copies (index tensors on the ids'
    device; see :func:`routes`)."""

    offs: Tensor
    """int32 ``[E]`` group ends over the routed rows; placeholders lie past ``offs[-1]``."""
    src: Tensor
    """``[n]`` token of each sorted copy: the routed-row index (``index_dtype``)."""
    inverse: Tensor
    """``[T, k]`` routed row of copy ``(t, j)`` (``index_dtype``)."""
    order: Tensor
    """int64 ``[n]`` copy ``t*k + j`` at each sorted position."""
    keys: Tensor
    """int32 ``[n]`` expert of each sorted position (``E`` for a placeholder)."""
    dest: Tensor
    """``[n]`` routed row of each sorted position (``arange(n)`` without padding;
    ``index_dtype``)."""
    counts: Optional[Tensor]
    """int64 ``[E]`` copies per expert before padding (with ``counts=True`` or padding)."""
    capacity: Optional[int]
    """Routed rows with padding (``n + E*(pad_to-1)``), None without."""
    valid: Optional[Tensor]
    """bool ``[n]`` (copy order): the copy names an expert in ``[0, E)`` (placeholders
    only)."""


def routes(
    expert_ids: Tensor,
    num_experts: int,
    pad_to: Optional[int] = None,
    *,
    counts: bool = False,
    placeholders: bool = False,
    index_dtype: torch.dtype = torch.int64,
) -> Routes:
    """The index side of a dispatch (no token data moves), on ``expert_ids``' device with
    no host sync; the shapes depend only on ``T``, ``k``, ``E`` and ``pad_to``.

    One stable sort of the int32 expert keys orders the copies by expert (within an
    expert by token, then by slot); ``searchsorted`` of the sorted keys against
    ``arange(E)`` gives the group ends; ``order // k`` the token of each row; one
    scatter the inverse. About a dozen small torch ops: each costs host time (a launch
    on CUDA), so none is spent on what the arguments make redundant.

    Args:
        expert_ids: integer ``[T, k]``. Ids outside ``[0, E)`` are not checked (that would
            need a host sync) and give wrong results, unless ``placeholders``.
        num_experts: ``E``.
        pad_to: round each group up to a multiple of this (empty rows at the group's
            end: ``dest``, ``capacity``); not with ``placeholders``.
        counts: also compute ``counts`` (padding computes them anyway).
        placeholders: ids outside ``[0, E)`` are expert-parallel placeholders (transformers
            marks the copies routed to other ranks with ids ``>= E``): their key is ``E``,
            so they sort last, past ``offs[-1]``, and ``valid`` marks the other copies.
        index_dtype: the dtype of ``src``, ``inverse`` and ``dest``: int64 (torch's index
            dtype), or int32, the form the row ops and fused kernels read (made here at
            the cost of one conversion, ``src``'s, instead of one per index later).
    """
    if index_dtype not in (torch.int64, torch.int32):
        raise TypeError(f"index_dtype: expected torch.int64 or torch.int32, found {index_dtype}")
    num_tokens, top_k = expert_ids.shape
    device = expert_ids.device
    flat = expert_ids.reshape(-1)
    valid = None
    if placeholders:
        flat = _placeholder_keys(flat, num_experts)
        valid = flat < num_experts
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    keys, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts, device=device, dtype=torch.int32)
    ends = torch.searchsorted(keys, bounds, right=True, out_int32=True)
    src = torch.div(order, top_k, rounding_mode="floor")  # not //: no Python operator frames
    if index_dtype != torch.int64:
        src = src.to(index_dtype)
    n = flat.numel()
    if pad_to is None or pad_to == 1:
        group_counts = _counts(ends) if counts else None
        dest = torch.arange(n, device=device, dtype=index_dtype)
        offs, capacity = ends, None
    else:
        group_counts = _counts(ends)
        padded = (group_counts + pad_to - 1) // pad_to * pad_to
        padded_ends = torch.cumsum(padded, dim=0)
        # sorted position i of expert e lands at padded_starts[e] + (i - starts[e])
        shift = (padded_ends - padded) - (ends - group_counts)
        dest = torch.arange(n, device=device) + shift.index_select(0, keys)
        if index_dtype != torch.int64:
            dest = dest.to(index_dtype)
        offs = padded_ends.to(torch.int32)
        capacity = n + num_experts * (pad_to - 1)
    inverse = torch.empty_like(dest).scatter_(0, order, dest).view(num_tokens, top_k)
    return Routes(offs, src, inverse, order, keys, dest, group_counts, capacity, valid)


def _placeholder_keys(flat: Tensor, num_experts: int) -> Tensor:
    """``flat`` with every id outside ``[0, E)`` replaced by ``E``. For int64 and int32
    ids two ops: clamp into ``[-1, E]``, then ``-1 -> E`` by the remainder modulo ``E +
    1`` (the divisor's sign: ``-1 mod (E + 1) = E``; ids in ``[0, E]`` stay); other dtypes
    the plain four (two comparisons, their conjunction, a select)."""
    if flat.dtype in (torch.int64, torch.int32):
        return flat.clamp(-1, num_experts).remainder(num_experts + 1)
    inside = (flat >= 0) & (flat < num_experts)
    return torch.where(inside, flat, num_experts)


def _counts(ends: Tensor) -> Tensor:
    """int64 group sizes from int32 group ends."""
    return torch.diff(ends, prepend=ends.new_zeros(1)).long()


# --------------------------------------------------------------------------- dispatch


def sum_copies(grad: Tensor, inverse: Tensor) -> Tensor:
    """``out[t] = sum_j grad[inverse[t, j]]``: each token's ``k`` rows summed in fp32 or
    wider (deterministic, no atomics, no ``[T*k, D]`` temporary). The backward of a row
    gather by token: one pass (``_rows.gather_sum``), or, while autograd records a graph
    through ``grad`` (double backward), ``k`` differentiable gathers."""
    if not _rows.differentiable(grad):
        return _rows.gather_sum(grad, inverse, None)
    acc = torch.promote_types(grad.dtype, torch.float32)
    out = grad.index_select(0, inverse[:, 0]).to(acc)
    for j in range(1, inverse.shape[1]):
        out = out + grad.index_select(0, inverse[:, j])
    return out.to(grad.dtype)


def take_rows(x: Tensor, src: Tensor) -> Tensor:
    """``x[src]`` (``[R, D]`` from ``x [T, D]`` and ``src [R]``): each routed row's copy of
    its token's row, in expert order. One pass (the row op ``_rows.gather_sum`` with ``src``
    as a one-column index: a row gather at the copy bandwidth, no inverse permutation to
    build), or, while autograd records a graph through ``x``, ``index_select``. With every
    routed row named once (``R = T*k``) this is :func:`to_rows` without weights."""
    if _rows.differentiable(x):
        return x.index_select(0, src)
    return _rows.gather_sum(x, src.reshape(-1, 1), None)


class Dispatch(torch.autograd.Function):
    """``rows[dest[i]] = tokens[src[i]]``: token copies in expert order (zero rows where
    padding leaves gaps; ``capacity`` None: no padding, ``dest`` unused). Backward:
    :func:`sum_copies`, instead of autograd's ``index_put(accumulate=True)`` (which sorts
    the indices and adds atomically)."""

    @staticmethod
    def forward(ctx: Any, tokens, src, dest, inverse, capacity):
        ctx.save_for_backward(inverse)
        rows = tokens.index_select(0, src)
        if capacity is None:
            return rows
        return rows.new_zeros(capacity, tokens.shape[1]).index_copy_(0, dest, rows)

    @staticmethod
    def backward(ctx: Any, grad):
        (inverse,) = ctx.saved_tensors
        return sum_copies(grad, inverse), None, None, None, None


def dispatch(tokens: Tensor, r: Routes) -> Tensor:
    """``tokens [T, D]`` copied into the expert order of ``r`` (``[n or capacity, D]``),
    differentiable (:class:`Dispatch`)."""
    return Dispatch.apply(tokens, r.src, r.dest, r.inverse, r.capacity)


# --------------------------------------------------------------------------- combine


def combine(y: Tensor, inverse: Tensor, w: Optional[Tensor]) -> Tensor:
    """``out[t] = sum_j w[t, j] * y[inverse[t, j]]`` (a plain sum without ``w``), summed in
    fp32: one pass (``_rows.gather_sum``), or, while autograd records a graph through
    ``y`` or ``w``, a gather and a batched ``[1, k] x [k, D]`` product. Its backward is
    :func:`combine_backward`."""
    if not _rows.differentiable(y, w):
        return _rows.gather_sum(y, inverse, w)
    num_tokens, top_k = inverse.shape
    rows = y.index_select(0, inverse.reshape(-1)).view(num_tokens, top_k, y.shape[1])
    if w is None:
        return rows.sum(dim=1)
    return torch.bmm(w.to(y.dtype).unsqueeze(1), rows).squeeze(1)


def combine_backward(
    grad: Tensor,
    y: Tensor,
    inverse: Tensor,
    w: Optional[Tensor],
    need_y: bool,
    need_w: bool,
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad_y, grad_w)`` of :func:`combine`, each None unless asked for, deterministic:
    ``grad_w[t, j] = <grad[t], y[inverse[t, j]]>`` and ``grad_y[inverse[t, j]] = w[t, j]
    * grad[t]`` (rows no copy names, i.e. padding and placeholders, zero). One pass each
    (``_rows.row_dots``, ``_rows.scatter_rows``); while autograd records a graph through
    the inputs (double backward), differentiable ops with one ``[R, D]`` temporary at a
    time: a gather and a batched product, then one gather of ``grad`` by each row's token
    scaled in place by the row's weight."""
    if not _rows.differentiable(grad, y, w):
        dw = _rows.row_dots(grad, y, inverse, w.dtype) if w is not None and need_w else None
        dy = _rows.scatter_rows(grad, inverse, w, y.shape[0]) if need_y else None
        return dy, dw
    dw = None
    if w is not None and need_w:
        num_tokens, top_k = inverse.shape
        rows = y.index_select(0, inverse.reshape(-1)).view(num_tokens, top_k, y.shape[1])
        dw = torch.bmm(rows, grad.to(y.dtype).unsqueeze(2)).squeeze(2).to(w.dtype)
        del rows
    return (to_rows(grad, inverse, w, y.shape[0]) if need_y else None), dw


def to_rows(grad: Tensor, inverse: Tensor, w: Optional[Tensor], rows: int) -> Tensor:
    """``out[inverse[t, j]] = w[t, j] * grad[t]`` into ``[rows, D]`` (``grad [T, D]``; weight
    1 without ``w``; rows no copy names, i.e. padding and placeholders, zero): each
    routed row's share of its token's gradient, the ``y`` half of :func:`combine_backward`.
    One pass (``_rows.scatter_rows``), or, while autograd records a graph through ``grad``
    or ``w``, one gather of ``grad`` by each row's token scaled in place by the row's
    weight."""
    if not _rows.differentiable(grad, w):
        return _rows.scatter_rows(grad, inverse, w, rows)
    top_k = inverse.shape[1]
    flat = inverse.reshape(-1).long()  # scatter_ takes int64 indices only
    n = flat.numel()
    if n == 0:  # no tokens: only padding rows
        return grad.new_zeros(rows, grad.shape[1])
    # copy of each row (the inverse permutation); padding rows: n, weight 0
    ids = torch.arange(n, device=flat.device)
    assign = flat.new_full((rows,), n).scatter_(0, flat, ids)
    scale = None if w is None else w.reshape(-1).to(grad.dtype)
    if rows != n:
        base = grad.new_ones(n) if scale is None else scale
        scale = torch.cat([base, base.new_zeros(1)]).index_select(0, assign)
        assign = assign.clamp(max=n - 1)
    elif scale is not None:
        scale = scale.index_select(0, assign)
    out = grad.index_select(0, torch.div(assign, top_k, rounding_mode="floor"))
    if scale is not None:
        out.mul_(scale.unsqueeze(1))  # in place: index_select keeps no output
    return out


class Combine(torch.autograd.Function):
    """:func:`combine` with :func:`combine_backward` as its backward (no ``index_put``):
    ``Combine.apply(y, inverse, w)``, ``w`` None for a plain sum. Its output is a fresh
    ``[T, D]`` tensor, not a view, so callers may update it in place (early transformers
    5.x Qwen2-MoE does)."""

    @staticmethod
    def forward(ctx: Any, y, inverse, w):
        ctx.save_for_backward(y, inverse, w)
        return combine(y, inverse, w)

    @staticmethod
    def backward(ctx: Any, grad):
        y, inverse, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy, dw = combine_backward(grad, y, inverse, w, need[0], w is not None and need[2])
        return dy, None, dw


# --------------------------------------------------------------------------- SwiGLU


def swiglu(
    pre: Tensor, act: Callable[[Tensor], Tensor] = F.silu, interleaved: bool = False
) -> Tensor:
    """``act(gate) * up`` of ``pre = [gate | up]``: the last dimension's halves, or, with
    ``interleaved``, its even (gate) and odd (up) columns; ``act`` is SiLU (SwiGLU)
    unless given. Differentiable torch ops: the activation of the unfused expert paths
    (:class:`groupmm.nn.GroupedExperts`, the transformers integration). The fused path
    runs it as the row op ``_rows.swiglu``, with :func:`swiglu_grad` as its backward."""
    if interleaved:
        gate, up = pre[..., ::2], pre[..., 1::2]
    else:
        gate, up = pre.chunk(2, dim=-1)
    return act(gate) * up


def swiglu_grad(grad: Tensor, pre: Tensor) -> Tensor:
    """Gradient of ``silu(gate) * up`` w.r.t. ``pre = [gate | up]`` (the last dimension's
    halves): ``d gate = grad * up * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)``,
    ``d up = grad * silu(gate)``. One pass (the row op ``_rows.swiglu_backward``) for 2-D
    operands; from differentiable ops while autograd records a graph through them
    (double backward)."""
    if grad.dim() == 2 and pre.dim() == 2 and not _rows.differentiable(grad, pre):
        return _rows.swiglu_backward(grad, pre)
    gate, up = pre.chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    d_gate = grad * up * s * (1 + gate * (1 - s))
    d_up = grad * gate * s
    return torch.cat([d_gate, d_up], dim=-1)
