"""Expert parallelism (EP) on ``torch.distributed``: a MoE layer's experts sharded over the
ranks of a process group, and the expert computation alone for rows that another engine
dispatched.

- :func:`expert_parallel_block`: the fused SwiGLU expert block (:func:`groupmm.fused.
  expert_block`) with its ``E`` experts sharded over ``W`` ranks, ``E / W`` each (rank
  ``r`` owns experts ``r*E/W ... (r+1)*E/W - 1``). What :class:`groupmm.moe.MoELayer`
  runs with ``ep_group=``.
- :func:`expert_compute`: the expert computation on already-dispatched rows (device-side
  per-expert counts or ``offs``, an optional gather index and per-row weights; rows past
  the counted ones contribute nothing), with no host sync: the entry for torchtitan's EP,
  DeepEP-style dispatchers and other engines' own exchanges.

One step of :func:`expert_parallel_block` on each rank::

    routes(ids)           local copies in global-expert order: offs, src, inverse, counts
    rows = x[src]         the send buffer (global-expert order is destination-rank order)
    all_to_all(counts)    [W, E/W] per-expert counts, equal splits, on the device, with a
                          flag per rank for routing indices out of range
    .tolist()             THE host sync: the split sizes that all_to_all_single takes as
                          Python ints (and every rank's flag, so that a bad index raises
                          the same error on every rank instead of hanging the others)
    all_to_all(rows)      uneven splits: received rows, by (source rank, local expert)
    expert block          local experts on the received rows read through a routed index
                          (no copy into expert order), output back in received order
    all_to_all(y)         the reverse exchange
    combine               out[t] = sum_j weights[t, j] * y[inverse[t, j]]

The backward runs the exchanges in reverse (no host sync: the split sizes are kept).
Expert weight gradients are local to their rank; the router (replicated) gets a per-rank
partial gradient that DDP or FSDP reduces as for any replicated parameter.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _checks as check
from ._glue import Combine, Routes, dispatch, routes
from .fused import _block, _check_expert_count, _check_experts, _int32

__all__ = ["expert_compute", "expert_parallel_block", "exchange"]


# --------------------------------------------------------------------------- the exchange


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits along dim 0; backward: the reverse
    exchange (each received row's gradient goes back to the rank that sent the row).

    Once differentiable: a double backward raises instead of silently leaving out the
    exchanges' second-order terms (the reverse exchange is a collective outside autograd).
    An exchange recorded in the backward would not do either: a rank whose part of the
    first backward has no graph (no tokens: gradients made as fresh zeros) records fewer
    exchanges than the others, and the second backward waits forever."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: List[int], in_splits: List[int], group: Any):
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, out_splits: List[int], in_splits: List[int], group: Any) -> Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def exchange(
    x: Tensor, out_splits: List[int], in_splits: List[int], group: Optional[Any] = None
) -> Tensor:
    """Differentiable ``all_to_all_single`` of ``x``'s rows: ``in_splits[r]`` rows go to
    rank ``r``, ``out_splits[r]`` rows come from it; the backward sends the gradient back
    the same way."""
    return _Exchange.apply(x, list(out_splits), list(in_splits), group)


# --------------------------------------------------------------------------- the plan


class Plan(NamedTuple):
    """One rank's side of a dispatch (:func:`plan`)."""

    routes: Routes
    """The local copies in global-expert order (``offs``, ``src``, ``inverse``)."""
    in_splits: List[int]
    """Rows this rank sends to each rank."""
    out_splits: List[int]
    """Rows this rank receives from each rank."""
    local_ids: Tensor
    """int64 ``[R_recv, 1]`` local expert of each received row (received rows come by
    source rank, then local expert): ``routes(local_ids, E / W)`` orders them."""


