"""Fixed-size exchanges of expert parallelism (:func:`groupmm.parallel.
expert_parallel_block` with ``capacity``): the plan that sends ``capacity`` rows to every
rank with no host sync (:func:`plan_fixed`), what it costs in rows
(:func:`fixed_exchange_rows`), the routing check that the host reads a few calls later
(:data:`routing_check`), and the block over them, whole or as a pipeline of chunks whose
exchanges run on a second CUDA stream (:func:`fixed_block`). The rows travel through
``groupmm._exchange``'s autograd functions, as with exact sizes.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._exchange import TokenPlan, _exchange_rows, _raise_on_bad_ids, _Return, _Send
from ._glue import routes
from .fused import _block


def plan_fixed(
    expert_ids: Tensor, num_local: int, capacity: int, group: Optional[Any] = None
) -> Tuple[TokenPlan, Tensor]:
    """:func:`plan_tokens` with fixed sizes and no host sync: ``capacity`` rows to each
    rank (the same ``capacity`` on every rank, at least this rank's ``T``), the first
    ``n_w`` of rank ``w``'s block the tokens that chose any of its experts (in token
    order), the rest padding (token 0's row, no expert). Not collective: the split sizes
    are known everywhere.

    Returns the plan (``copies`` None: known on the device only) and ``meta``, int32
    ``[W * capacity, k + 1]``: each row's local expert ids (``num_local`` for none) and,
    in column ``k``, this rank's out-of-range flag (1 when any of its ids lies outside
    ``[0, W * num_local)``; such copies are sent nowhere)."""
    world = dist.get_world_size(group)
    tokens, top_k = expert_ids.shape
    device = expert_ids.device
    ids = expert_ids.to(torch.int32)
    experts = world * num_local
    flag = ((ids < 0) | (ids >= experts)).any().to(torch.int32)
    # an id out of [0, E) has a rank out of [0, W): no hit
    rank_of = torch.div(ids, num_local, rounding_mode="floor")
    ranks = torch.arange(world, device=device, dtype=torch.int32).view(world, 1, 1)
    hit = rank_of.unsqueeze(0) == ranks  # [W, T, k]
    needed = hit.any(2)  # [W, T]
    # 1 + the row of (w, t) in the sent buffer (w's block starts at w * capacity); 0: none
    place = torch.cumsum(needed, 1).add_(ranks.view(world, 1) * capacity).mul_(needed)
    slots = place.t().to(torch.int32)
    place = place.view(-1)
    # pairs with no row write place 0, which is not sent
    send_tokens = torch.zeros(world * capacity + 1, device=device, dtype=torch.int32)
    token_ids = torch.arange(tokens, device=device, dtype=torch.int32)
    send_tokens.index_copy_(0, place, token_ids.repeat(world))
    meta = torch.full(
        (world * capacity + 1, top_k + 1), num_local, device=device, dtype=torch.int32
    )
    local_ids = torch.where(hit, ids.unsqueeze(0) - ranks * num_local, num_local)
    meta[:, :top_k].index_copy_(0, place, local_ids.view(world * tokens, top_k))
    meta[:, top_k] = flag
    splits = [capacity] * world
    p = TokenPlan(send_tokens[1:], meta[1:, :top_k], slots, rank_of, splits, splits, None)
    return p, meta[1:]


def fixed_exchange_rows(num_experts: int, world: int, top_k: int) -> float:
    """The rows a fixed-size exchange sends per row an exact one sends, at uniform
    routing (``k`` distinct experts of ``E``, ``E / W`` per rank): ``1 / P(a token has
    any expert on a given rank)``. Qwen3-30B-A3B (128 experts, top-8) at W = 4: 1.11;
    Mixtral (8, top-2) at W = 4: 2.15."""
    local = num_experts // world
    miss = 1.0
    for j in range(top_k):  # P(none of the k draws lands on the rank's experts)
        miss *= max(num_experts - local - j, 0) / (num_experts - j)
    return 1.0 / (1.0 - miss)


#: Fixed-size calls between one call's exchange and the host reading its routing flags:
#: the host may run this many calls (layers) ahead of the GPU before the check waits.
ROUTING_CHECK_LAG = 8


class _RoutingCheck:
    """The out-of-range flags of fixed-size exchanges, read by the host
    :data:`ROUTING_CHECK_LAG` calls later (reading them in the call would be the host
    sync that mode exists to avoid): per process group, the flags of its last calls,
    copied to host memory by the GPU in each call's stream order. Every rank of the
    group receives every rank's flag and counts the same calls, so every rank raises
    the same error at the same call."""

    def __init__(self) -> None:
        self.pending: Dict[Any, Deque[Tuple[Any, Tensor, int, int]]] = {}

    def record(self, flags: Tensor, group: Any, world: int, num_local: int) -> None:
        """Keep ``flags`` (``[W]`` on the device) for :meth:`check`; not while a CUDA
        graph is captured or torch.compile traces (nothing would read them later)."""
        if torch.compiler.is_compiling() or _capturing():
            return
        cuda = flags.is_cuda
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=cuda)
        host.copy_(flags, non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        queue = self.pending.setdefault(_group_key(group), collections.deque())
        queue.append((done, host, world, num_local))

    def check(self, group: Any, keep: int = 0) -> None:
        """Raise :func:`_raise_on_bad_ids`'s error for the recorded calls of ``group``
        but the last ``keep``, oldest first, if any rank's ids were out of range (waits
        for the GPU to pass those calls' exchanges); not while torch.compile traces or a
        CUDA graph is captured (no waiting there)."""
        if torch.compiler.is_compiling() or _capturing():
            return
        queue = self.pending.get(_group_key(group))
        while queue and len(queue) > keep:
            done, host, world, num_local = queue.popleft()
            if done is not None:
                done.synchronize()
            _raise_on_bad_ids(host.tolist(), world, num_local, " (an earlier call's)")


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _group_key(group: Any) -> Any:
    return dist.group.WORLD if group is None else group


routing_check = _RoutingCheck()


def fixed_block(
    x: Tensor,
    expert_ids: Tensor,
    weights: Optional[Tensor],
    experts: Tuple[Tensor, Optional[Tensor], Tensor],
    group: Any,
    capacity: int,
    chunks: int,
) -> Tensor:
    """:func:`groupmm.parallel.expert_parallel_block` with fixed sizes, on checked
    arguments (``experts``: gate or ``[gate | up]``, up or None, ``w_out``).

    With ``chunks > 1`` the tokens go in ``chunks`` slices of at most ``ceil(capacity /
    chunks)`` (the same bound on every rank), issued so that each slice's exchanges can
    run beside another slice's experts: every dispatch first, then each slice's experts
    and its return. On CUDA the exchanges (and their autograd backward, which runs on
    the stream of its forward) go on a second stream, ordered against the compute stream
    by one event per hand-over; elsewhere the same slices run in turn."""
    tokens = x.shape[0]
    # the same slices on every rank (a rank's slices may hold no tokens)
    cap = -(-capacity // chunks)
    bounds = [tokens * i // chunks for i in range(chunks + 1)]
    compute = torch.cuda.current_stream(x.device) if x.is_cuda and chunks > 1 else None
    comm = _comm_stream(x.device) if compute is not None else None
    world = dist.get_world_size(group)
    num_local = experts[0].shape[0]
    top_k = expert_ids.shape[1]
    sent = []
    for lo, hi in zip(bounds, bounds[1:]):
        w_c = None if weights is None else weights[lo:hi]
        p, meta = plan_fixed(expert_ids[lo:hi], num_local, cap, group)
        with _on(comm, compute):
            rows, row_weights = _Send.apply(x[lo:hi], w_c, p, num_local, group)
            recv = _exchange_rows(meta, p.out_splits, p.in_splits, group, False)
            ready = _event(comm)
        sent.append((p, rows, row_weights, recv, ready))
    outs = []
    for p, rows, row_weights, recv, ready in sent:
        if ready is not None:
            assert compute is not None
            compute.wait_event(ready)
            for t in (rows, row_weights, recv):
                if t is not None:
                    t.record_stream(compute)
        routing_check.record(recv[::cap, top_k], group, world, num_local)
        r = routes(recv[:, :top_k], num_local, placeholders=True, index_dtype=torch.int32)
        y = _block(rows, experts[0], experts[2], r.offs, r.src, r.inverse, row_weights, experts[1])
        with _on(comm, compute):
            out = _Return.apply(y, p, group)
            back = _event(comm)
        if back is not None:
            assert compute is not None
            compute.wait_event(back)
            out.record_stream(compute)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


_COMM_STREAMS: Dict[int, Any] = {}


def _comm_stream(device: torch.device) -> Any:
    """The second stream of ``device`` that pipelined exchanges run on (one per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COMM_STREAMS:
        _COMM_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COMM_STREAMS[index]


class _on:
    """``with _on(comm, compute)``: the block runs on ``comm`` after everything queued on
    ``compute`` so far (nothing happens when ``comm`` is None)."""

    def __init__(self, comm: Any, compute: Any) -> None:
        self.comm, self.compute = comm, compute
        self.ctx: Any = None

    def __enter__(self) -> None:
        if self.comm is not None:
            self.comm.wait_stream(self.compute)
            self.ctx = torch.cuda.stream(self.comm)
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _event(stream: Any) -> Any:
    """An event recorded on ``stream`` now (None without one)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
