"""Fixed-size exchanges of expert parallelism (:func:`groupmm.parallel.
expert_parallel_block` with ``capacity``): the plan that sends ``capacity`` rows to every
rank with no host sync (:func:`plan_fixed`), what it costs in rows
(:func:`fixed_exchange_rows`), and the routing check that the host reads a few calls
later (:data:`routing_check`). The rows travel through ``groupmm._exchange``'s autograd
functions, as with exact sizes.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._exchange import TokenPlan, _raise_on_bad_ids


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
