"""Expert parallelism for a groupmm MoE layer over torch.distributed.

Run with one process per rank::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/expert_parallel.py --backend gloo --check
    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/expert_parallel.py --backend nccl --check

The ``num_experts`` experts are sharded over the ``world_size`` ranks (rank ``r`` owns
experts ``r*E_local ... (r+1)*E_local - 1``); the router is replicated. One forward:

1. route the local tokens (top-k) and :func:`~groupmm.moe.permute` the token copies by
   global expert id, all on the device;
2. exchange per-expert token counts with ``all_to_all_single`` (equal splits), then move
   those counts to the host: ``all_to_all_single`` needs its split sizes as Python ints.
   This is the one host sync of expert parallelism and it is inherent to it (the size of
   the receive buffer depends on the routing of every other rank);
3. send the token copies to the ranks owning their experts with ``all_to_all_single``
   (uneven splits);
4. re-sort the received rows (ordered by source rank, then local expert) by local
   expert and run the local experts with ``grouped_mm`` (:class:`~groupmm.nn.GroupedExperts`);
5. send the results back with the reverse ``all_to_all_single`` and combine each token's
   top-k results with its gate weights (:func:`~groupmm.moe.unpermute`).

The backward runs the same exchanges in reverse (:class:`AllToAll`). Router gradients
are per-rank partial sums, to be all-reduced like any replicated parameter (DDP does
that); expert gradients are local to their owner.

``--check`` builds the same full layer in one process on rank 0 and compares outputs and
gradients (of the inputs, the router and every expert weight, gathered from all ranks),
once with random routing and once with skewed routing that leaves some experts, and all
experts of the last rank, without tokens. It prints ``max error <value>`` as the last line
and exits non-zero when that exceeds the tolerance (1e-10 in float64, 1e-4 in float32).
Without ``--check`` it trains the layer for ``--steps`` steps on a regression target and
prints the loss.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from groupmm.moe import MoELayer, TopKRouter, permute, unpermute
from groupmm.nn import GroupedExperts
from torch import nn


class AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` with uneven splits along dim 0.

    The backward is the reverse exchange: the gradient of the received rows goes back
    to the ranks that sent them (input and output splits swapped).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup | None,
    ) -> torch.Tensor:
        ctx.output_splits = output_splits  # type: ignore[attr-defined]
        ctx.input_splits = input_splits  # type: ignore[attr-defined]
        ctx.group = group  # type: ignore[attr-defined]
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        g = _all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group)  # type: ignore[attr-defined]
        return g, None, None, None


def _all_to_all(
    x: torch.Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class ExpertParallelMoE(nn.Module):
    """MoE layer whose experts are sharded over the ranks of ``group``.

    Args:
        d_model, d_ff, num_experts, top_k, activation: as for
            :class:`~groupmm.moe.MoELayer`; ``num_experts`` must be divisible by the
            group's size.
        group: process group (default: the world).
        device, dtype: factory arguments.
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        activation: str = "swiglu",
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the world size {self.world}"
            )
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.router = TopKRouter(d_model, num_experts, top_k, device=device, dtype=dtype)
        self.experts = GroupedExperts(
            self.local_experts, d_model, d_ff, activation, device=device, dtype=dtype
        )
        self.last_recv_counts: list[int] = []

    @classmethod
    def from_full(cls, full: MoELayer, group: dist.ProcessGroup | None = None) -> ExpertParallelMoE:
        """Shard a full :class:`~groupmm.moe.MoELayer` (same on every rank) onto this rank."""
        ge = full.experts
        if ge.b_in is not None:
            raise ValueError("full: expert biases are not sharded by this example")
        w = ge.w_in
        ep = cls(
            ge.d_model,
            ge.d_ff,
            ge.num_experts,
            full.top_k,
            ge.activation,
            group=group,
            device=w.device,
            dtype=w.dtype,
        )
        ep.router.load_state_dict(full.router.state_dict())
        ep.router.normalize = full.router.normalize
        lo, hi = ep.rank * ep.local_experts, (ep.rank + 1) * ep.local_experts
        with torch.no_grad():
            ep.experts.w_in.copy_(ge.w_in[lo:hi])
            ep.experts.w_out.copy_(ge.w_out[lo:hi])
        return ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's tokens ``[T, d_model]``; returns ``[T, d_model]``."""
        world, e_local = self.world, self.local_experts
        route = self.router(x)
        p = permute(x, route.expert_ids, self.num_experts)  # sorted by global expert

        # Token counts: rank r sends counts[r*E_local:(r+1)*E_local] to rank r.
        send_counts = p.counts  # int64 [E], on the device
        recv_counts = torch.empty_like(send_counts)  # [world * E_local]: (source, local e)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # Host sync, inherent to expert parallelism: the splits must be Python ints.
        input_splits = send_counts.view(world, e_local).sum(1).tolist()
        recv_matrix = recv_counts.view(world, e_local)
        output_splits = recv_matrix.sum(1).tolist()
        self.last_recv_counts = output_splits

        received = AllToAll.apply(p.tokens, output_splits, input_splits, self.group)
        # Received rows are ordered by (source rank, local expert): label each row with
        # its local expert and sort by it (stable, so source order is kept per expert).
        labels = torch.arange(e_local, device=x.device).repeat(world)
        local_ids = torch.repeat_interleave(labels, recv_counts, output_size=received.shape[0])
        q = permute(received, local_ids, e_local)
        y = self.experts(q.tokens, q.offs)
        y = unpermute(y, q.inverse)  # back to received order (top-1: a gather)

        back = AllToAll.apply(y, input_splits, output_splits, self.group)
        return unpermute(back, p.inverse, route.weights)