def plan(expert_ids: Tensor, num_local: int, group: Optional[Any] = None) -> Plan:
    """Route ``expert_ids [T, k]`` (global ids in ``[0, W * num_local)``) over the ranks of
    ``group``: the local routing, one exchange of per-expert counts, and the one host sync
    for the split sizes (collective: every rank of ``group`` calls it). Raises
    ``ValueError`` on every rank when any rank's ids are out of range."""
    world = dist.get_world_size(group)
    experts = world * num_local
    bad = ((expert_ids < 0) | (expert_ids >= experts)).any()
    # out-of-range ids are clamped so that every rank reaches the exchange below (a rank
    # raising alone would leave the others waiting in it); all of them raise after it
    r = routes(expert_ids.clamp(0, experts - 1), experts, counts=True)
    counts = cast(Tensor, r.counts).view(world, num_local)  # counts=True: never None
    meta = torch.cat([counts, bad.to(counts.dtype).expand(world, 1)], dim=1)
    recv = torch.empty_like(meta)
    dist.all_to_all_single(recv, meta, group=group)
    # the host sync: all_to_all_single takes its split sizes as Python ints
    sizes = torch.cat([counts.sum(1), recv[:, :num_local].sum(1), recv[:, num_local]])
    host = sizes.tolist()
    in_splits, out_splits, flags = host[:world], host[world : 2 * world], host[2 * world :]
    if any(flags):
        ranks = [i for i, f in enumerate(flags) if f]
        raise ValueError(
            f"expert_ids: expected expert ids in [0, {experts}) (E = world size {world} x "
            f"{num_local} local experts), found ids out of range on rank(s) {ranks}"
        )
    received = sum(out_splits)
    labels = torch.arange(num_local, device=recv.device).repeat(world)
    local_ids = torch.repeat_interleave(
        labels, recv[:, :num_local].reshape(-1), output_size=received
    )
    return Plan(r, in_splits, out_splits, local_ids.view(received, 1))


LocalExperts = Callable[[Tensor, Plan], Tensor]
"""``(received rows [R_recv, D], plan) -> [R_recv, D]``: the local experts on the
received rows, output in received order."""


def dispatch_combine(
    x: Tensor,
    expert_ids: Tensor,
    weights: Optional[Tensor],
    num_local: int,
    experts: LocalExperts,
    group: Optional[Any] = None,
) -> Tensor:
    """The EP step around any local expert computation ``experts`` (module docstring):
    plan, send ``x``'s copies, run ``experts`` on the received rows, send the results back
    and combine them with ``weights`` (``[T, k]``; None sums). Differentiable in ``x``,
    ``weights`` and whatever ``experts`` closes over."""
    p = plan(expert_ids, num_local, group)
    send = dispatch(x, p.routes)  # [T*k, D] in global-expert (= destination) order
    received = exchange(send, p.out_splits, p.in_splits, group)
    del send
    y = experts(received, p)
    back = exchange(y, p.in_splits, p.out_splits, group)
    return Combine.apply(back, p.routes.inverse, weights)


def _fused_local(w_in: Tensor, w_out: Tensor) -> LocalExperts:
    def run(received: Tensor, p: Plan) -> Tensor:
        local = routes(p.local_ids, w_in.shape[0])
        src, inverse = _int32(local.src), _int32(local.inverse)
        return _block(received, w_in, w_out, local.offs, src, inverse, None)

    return run


def expert_parallel_block(
    x: Tensor,
    expert_ids: Tensor,
    weights: Optional[Tensor],
    w_in: Tensor,
    w_out: Tensor,
    group: Optional[Any] = None,
) -> Tensor:
    """:func:`groupmm.fused.expert_block` with the experts sharded over ``group``.

    Collective: every rank of ``group`` calls it with its own tokens (any number, zero
    included) and its own slice of the experts.

    Args:
        x: ``[T, D]`` this rank's tokens.
        expert_ids: integer ``[T, k]`` global expert ids in ``[0, E)``, ``E = W *
            w_in.shape[0]``; any id out of range on any rank raises ``ValueError`` on
            every rank (no rank is left waiting).
        weights: ``[T, k]`` router weights (differentiable), or None for a plain sum.
        w_in: ``[E / W, D, 2F]`` this rank's experts (gate ``[:F]``, up ``[F:]``).
        w_out: ``[E / W, F, D]``.
        group: the process group (default: the world).

    Returns:
        ``[T, D]`` in ``x``'s dtype: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.

    One host sync per call (the split sizes), none in the backward.
    """
    _check_experts(x, w_in, w_out)
    check.index("expert_ids", expert_ids, 2, "[T, k]")
    ok = expert_ids.shape[0] == x.shape[0]
    check.shape("expert_ids", expert_ids, ok, "[T={}, k]", x.shape[0])
    check.device("expert_ids", expert_ids, x.device, "x")
    if weights is not None:
        check.tensor("weights", weights)
        check.same_shape("weights", weights, "expert_ids", expert_ids)
        check.device("weights", weights, x.device, "x")
    num_local = w_in.shape[0]
    _check_expert_count(x, w_in, w_out, num_local)
    # before the exchanges: a rank raising alone after them would leave the others waiting
    # in the backward's (and the native rule would name w_in and w_out "w" and "b")
    check.device("w_in", w_in, x.device, "x")
    check.device("w_out", w_out, x.device, "x")
    return dispatch_combine(x, expert_ids, weights, num_local, _fused_local(w_in, w_out), group)


# --------------------------------------------------------------------------- external dispatchers


