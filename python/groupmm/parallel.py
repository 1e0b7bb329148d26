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
FSDP reduces as for any replicated parameter. The plans, the exchanges and the autograd
functions that send and return the rows: ``groupmm._exchange``.

The unfused path (:class:`groupmm.moe.MoELayer` with ``fused=False``: any activation,
biases, padding) sends one row per expert copy instead (:func:`plan`,
:func:`dispatch_combine`), as torchtitan's all-to-all dispatcher does.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, cast

import torch
from torch import Tensor

from . import _checks as check

# Plan, plan and dispatch_combine (the unfused path), TokenPlan, LocalExperts: names of
# groupmm.parallel too (moe and benches/bench_ep.py read them here)
from ._exchange import (  # noqa: F401
    LocalExperts,
    Plan,
    TokenPlan,
    _exchange_rows,
    _Return,
    _Send,
    dispatch_combine,
    exchange,
    plan,
    plan_tokens,
)
from ._fixed import (  # noqa: F401
    ROUTING_CHECK_LAG,
    fixed_block,
    fixed_exchange_rows,
    plan_fixed,
    routing_check,
)
from ._glue import routes
from .fused import GateUp, _block, _check_expert_count, _check_experts, _int32

__all__ = ["check_routing", "expert_compute", "expert_parallel_block", "exchange"]


# --------------------------------------------------------------------------- one copy per rank