# --------------------------------------------------------------------------- helpers


def all_gather_cat(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate ``t`` (same shape on every rank) from all ranks along dim 0."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def make_inputs(
    case: str,
    rank: int,
    tokens: int,
    d_model: int,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)
    g = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)
    if case == "skewed":
        x = x.abs()  # positive inputs, so a negative gate row is never picked
    return x.to(device, dtype), g.to(device, dtype)


def skew_router(full: MoELayer, dead: Sequence[int]) -> None:
    """Make ``dead`` experts unpickable for positive inputs (negative gate rows)."""
    with torch.no_grad():
        w = full.router.gate.weight
        w.abs_()
        w[list(dead)] = -w[list(dead)]


def run_check(
    case: str,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> float:
    """Compare the expert-parallel layer with the full layer on rank 0; returns max error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # same full layer on every rank
    full = MoELayer(
        args.d_model,
        args.d_ff,
        args.num_experts,
        args.top_k,
        aux_loss_coef=0.0,
        device=device,
        dtype=dtype,
    )
    if case == "skewed":
        e_local = args.num_experts // world
        dead = [0] + list(range((world - 1) * e_local, args.num_experts))
        skew_router(full, dead)
    ep = ExpertParallelMoE.from_full(full)

    x, g = make_inputs(case, rank, args.tokens, args.d_model, args.seed, device, dtype)
    x.requires_grad_(True)
    out = ep(x)
    (out * g).sum().backward()

    router_grad = ep.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad, group=None)  # what DDP would do for a replicated param
    gathered = {
        "output": all_gather_cat(out.detach()),
        "input grad": all_gather_cat(x.grad),
        "w_in grad": all_gather_cat(ep.experts.w_in.grad),
        "w_out grad": all_gather_cat(ep.experts.w_out.grad),
    }
    all_x = all_gather_cat(x.detach())
    all_g = all_gather_cat(g)
    recv = torch.tensor(ep.last_recv_counts, device=device)
    all_recv = all_gather_cat(recv.view(1, -1))

    err = 0.0
    if rank == 0:
        xr = all_x.clone().requires_grad_(True)
        ref_out = full(xr)
        (ref_out * all_g).sum().backward()
        ref = {
            "output": ref_out.detach(),
            "input grad": xr.grad,
            "w_in grad": full.experts.w_in.grad,
            "w_out grad": full.experts.w_out.grad,
        }
        errs = {k: (gathered[k] - ref[k]).abs().max().item() for k in ref}
        errs["router grad"] = (router_grad - full.router.gate.weight.grad).abs().max().item()
        err = max(errs.values())
        print(f"[{case}] rows received per rank (rows: receiver, cols: sender):")
        for r, row in enumerate(all_recv.tolist()):
            print(f"    rank {r}: {row}")
        print(f"[{case}] " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return err


def run_train(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """A few SGD steps of the sharded layer towards a fixed random teacher."""
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    full = MoELayer(
        args.d_model, args.d_ff, args.num_experts, args.top_k, device=device, dtype=dtype
    )
    ep = ExpertParallelMoE.from_full(full)
    teacher = nn.Linear(args.d_model, args.d_model, device=device, dtype=dtype)
    opt = torch.optim.Adam(ep.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.d_model, generator=gen).to(device, dtype)
        with torch.no_grad():
            target = teacher(x)
        loss = (ep(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        # The router is replicated: average its gradient over ranks (DDP's job).
        grad = ep.router.gate.weight.grad
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"step {step + 1:3d}  loss {total.item() / dist.get_world_size():.5f}  "
                f"rows received by rank 0 {ep.last_recv_counts}"
            )
    if rank == 0:
        print(f"final loss {total.item() / dist.get_world_size():.5f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="groupmm expert parallelism over torch.distributed")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--check", action="store_true", help="compare with a single-process run")
    p.add_argument(
        "--dtype",
        choices=["float32", "float64"],
        default=None,
        help="default: float64 with --check, else float32",
    )
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=32)
    p.add_argument("--tokens", type=int, default=24, help="tokens per rank")
    p.add_argument("--steps", type=int, default=20, help="training steps without --check")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("float64" if args.check else "float32"))
    if args.num_experts % world:
        if rank == 0:
            print(f"--num-experts {args.num_experts} is not divisible by world size {world}")
        dist.destroy_process_group()
        return 2

    code = 0
    try:
        if args.check:
            tol = 1e-10 if dtype == torch.float64 else 1e-4
            err = max(run_check(case, args, device, dtype) for case in ("random", "skewed"))
            ok = torch.tensor([1 if err <= tol else 0], device=device)
            dist.broadcast(ok, src=0)
            code = 0 if ok.item() else 1
            if rank == 0:
                print(
                    f"world size {world}, backend {args.backend}, {dtype}, tolerance {tol:g}: "
                    + ("OK" if code == 0 else "MISMATCH")
                )
                print(f"max error {err:.3e}")
        else:
            run_train(args, device, dtype)
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
