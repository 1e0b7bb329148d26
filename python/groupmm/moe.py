"""Mixture-of-Experts routing helpers and a complete MoE layer on :func:`groupmm.grouped_mm`.

The pipeline of one MoE feed-forward block::

    router = TopKRouter(d_model, num_experts, top_k)
    experts = GroupedExperts(num_experts, d_model, d_ff)

    r = router(x)                                           # weights, expert_ids [T, k]
    p = permute(x, r.expert_ids, num_experts, pad_to=None)  # expert-sorted rows + offs
    y = experts(p.tokens, p.offs)                           # grouped GEMMs
    out = unpermute(y, p.inverse, r.weights)                # weighted sum of the top-k

:class:`MoELayer` wraps exactly that.

Nothing here synchronises with the host: token counts, offsets and the permutation are
computed on the device with a stable sort, ``searchsorted`` and ``cumsum``; shapes depend
only on ``T``, ``top_k``, ``num_experts`` and ``pad_to``, never on the routing, so the
layer runs under ``torch.compile(fullgraph=True)`` and inside CUDA graphs.

The glue itself (routing, dispatch, combine, SwiGLU and their backwards) lives in
``groupmm._glue``, shared with ``groupmm.fused`` and the transformers integration; this
module holds the public functions and modules on top of it (the router's in
``groupmm._router``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from . import _checks as check
from ._glue import Combine, dispatch, routes
from ._router import RouterOutput, TopKRouter, load_balancing_loss
from .fused import expert_block
from .nn import GroupedExperts
from .parallel import Plan, dispatch_combine, expert_parallel_block

__all__ = [
    "MoELayer",
    "Permuted",
    "RouterOutput",
    "TopKRouter",
    "load_balancing_loss",
    "permute",
    "unpermute",
]


class Permuted(NamedTuple):
    """What :func:`permute` returns."""

    tokens: torch.Tensor
    """``[R, D]`` rows sorted by expert; ``R = T*k`` (no padding) or
    ``T*k + E*(pad_to-1)`` (padding); padding rows are zero."""
    offs: torch.Tensor
    """int32 ``[E]`` cumulative end row of each expert's group in ``tokens``."""
    inverse: torch.Tensor
    """int64 ``[T, k]``: row of ``tokens`` that holds assignment ``(t, j)``."""
    counts: torch.Tensor
    """int64 ``[E]`` number of assignments per expert (before padding)."""


def permute(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    pad_to: int | None = None,
) -> Permuted:
    """Sort token copies by expert for :func:`grouped_mm`, on the device, without host sync.

    Token ``t`` is copied once for each of its ``k`` experts. Copies are ordered by
    expert (stable, so within an expert by token, then by slot).

    How (all on ``tokens``' device, fixed output shapes): a stable sort of the flattened
    expert ids gives the order; ``searchsorted`` of the sorted ids against ``arange(E)``
    gives each expert's end row, i.e. ``offs``; no ``.item()``, ``.tolist()``,
    ``nonzero`` or ``bincount`` (``groupmm._glue.routes``).

    Args:
        tokens: ``[T, D]``.
        expert_ids: ``[T, k]`` (or ``[T]`` for ``k = 1``) integer expert ids in
            ``[0, num_experts)``. Ids outside that range are not checked (checking
            would need a host sync) and give wrong results.
        num_experts: ``E``.
        pad_to: if given, every group's length is rounded up to a multiple of it
            (e.g. 8, 16, 128) with zero rows, for kernels that prefer aligned groups.
            The output then has the static upper bound ``T*k + E*(pad_to-1)`` rows;
            rows past ``offs[-1]`` are zero too.

    Returns:
        :class:`Permuted` ``(tokens, offs, inverse, counts)``; pass ``inverse`` to
        :func:`unpermute`.
    """
    # routing runs torch ops, no native call: these are its only checks
    check.dims("tokens", tokens, 2, "[T, D]")
    check.tensor("expert_ids", expert_ids)
    check.positive_int("num_experts", num_experts)
    if pad_to is not None:
        check.positive_int("pad_to", pad_to)
    if expert_ids.dim() == 1:
        expert_ids = expert_ids.unsqueeze(1)
    num_tokens = tokens.shape[0]
    ok = expert_ids.dim() == 2 and expert_ids.shape[0] == num_tokens
    check.shape("expert_ids", expert_ids, ok, "[T={}, k] or [T]", num_tokens)
    check.integer("expert_ids", expert_ids)
    check.device("expert_ids", expert_ids, tokens.device, "tokens")
    r = routes(expert_ids, num_experts, pad_to, counts=True)
    counts = cast(torch.Tensor, r.counts)  # counts=True: never None
    return Permuted(dispatch(tokens, r), r.offs, r.inverse, counts)