def expert_compute(
    rows: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    *,
    counts: Optional[Tensor] = None,
    offs: Optional[Tensor] = None,
    index: Optional[Tensor] = None,
    weights: Optional[Tensor] = None,
) -> Tensor:
    """The SwiGLU experts on rows another engine dispatched: ``out[i] = weights[i] *
    (silu(a @ w_gate[g]) * (a @ w_up[g])) @ w_out[g]`` for ``a = rows[i]`` and ``g`` the
    expert of ``i``'s position in expert order. No host sync, CUDA-graph safe,
    differentiable in ``rows``, ``w_in``, ``w_out`` and ``weights``.

    Args:
        rows: ``[R, D]`` received rows.
        w_in: ``[E, D, 2F]`` the local experts, gate ``[:F]`` and up ``[F:]`` (any
            strides).
        w_out: ``[E, F, D]``.
        counts: integer ``[E]`` rows per expert, on the device (e.g. the counts an
            exchange received), or
        offs: int32 ``[E]`` cumulative group ends (torch's ``F.grouped_mm`` convention);
            exactly one of the two.
        index: integer ``[R]``, a permutation of ``range(R)``: position ``p`` of the
            expert order (experts in turn, ``counts[g]`` positions each) holds
            ``rows[index[p]]``; the output is in ``rows``' order. None: ``rows`` are in
            expert order already (no gather, no copy). Not checked to be a permutation
            (that needs a host sync).
        weights: ``[R]`` (or ``[R, 1]``) per-row scale in ``rows``' order (router
            weights), or None.

    Returns:
        ``[R, D]`` in ``rows``' dtype and order. Rows past the counted ones (positions
        ``>= offs[-1]``: padding, sentinel rows) are zero and get zero gradients.
    """
    # the caller's names (rows, counts or offs), not expert_block's (x, offs)
    check.dims("rows", rows, 2, "[R, D]")
    _check_experts(rows, w_in, w_out)
    if (counts is None) == (offs is None):
        raise ValueError(
            "counts, offs: expected exactly one (integer [E] rows per expert, or int32 [E] "
            "cumulative group ends)"
        )
    name, groups = ("counts", counts) if counts is not None else ("offs", cast(Tensor, offs))
    check.index(name, groups, 1, "[E]")
    check.device(name, groups, rows.device, "rows")
    _check_rows_experts(rows, w_in, w_out, name, groups)
    if counts is not None:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
    else:
        offs = _int32(groups)
    n = rows.shape[0]
    src = inverse = None
    if index is not None:
        check.index("index", index, 1, "[R]")
        check.shape("index", index, index.shape[0] == n, "[R={}] (rows.shape[0])", n)
        check.device("index", index, rows.device, "rows")
        positions = torch.arange(n, device=rows.device, dtype=torch.int32)
        src = _int32(index)
        inverse = torch.empty_like(positions).scatter_(0, index.long(), positions).view(n, 1)
    if weights is not None:
        check.tensor("weights", weights)
        ok = weights.shape in ((n,), (n, 1))
        check.shape("weights", weights, ok, "[R={}] or [R, 1] (rows.shape[0])", n)
        check.device("weights", weights, rows.device, "rows")
        weights = weights.reshape(n, 1)
        if inverse is None:
            inverse = torch.arange(n, device=rows.device, dtype=torch.int32).view(n, 1)
    return _block(rows, w_in, w_out, offs, src, inverse, weights)


def _check_rows_experts(
    rows: Tensor, w_in: Tensor, w_out: Tensor, name: str, groups: Tensor
) -> None:
    """:func:`groupmm.fused._check_expert_count` in :func:`expert_compute`'s names: ``E``
    is the length of ``groups`` (``counts`` or ``offs``, called ``name``), ``D`` the width
    of ``rows``; ``w_in`` and ``w_out`` in ``rows``' dtype, on its device."""
    experts, width = groups.shape[0], rows.shape[1]
    ok = w_in.shape[0] == experts and w_in.shape[1] == width
    what = "[E={}, D={}, 2F] (E = len({}), D = rows.shape[1])"
    check.shape("w_in", w_in, ok, what, experts, width, name)
    ok = w_out.shape == (experts, w_in.shape[2] // 2, width)
    what = "[E={}, F={}, D={}] (E = len({}), 2F = w_in.shape[2], D = rows.shape[1])"
    check.shape("w_out", w_out, ok, what, experts, w_in.shape[2] // 2, width, name)
    for arg, t in (("w_in", w_in), ("w_out", w_out)):
        check.dtype(arg, t, rows.dtype, "rows")
        check.device(arg, t, rows.device, "rows")