def _local_routes(ids: Tensor, num_local: int, copies: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(offs, src, inverse)`` over the ``copies`` local expert copies of the received
    rows (``ids [R_recv, k]``, ``num_local`` in a slot of another rank's expert): the
    copies in local-expert order and one spare row past ``offs[-1]`` that every other
    slot names (it computes nothing and adds zero)."""
    received, top_k = ids.shape
    keys, order = torch.sort(ids.reshape(-1), stable=True)
    bounds = torch.arange(num_local, device=ids.device, dtype=torch.int32)
    offs = torch.searchsorted(keys, bounds, right=True, out_int32=True)
    # 1 where slots of other ranks' experts exist (received * top_k >= copies), else 0;
    # arithmetic, not a branch, so that traced (unbacked) sizes need no guard
    extra = received * top_k - copies
    spare = min(extra, 1) if isinstance(extra, int) else torch.sym_min(extra, 1)
    # the spare position's row is the first such slot's (any row: it computes nothing)
    src = torch.div(order[: copies + spare], top_k, rounding_mode="floor").to(torch.int32)
    positions = torch.arange(order.shape[0], device=ids.device, dtype=torch.int32)
    inverse = torch.empty_like(positions).scatter_(0, order, positions).clamp_(max=copies)
    return offs, src, inverse.view(received, top_k)


def expert_parallel_block(
    x: Tensor,
    expert_ids: Tensor,
    weights: Optional[Tensor],
    w_in: GateUp,
    w_out: Tensor,
    group: Optional[Any] = None,
    *,
    capacity: Optional[int] = None,
    chunks: int = 1,
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
        w_in: ``[E / W, D, 2F]`` this rank's experts (gate ``[:F]``, up ``[F:]``), or
            the pair ``(gate, up)`` of ``[E / W, D, F]`` weights (no concatenation).
        w_out: ``[E / W, F, D]``.
        group: the process group (default: the world).
        capacity: None (exact sizes): one host sync per call for the split sizes, and
            an out-of-range id raises in the call. An int, the same on every rank and
            at least every rank's ``T`` (e.g. the tokens per rank of a training batch):
            fixed-size exchanges of ``capacity`` rows per pair of ranks, with no host
            sync at all (the host runs ahead of the GPU; a whole step can be captured
            in a CUDA graph). That sends :func:`fixed_exchange_rows` times the rows of
            the exact exchange (padding where a token has no expert on a rank) and
            sizes the experts' intermediates for the worst case, every rank's copies on
            one rank (``W * capacity * k`` rows; the exact size's ``W`` times at uniform
            routing). An out-of-range id's copy is sent nowhere and the error is raised
            on every rank ``ROUTING_CHECK_LAG`` (8) calls with this group later, or at
            :func:`check_routing`; not checked while a CUDA graph is captured or
            torch.compile traces.
        chunks: with ``capacity``: split this rank's tokens into this many chunks
            (``ceil(capacity / chunks)`` rows per pair of ranks each, the same results)
            and pipeline them, on CUDA the exchanges on a second stream: chunk ``i +
            1``'s dispatch
            runs under chunk ``i``'s experts, chunk ``i``'s return under chunk ``i +
            1``'s, and the same in the backward. The exchanges get SMs beside the
            expert products only when those leave some free: run the call inside
            :func:`groupmm.sm_limit`. 1: no pipeline.

    Returns:
        ``[T, D]`` in ``x``'s dtype: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.

    No host sync in the backward.
    """
    w, up = _check_experts(x, w_in, w_out)
    check.index("expert_ids", expert_ids, 2, "[T, k]")
    ok = expert_ids.shape[0] == x.shape[0]
    check.shape("expert_ids", expert_ids, ok, "[T={}, k]", x.shape[0])
    check.device("expert_ids", expert_ids, x.device, "x")
    if weights is not None:
        check.tensor("weights", weights)
        check.same_shape("weights", weights, "expert_ids", expert_ids)
        check.device("weights", weights, x.device, "x")
    num_local = w.shape[0]
    _check_expert_count(x, w, up, w_out, num_local, "x", "w_in")
    if capacity is None:
        p = plan_tokens(expert_ids, num_local, group)
        rows, row_weights = _Send.apply(x, weights, p, num_local, group)
        # each row's chosen experts as this rank's local ids (num_local: another rank's)
        recv_ids = _exchange_rows(p.send_ids, p.out_splits, p.in_splits, group, False)
        offs, src, inverse = _local_routes(recv_ids, num_local, cast(int, p.copies))
        y = _block(rows, w, w_out, offs, src, inverse, row_weights, up)
        return _Return.apply(y, p, group)
    check.positive_int("capacity", capacity)
    if capacity < x.shape[0]:
        raise ValueError(
            f"capacity: expected at least this rank's tokens {x.shape[0]}, found {capacity}"
        )
    check.positive_int("chunks", chunks)
    routing_check.check(group, ROUTING_CHECK_LAG - 1)  # an earlier call's flags
    return fixed_block(x, expert_ids, weights, (w, up, w_out), group, capacity, chunks)


def check_routing(group: Optional[Any] = None) -> None:
    """Raise, on every rank of ``group``, the out-of-range error of the
    :func:`expert_parallel_block` calls with ``capacity`` not checked yet (fixed sizes
    check the routing ``ROUTING_CHECK_LAG`` calls late); nothing when their ids were in
    range. Waits for the GPU to pass those calls' exchanges. Every rank should call it
    at the same point (e.g. after the last step)."""
    routing_check.check(group)


# --------------------------------------------------------------------------- external dispatchers


def expert_compute(
    rows: Tensor,
    w_in: GateUp,
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
            strides), or the pair ``(gate, up)`` of ``[E, D, F]`` weights (read in
            place: no concatenated copy).
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
    w, up = _check_experts(rows, w_in, w_out)
    given = [counts is not None, offs is not None, expert_ids is not None]
    if sum(given) != 1:
        raise ValueError(
            "counts, offs, expert_ids: expected exactly one (integer [E] rows per expert, "
            "int32 [E] cumulative group ends, or integer [R, k] expert ids per row)"
        )
    if expert_ids is not None:
        return _compute_by_ids(rows, w, up, w_out, expert_ids, index, weights)
    name, groups = ("counts", counts) if counts is not None else ("offs", cast(Tensor, offs))
    check.index(name, groups, 1, "[E]")
    check.device(name, groups, rows.device, "rows")
    _check_expert_count(rows, w, up, w_out, groups.shape[0], "rows", name)
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
    return _block(rows, w, w_out, offs, src, inverse, weights, up)


def _compute_by_ids(
    rows: Tensor,
    w: Tensor,
    up: Optional[Tensor],
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
    _check_expert_count(rows, w, up, w_out, w.shape[0], "rows", "w_in")
    r = routes(expert_ids, w.shape[0], placeholders=True)
    return _block(rows, w, w_out, r.offs, _int32(r.src), _int32(r.inverse), weights, up)