def unpermute(
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    gate_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each token's ``k`` expert outputs and combine them.

    Args:
        expert_out: ``[R, D]`` rows in the order :func:`permute` produced.
        inverse: ``[T, k]`` from :func:`permute`.
        gate_weights: ``[T, k]`` weights; ``None`` sums the ``k`` outputs unweighted.

    Returns:
        ``[T, D]``: ``sum_j gate_weights[t, j] * expert_out[inverse[t, j]]``, in
        ``expert_out``'s dtype.
    """
    # before the row op: it reads inverse as int32 (converted first) and, under
    # torch.compile, runs as a fake that checks nothing
    check.dims("expert_out", expert_out, 2, "[R, D]")
    check.tensor("inverse", inverse)
    if inverse.dim() == 1:
        inverse = inverse.unsqueeze(1)
    check.shape("inverse", inverse, inverse.dim() == 2, "[T, k] or [T]")
    check.integer("inverse", inverse)
    check.device("inverse", inverse, expert_out.device, "expert_out")
    if gate_weights is not None:
        check.tensor("gate_weights", gate_weights)
        if gate_weights.dim() == 1:
            gate_weights = gate_weights.unsqueeze(1)
        check.same_shape("gate_weights", gate_weights, "inverse", inverse)
    return Combine.apply(expert_out, inverse, gate_weights)


class MoELayer(nn.Module):
    """A complete MoE feed-forward layer: router, permute, grouped experts, unpermute.

    ``forward(x)`` takes ``[..., d_model]`` and returns the same shape. The
    load-balancing loss of the last forward is kept in ``self.aux_loss`` (add it to the
    training loss); ``forward(x, return_aux_loss=True)`` returns ``(out, aux_loss)``
    instead, which is the form to use under ``torch.compile``.

    Args:
        d_model, d_ff, num_experts, top_k: sizes.
        activation: expert activation, see :class:`~groupmm.nn.GroupedExperts`.
        bias: per-expert biases.
        normalize: renormalise top-k weights, see :class:`TopKRouter`.
        aux_loss_coef: load-balancing loss scale (0 turns it off).
        pad_to: pad each expert group to a multiple of this (see :func:`permute`).
        ep_group: shard the experts over this ``torch.distributed`` process group
            (expert parallelism, :mod:`groupmm.parallel`): this rank holds experts
            ``rank*E/W ... (rank+1)*E/W - 1`` of ``E = num_experts`` (divisible by the
            group's size ``W``), the router is whole on every rank, and ``forward``
            (collective: every rank calls it, with its own tokens) sends each token copy
            to its expert's rank and the results back. The router's gradient is this
            rank's share: reduce it as for any replicated parameter (DDP, FSDP); the
            load-balancing loss is this rank's tokens' (average it like the task loss).
            Every rank must run the backward (it holds exchanges the others wait for).
            :meth:`sharded` makes such a layer from a whole one.
        ep_capacity: with ``ep_group`` and the fused path: the most tokens any rank
            passes to one ``forward``, the same number on every rank (e.g. a training
            batch's tokens per rank): fixed-size exchanges with no host sync
            (:func:`groupmm.parallel.expert_parallel_block`'s ``capacity``, where the
            cost in bytes and memory is told). None: exact sizes, one host sync per
            ``forward``.
        ep_chunks: with ``ep_capacity``: pipeline the tokens in this many slices, their
            exchanges on a second CUDA stream under the other slices' experts
            (:func:`groupmm.parallel.expert_parallel_block`'s ``chunks``; run the layer
            inside :func:`groupmm.sm_limit` so that the exchanges get SMs).
        fused: run the experts as :func:`groupmm.fused.expert_block`, one operation
            from the tokens to the combined output (gather, up projection and SwiGLU in
            one native call, on Hopper one kernel; down projection, router weights and
            combine; in the backward the "dgated" product, which applies dSwiGLU, the
            router weights and their gradient in one native call; no ``[T*k, d_model]``
            tensor kept for the backward): needs ``activation="swiglu"``,
            ``bias=False`` and no ``pad_to``. Same results to rounding, less activation
            memory, faster on every measured configuration (docs/performance.md,
            "Whole MoE layers"). ``None`` (default): fused whenever the layer allows it;
            ``False``: the unfused path (permute, :class:`~groupmm.nn.GroupedExperts`,
            unpermute).
        device, dtype: factory arguments.
    """

    aux_loss: torch.Tensor | None

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        activation: str = "swiglu",
        bias: bool = False,
        normalize: bool | None = None,
        aux_loss_coef: float = 0.01,
        pad_to: int | None = None,
        fused: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        ep_group: Any = None,
        ep_capacity: int | None = None,
        ep_chunks: int = 1,
    ) -> None:
        super().__init__()
        # constructor arguments: nothing native sees them
        if pad_to is not None:
            check.positive_int("pad_to", pad_to)
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused: expected a bool or None, found {fused!r}")
        fusable = activation == "swiglu" and not bias and pad_to in (None, 1)
        if fused is None:
            fused = fusable
        if fused and not fusable:
            raise ValueError(
                "fused: needs activation='swiglu', bias=False and pad_to=None, found "
                f"activation={activation!r}, bias={bias}, pad_to={pad_to}"
            )
        check.positive_int("num_experts", num_experts)
        local = num_experts
        if ep_group is not None:
            world = dist.get_world_size(ep_group)
            if world < 1:  # torch answers -1 on a rank outside the group
                raise ValueError("ep_group: expected a process group this rank belongs to")
            if num_experts % world:
                raise ValueError(
                    f"num_experts: expected a multiple of the ep_group's size {world}, "
                    f"found {num_experts}"
                )
            local = num_experts // world
        if ep_capacity is not None:
            check.positive_int("ep_capacity", ep_capacity)
            if ep_group is None or not fused:
                raise ValueError(
                    "ep_capacity: expected with ep_group and the fused path, found "
                    f"ep_group={ep_group!r}, fused={fused}"
                )
        check.positive_int("ep_chunks", ep_chunks)
        if ep_chunks > 1 and ep_capacity is None:
            raise ValueError(f"ep_chunks: expected 1 without ep_capacity, found {ep_chunks}")
        self.ep_group = ep_group
        self.ep_capacity = ep_capacity
        self.ep_chunks = ep_chunks
        self.pad_to = pad_to
        self.fused = fused
        self.router = TopKRouter(
            d_model,
            num_experts,
            top_k,
            normalize,
            aux_loss_coef,
            device=device,
            dtype=dtype,
        )
        self.experts = GroupedExperts(
            local, d_model, d_ff, activation, bias, device=device, dtype=dtype
        )
        self.aux_loss = None

    @property
    def num_experts(self) -> int:
        """``E``, all experts (with ``ep_group``, this rank holds ``E / W`` of them)."""
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(
        self, x: torch.Tensor, return_aux_loss: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Apply the layer to ``x`` of shape ``[..., d_model]``."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        route = self.router(flat)
        if self.ep_group is not None:
            out = self._sharded_forward(flat, route).view(shape)
        elif self.fused:
            r = routes(route.expert_ids, self.num_experts)
            ex = self.experts
            args = (flat, ex.w_in, ex.w_out, r.offs, r.src, r.inverse, route.weights)
            out = expert_block(*args).view(shape)
        else:
            p = permute(flat, route.expert_ids, self.num_experts, self.pad_to)
            y = self.experts(p.tokens, p.offs)
            out = unpermute(y, p.inverse, route.weights).view(shape)
        if return_aux_loss:
            return out, route.aux_loss
        self.aux_loss = route.aux_loss
        return out

    def _sharded_forward(self, flat: torch.Tensor, route: RouterOutput) -> torch.Tensor:
        ex = self.experts
        if self.fused:
            args = (flat, route.expert_ids, route.weights, ex.w_in, ex.w_out, self.ep_group)
            return expert_parallel_block(*args, capacity=self.ep_capacity, chunks=self.ep_chunks)

        def local(received: torch.Tensor, p: Plan) -> torch.Tensor:
            q = routes(p.local_ids, ex.num_experts, self.pad_to)
            y = ex(dispatch(received, q), q.offs)
            return Combine.apply(y, q.inverse, None)  # back in received order

        ids, weights = route.expert_ids, route.weights
        return dispatch_combine(flat, ids, weights, ex.num_experts, local, self.ep_group)

    def sharded(self, ep_group: Any = None, capacity: int | None = None) -> MoELayer:
        """A copy of this whole layer with its experts sharded over ``ep_group`` (the
        world by default): the same router, and this rank's ``E / W`` experts' weights;
        ``capacity``: its ``ep_capacity``. Collective only in that every rank builds its
        own; call it with the same whole layer on every rank."""
        if self.ep_group is not None:
            raise ValueError("ep_group: this layer's experts are sharded already")
        ex = self.experts
        w = ex.w_in
        layer = MoELayer(
            ex.d_model,
            ex.d_ff,
            self.num_experts,
            self.top_k,
            ex.activation,
            ex.b_in is not None,
            self.router.normalize,
            self.router.aux_loss_coef,
            self.pad_to,
            self.fused,
            device=w.device,
            dtype=w.dtype,
            ep_group=ep_group if ep_group is not None else dist.group.WORLD,
            ep_capacity=capacity,
        )
        layer.router.load_state_dict(self.router.state_dict())
        lo = dist.get_rank(ep_group) * layer.experts.num_experts
        hi = lo + layer.experts.num_experts
        mine = {k: v[lo:hi] for k, v in ex.state_dict().items()}
        layer.experts.load_state_dict(mine)
        return layer
