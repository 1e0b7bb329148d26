"""The exchanges of expert parallelism (:mod:`groupmm.parallel`, whose docstring tells
the step): the plans (exact sizes: one collective of counts and the one host sync each;
fixed sizes: none), the differentiable ``all_to_all_single`` of rows, and the autograd
functions that send each token once per rank and bring its results back.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _rows
from ._glue import Combine, Routes, dispatch, routes, take_rows

# --------------------------------------------------------------------------- the exchange


def _exchange_rows(
    x: Tensor, out_splits: List[int], in_splits: List[int], group: Any, spare: bool
) -> Tensor:
    """``all_to_all_single`` into a fresh buffer, with one zero row before the received
    ones when ``spare`` (row 0, the row that the slots of absent pairs name)."""
    rows = sum(out_splits)
    out = x.new_empty((rows + int(spare), *x.shape[1:]))
    if spare:
        out[0].zero_()
    dist.all_to_all_single(out[int(spare) :], x.contiguous(), out_splits, in_splits, group=group)
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


def _captures_scalars() -> bool:
    """Whether ``torch.compile`` traces ``.tolist()`` into data-dependent sizes (its
    ``capture_scalar_outputs``, as torchtitan sets it) instead of breaking the graph."""
    return bool(torch._dynamo.config.capture_scalar_outputs)


def _raise_on_bad_ids(flags: List[int], world: int, num_local: int, when: str = "") -> None:
    """The error every rank raises, after the exchange, when any rank's expert ids were
    out of range (``flags``: one per rank). Traced with the flags as data-dependent
    sizes (``torch.compile`` with ``capture_scalar_outputs``): a check in the graph,
    without the ranks' list."""
    if torch.compiler.is_compiling() and _captures_scalars():  # flags: symbolic sizes
        # the message a literal: torch.compile takes no message that reads variables
        torch._check(
            sum(flags) == 0,
            lambda: (
                "expert_ids: expected expert ids in [0, E) (E = the world size x the "
                "local experts), found ids out of range on some rank"
            ),
        )
        return
    if any(flags):
        ranks = [i for i, f in enumerate(flags) if f]
        raise ValueError(
            f"expert_ids: expected expert ids in [0, {world * num_local}) (E = world size "
            f"{world} x {num_local} local experts), found ids out of range on rank(s) "
            f"{ranks}{when}"
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
    """The EP step around any local expert computation ``experts`` (:mod:`groupmm.parallel`):
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
    send_ids: Tensor
    """int32 ``[N, k]`` each sent row's chosen experts as the receiving rank's local ids
    (``num_local`` for another rank's expert)."""
    slots: Tensor
    """int32 ``[T, W]`` ``1 +`` the row sent of token ``t`` to rank ``w``, or ``0`` when
    ``t`` has no expert there: row 0 of a returned buffer is a zero row
    (:func:`_exchange_rows` with ``spare``)."""
    rank_of: Tensor
    """``[T, k]`` rank of each chosen expert."""
    in_splits: List[int]
    """Rows this rank sends to each rank."""
    out_splits: List[int]
    """Rows this rank receives from each rank."""
    copies: Optional[int]
    """Expert copies among the received rows (the sum of their local experts); None
    with fixed sizes (:func:`plan_fixed`: on the device only)."""


def plan_tokens(expert_ids: Tensor, num_local: int, group: Optional[Any] = None) -> TokenPlan:
    """:func:`plan` for one copy of each token per destination rank (collective; the one
    host sync: the split sizes, the received copies and every rank's out-of-range flag).

    Everything the rows sent need (their tokens, their local expert ids, each token's
    slots) is queued before the host waits, in ``[W, T]`` order, and the sent rows are the
    first ``N`` of it: after the sync only the exchanges remain (the ops after a host
    sync are where the GPU waits for the host)."""
    world = dist.get_world_size(group)
    tokens, top_k = expert_ids.shape
    device = expert_ids.device
    ids = expert_ids.to(torch.int32)
    # an id out of [0, E) has a rank out of [0, W): no hit, so the copies fall short
    rank_of = torch.div(ids, num_local, rounding_mode="floor")
    ranks = torch.arange(world, device=device, dtype=torch.int32).view(world, 1, 1)
    hit = rank_of.unsqueeze(0) == ranks  # [W, T, k]
    needed = hit.any(2)  # [W, T]
    copies = hit.sum((1, 2))
    missing = tokens * top_k - copies.sum()
    meta = torch.stack([needed.sum(1), copies, missing.expand(world)], dim=1)
    recv = torch.empty_like(meta)
    dist.all_to_all_single(recv, meta, group=group)
    # the rows' places, 1-based, by rank, then by token (0: no row)
    place = torch.cumsum(needed.view(-1), 0).mul_(needed.view(-1))
    slots = torch.empty(tokens, world, device=device, dtype=torch.int32)
    slots.copy_(place.view(world, tokens).t())
    # what each place sends: its token and its experts as the receiver's local ids; the
    # pairs with no row all write place 0, which is never sent
    send_tokens = torch.empty(world * tokens + 1, device=device, dtype=torch.int32)
    token_ids = torch.arange(tokens, device=device, dtype=torch.int32)
    send_tokens.index_copy_(0, place, token_ids.repeat(world))
    local_ids = torch.where(hit, ids.unsqueeze(0) - ranks * num_local, num_local)
    send_ids = local_ids.new_empty(world * tokens + 1, top_k)
    send_ids.index_copy_(0, place, local_ids.view(world * tokens, top_k))
    # the host sync: all_to_all_single takes its split sizes as Python ints
    host = torch.cat([meta[:, 0], recv.reshape(-1)]).tolist()
    in_splits = host[:world]
    out_splits = host[world::3]
    received_copies, flags = host[world + 1 :: 3], host[world + 2 :: 3]
    _raise_on_bad_ids(flags, world, num_local)
    sent = sum(in_splits)
    return TokenPlan(
        send_tokens[1 : sent + 1],
        send_ids[1 : sent + 1],
        slots,
        rank_of,
        in_splits,
        out_splits,
        sum(received_copies),
    )


class _Send(torch.autograd.Function):
    """The dispatch of :func:`groupmm.parallel.expert_parallel_block`: each token's row,
    and its router weights of the receiving rank's experts (0 for the others), to each
    rank that holds any of its experts. Backward: the reverse exchanges, then each
    token's rows summed and each weight's gradient taken from the one row that carried
    it (no atomics)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weights: Optional[Tensor], p: TokenPlan, num_local: int, group: Any
    ):
        ctx.plan, ctx.group = p, group
        ctx.weighted = weights is not None
        if x.shape[0] == 0 and p.send_tokens.shape[0]:  # fixed sizes: padding only
            x = x.new_zeros(1, x.shape[1])
            weights = None if weights is None else weights.new_zeros(1, weights.shape[1])
        sent = take_rows(x, p.send_tokens)
        rows = _exchange_rows(sent, p.out_splits, p.in_splits, group, False)
        del sent
        if weights is None:
            return rows, None
        # the weights of the receiver's experts; 0 for the others
        w = weights.index_select(0, p.send_tokens).masked_fill_(p.send_ids == num_local, 0)
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
            # (an out-of-range id, sent nowhere with fixed sizes: any rank's slot, whose
            # column j carried a zero weight to no expert and so has a zero gradient)
            ranks = p.rank_of.long().clamp_(0, p.slots.shape[1] - 1)
            row = p.slots.long().gather(1, ranks)
            dw = back_w.gather(0, row).gather(1, _columns(row))
        return dx, dw, None, None, None


def _columns(row: Tensor) -> Tensor:
    """``[T, k]`` with ``[t, j] = j``: each row's column indices."""
    return torch.arange(row.shape[1], device=row.device).expand_as(row)


class _Return(torch.autograd.Function):
    """The combine of :func:`groupmm.parallel.expert_parallel_block`: each received
    token's result back to its rank, where each token's results (one per rank that held
    any of its experts, weighted there) are summed. Backward: each token's gradient
    copied to its rows (a row gather), then the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, p: TokenPlan, group: Any):
        ctx.plan, ctx.group = p, group
        back = _exchange_rows(y, p.in_splits, p.out_splits, group, True)
        return _rows.gather_sum(back, p.slots, None)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor):
        p, group = ctx.plan, ctx.group
        if d_out.shape[0] == 0 and p.send_tokens.shape[0]:  # fixed sizes: padding only
            d_out = d_out.new_zeros(1, d_out.shape[1])
        rows = take_rows(d_out.contiguous(), p.send_tokens)
        return _exchange_rows(rows, p.out_splits, p.in_splits, group, False), None, None
