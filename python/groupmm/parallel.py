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

One step of :func:`expert_parallel_block` on each rank (``W`` ranks, ``e = E / W``
experts each)::

    needed[t, w]          whether token t chose any expert of rank w
    all_to_all(counts)    [W, 3]: rows per rank, expert copies per rank, and a flag for
                          routing ids out of range; equal splits, on the device
    .tolist()             THE host sync: the split sizes that all_to_all_single takes as
                          Python ints, the copies to expect, and every rank's flag (so a
                          bad id raises the same error on every rank, none left waiting)
    all_to_all(rows)      each token ONCE to each rank that holds any of its experts (not
                          once per expert: with top-8 routing, ~2 rows per token instead
                          of 8 at W = 2), with its local expert ids and router weights
    expert block          the received rows' local expert copies: the fused block, rows
                          read through a routed index, the copies of each row weighted
                          and summed on the expert's rank
    all_to_all(y)         one result per (token, rank) back
    combine               out[t] = the sum of token t's results, one per rank

The backward runs the exchanges in reverse (no host sync: the split sizes are kept), with
no atomics (each token's rows are summed through a ``[T, W]`` slot index; each router
weight's gradient comes from the one row that carried it). Expert weight gradients are
local to their rank; the router (replicated) gets a per-rank partial gradient that DDP or
FSDP reduces as for any replicated parameter.

The unfused path (:class:`groupmm.moe.MoELayer` with ``fused=False``: any activation,
biases, padding) sends one row per expert copy instead (:func:`plan`,
:func:`dispatch_combine`), as torchtitan's all-to-all dispatcher does.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _checks as check
from . import _rows
from ._glue import Combine, Routes, dispatch, routes, take_rows
from .fused import _block, _check_expert_count, _check_experts, _int32

__all__ = ["expert_compute", "expert_parallel_block", "exchange"]


# --------------------------------------------------------------------------- the exchange


def _exchange_rows(
    x: Tensor, out_splits: List[int], in_splits: List[int], group: Any, spare: bool
) -> Tensor:
    """``all_to_all_single`` into a fresh buffer, with one zero row after the received
    ones when ``spare`` (the row that the slots of absent pairs name)."""
    rows = sum(out_splits)
    out = x.new_empty((rows + int(spare), *x.shape[1:]))
    if spare:
        out[rows:].zero_()
    dist.all_to_all_single(out[:rows], x.contiguous(), out_splits, in_splits, group=group)
    return out


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
        return _exchange_rows(x, out_splits, in_splits, group, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange_rows(grad, in_splits, out_splits, ctx.group, False), None, None, None


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
    _raise_on_bad_ids(flags, world, num_local)
    received = sum(out_splits)
    labels = torch.arange(num_local, device=recv.device).repeat(world)
    local_ids = torch.repeat_interleave(
        labels, recv[:, :num_local].reshape(-1), output_size=received
    )
    return Plan(r, in_splits, out_splits, local_ids.view(received, 1))


def _raise_on_bad_ids(flags: List[int], world: int, num_local: int) -> None:
    """The error every rank raises, after the exchange, when any rank's expert ids were
    out of range (``flags``: one per rank)."""
    if any(flags):
        ranks = [i for i, f in enumerate(flags) if f]
        raise ValueError(
            f"expert_ids: expected expert ids in [0, {world * num_local}) (E = world size "
            f"{world} x {num_local} local experts), found ids out of range on rank(s) {ranks}"
        )


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


# --------------------------------------------------------------------------- one copy per rank


class TokenPlan(NamedTuple):
    """One rank's side of a dispatch that sends each token once to each rank holding any
    of its experts (:func:`plan_tokens`); the ``N`` rows sent go in destination-rank
    order, then token order."""

    send_tokens: Tensor
    """int32 ``[N]`` token of each row sent."""
    slots: Tensor
    """int32 ``[T, W]`` row sent of token ``t`` to rank ``w``, or ``N`` (a spare zero
    row) when ``t`` has no expert there."""
    rank_of: Tensor
    """int64 ``[T, k]`` rank of each chosen expert."""
    per_rank: Tensor
    """int64 ``[W]`` rows sent to each rank (``in_splits`` on the device)."""
    in_splits: List[int]
    """Rows this rank sends to each rank."""
    out_splits: List[int]
    """Rows this rank receives from each rank."""
    copies: int
    """Expert copies among the received rows (the sum of their local experts)."""


def plan_tokens(expert_ids: Tensor, num_local: int, group: Optional[Any] = None) -> TokenPlan:
    """:func:`plan` for one copy of each token per destination rank (collective; the one
    host sync: the split sizes, the received copies and every rank's out-of-range flag)."""
    world = dist.get_world_size(group)
    experts = world * num_local
    tokens = expert_ids.shape[0]
    device = expert_ids.device
    bad = ((expert_ids < 0) | (expert_ids >= experts)).any()
    rank_of = torch.div(expert_ids.clamp(0, experts - 1), num_local, rounding_mode="floor")
    needed = torch.zeros(tokens, world, dtype=torch.bool, device=device)
    needed.scatter_(1, rank_of, True)
    per_rank = needed.sum(0)  # tokens sent to each rank
    flat = rank_of.reshape(-1)
    copies = torch.zeros(world, dtype=per_rank.dtype, device=device)
    copies.scatter_add_(0, flat, torch.ones_like(flat))
    meta = torch.stack([per_rank, copies, bad.to(per_rank.dtype).expand(world)], dim=1)
    recv = torch.empty_like(meta)
    dist.all_to_all_single(recv, meta, group=group)
    # the rows' places, queued before the host waits: by rank, then by token (the scan
    # along the last dimension of [W, T]: torch's scan along dim 0 of a [T, W] tensor
    # took 2.6 ms for T = 16384, W = 4 on an H100)
    starts = torch.cumsum(per_rank, 0) - per_rank
    by_rank = needed.t().contiguous()
    places = (torch.cumsum(by_rank, 1) - 1 + starts.unsqueeze(1)).t()  # [T, W]
    # the host sync: all_to_all_single takes its split sizes as Python ints
    host = torch.cat([per_rank, recv.reshape(-1)]).tolist()
    in_splits = host[:world]
    out_splits = host[world::3]
    received_copies, flags = host[world + 1 :: 3], host[world + 2 :: 3]
    _raise_on_bad_ids(flags, world, num_local)
    sent = sum(in_splits)
    slots = torch.where(needed, places, sent).to(torch.int32).contiguous()
    token_ids = torch.arange(tokens, device=device, dtype=torch.int32)
    send_tokens = torch.empty(sent + 1, device=device, dtype=torch.int32)
    # every (t, w) pair writes its row; the pairs with no row all write the spare row N
    send_tokens.scatter_(0, slots.reshape(-1).long(), token_ids.repeat_interleave(world))
    copies_in = sum(received_copies)
    return TokenPlan(send_tokens[:sent], slots, rank_of, per_rank, in_splits, out_splits, copies_in)


class _Send(torch.autograd.Function):
    """The dispatch of :func:`expert_parallel_block`: each token's row, and its router
    weights of the receiving rank's experts (0 for the others), to each rank that holds
    any of its experts. Backward: the reverse exchanges, then each token's rows summed
    and each weight's gradient taken from the one row that carried it (no atomics)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weights: Optional[Tensor], p: TokenPlan, local: Tensor, group: Any
    ):
        ctx.plan, ctx.group = p, group
        ctx.weighted = weights is not None
        sent = take_rows(x, p.send_tokens)
        rows = _exchange_rows(sent, p.out_splits, p.in_splits, group, False)
        del sent
        if weights is None:
            return rows, None
        w = weights.index_select(0, p.send_tokens)
        w = torch.where(local, w, w.new_zeros(()))
        return rows, _exchange_rows(w, p.out_splits, p.in_splits, group, False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_rows: Tensor, d_weights: Optional[Tensor]):
        p, group = ctx.plan, ctx.group
        back = _exchange_rows(d_rows, p.in_splits, p.out_splits, group, True)
        dx = _rows.gather_sum(back, p.slots, None)
        del back
        dw = None
        if ctx.weighted:
            if d_weights is None:
                d_weights = d_rows.new_zeros(d_rows.shape[0], p.rank_of.shape[1])
            back_w = _exchange_rows(d_weights, p.in_splits, p.out_splits, group, True)
            # weight (t, j) rode on the row sent to rank_of[t, j]: column j of that row
            row = p.slots.long().gather(1, p.rank_of)
            dw = back_w.gather(0, row).gather(1, _columns(row))
        return dx, dw, None, None, None


def _columns(row: Tensor) -> Tensor:
    """``[T, k]`` with ``[t, j] = j``: each row's column indices."""
    return torch.arange(row.shape[1], device=row.device).expand_as(row)


class _Return(torch.autograd.Function):
    """The combine of :func:`expert_parallel_block`: each received token's result back to
    its rank, where each token's results (one per rank that held any of its experts,
    weighted there) are summed. Backward: each token's gradient copied to its rows (a row
    gather), then the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, p: TokenPlan, group: Any):
        ctx.plan, ctx.group = p, group
        back = _exchange_rows(y, p.in_splits, p.out_splits, group, True)
        return _rows.gather_sum(back, p.slots, None)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor):
        p, group = ctx.plan, ctx.group
        rows = take_rows(d_out.contiguous(), p.send_tokens)
        return _exchange_rows(rows, p.out_splits, p.in_splits, group, False), None, None


def _local_routes(ids: Tensor, num_local: int, copies: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(offs, src, inverse)`` over the ``copies`` local expert copies of the received
    rows (``ids [R_recv, k]``, ``num_local`` in a slot of another rank's expert): the
    copies in local-expert order and one spare row past ``offs[-1]`` that every other
    slot names (it computes nothing and adds zero)."""
    received, top_k = ids.shape
    keys, order = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(num_local, device=ids.device, dtype=torch.int32)
    offs = torch.searchsorted(keys, bounds, right=True, out_int32=True)
    spare = int(received * top_k > copies)  # slots of other ranks' experts
    src = torch.zeros(copies + spare, device=ids.device, dtype=torch.int32)
    src[:copies] = torch.div(order[:copies], top_k, rounding_mode="floor")
    positions = torch.arange(order.shape[0], device=ids.device, dtype=torch.int32)
    inverse = torch.empty_like(positions).scatter_(0, order, positions).clamp_(max=copies)
    return offs, src, inverse.view(received, top_k)


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
    _check_expert_count(x, w_in, w_out, num_local, "x", "w_in")
    p = plan_tokens(expert_ids, num_local, group)
    # each sent row's chosen experts as the receiving rank's local ids (num_local for
    # another rank's expert), sent beside the rows
    ids = expert_ids.index_select(0, p.send_tokens)
    ranks = torch.arange(len(p.in_splits), device=x.device)
    owner = torch.repeat_interleave(ranks, p.per_rank, output_size=p.send_tokens.shape[0])
    ids = ids - (owner * num_local).unsqueeze(1)
    local = (ids >= 0) & (ids < num_local)
    ids = torch.where(local, ids, num_local).to(torch.int32)
    rows, w = _Send.apply(x, weights, p, local, group)
    recv_ids = _exchange_rows(ids, p.out_splits, p.in_splits, group, False)
    offs, src, inverse = _local_routes(recv_ids, num_local, p.copies)
    y = _block(rows, w_in, w_out, offs, src, inverse, w)
    return _Return.apply(y, p, group)


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
    expert_ids: Optional[Tensor] = None,
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
            weights), or None; ``[R, k]`` with ``expert_ids``.
        expert_ids: instead of ``counts``/``offs`` and ``index``: integer ``[R, k]`` (or
            ``[R]``) local expert ids of each row, as a dispatcher that sends each token
            once per rank gives them (DeepEP's ``-1``, or any id outside ``[0, E)``, is
            a sentinel: that slot contributes nothing); ``out[i] = sum_j weights[i, j]
            * expert_{ids[i, j]}(rows[i])``.

    Returns:
        ``[R, D]`` in ``rows``' dtype and order. Rows past the counted ones (positions
        ``>= offs[-1]``: padding, sentinel rows) are zero and get zero gradients.
    """
    # the caller's names (rows, counts or offs), not expert_block's (x, offs)
    check.dims("rows", rows, 2, "[R, D]")
    _check_experts(rows, w_in, w_out)
    given = [counts is not None, offs is not None, expert_ids is not None]
    if sum(given) != 1:
        raise ValueError(
            "counts, offs, expert_ids: expected exactly one (integer [E] rows per expert, "
            "int32 [E] cumulative group ends, or integer [R, k] expert ids per row)"
        )
    if expert_ids is not None:
        return _compute_by_ids(rows, w_in, w_out, expert_ids, index, weights)
    name, groups = ("counts", counts) if counts is not None else ("offs", cast(Tensor, offs))
    check.index(name, groups, 1, "[E]")
    check.device(name, groups, rows.device, "rows")
    _check_expert_count(rows, w_in, w_out, groups.shape[0], "rows", name)
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


def _compute_by_ids(
    rows: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    expert_ids: Tensor,
    index: Optional[Tensor],
    weights: Optional[Tensor],
) -> Tensor:
    """:func:`expert_compute` with ``expert_ids``: :func:`groupmm.fused.expert_block` on
    the rows' local copies, sentinel slots sorted past ``offs[-1]``."""
    if index is not None:
        raise ValueError("index: expected None with expert_ids (the ids order the rows)")
    if expert_ids.dim() == 1:
        expert_ids = expert_ids.unsqueeze(1)
    n = rows.shape[0]
    check.index("expert_ids", expert_ids, 2, "[R, k] or [R]")
    ok = expert_ids.shape[0] == n
    check.shape("expert_ids", expert_ids, ok, "[R={}, k] (rows.shape[0])", n)
    check.device("expert_ids", expert_ids, rows.device, "rows")
    if weights is not None:
        check.tensor("weights", weights)
        if weights.dim() == 1:
            weights = weights.unsqueeze(1)
        check.same_shape("weights", weights, "expert_ids", expert_ids)
        check.device("weights", weights, rows.device, "rows")
    _check_expert_count(rows, w_in, w_out, w_in.shape[0], "rows", "w_in")
    r = routes(expert_ids, w_in.shape[0], placeholders=True)
    return _block(rows, w_in, w_out, r.offs, _int32(r.src), _int32(r.inverse), weights)
