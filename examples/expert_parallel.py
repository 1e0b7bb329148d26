"""Expert parallelism for a groupmm MoE layer over torch.distributed.

Run with one process per rank::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/expert_parallel.py --backend gloo --check
    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/expert_parallel.py --backend nccl --check

The layer's ``num_experts`` experts are sharded over the ranks (rank ``r`` holds experts
``r*E/W ... (r+1)*E/W - 1``); the router is replicated. Either build the sharded layer
directly, ``MoELayer(..., ep_group=group)``, or shard a whole one (the same on every
rank) with ``layer.sharded(group)``. Its forward is collective: every rank calls it with
its own tokens; each token copy goes to its expert's rank and comes back
(``groupmm.parallel``: one host sync per forward for the exchange sizes, none in the
backward). Expert gradients stay on their rank; the router's gradient is each rank's
share, to be reduced like any replicated parameter's (DDP does that).

``--check`` compares with the whole layer in one process on rank 0 (outputs, input,
router and expert gradients), once with random routing and once with skewed routing that
leaves some experts, and all experts of the last rank, without tokens. It prints ``max
error <value>`` last and exits non-zero above the tolerance (1e-10 in float64, 1e-4 in
float32). Without ``--check`` it trains the layer for ``--steps`` steps on a regression
target. ``--unfused`` runs the unfused expert path (``MoELayer(fused=False)``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from groupmm.moe import MoELayer
from torch import nn


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """``t`` (the same shape on every rank) of every rank, concatenated along dim 0."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def whole_layer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, **kw):
    torch.manual_seed(args.seed)  # the same whole layer on every rank
    return MoELayer(
        args.d_model,
        args.d_ff,
        args.num_experts,
        args.top_k,
        fused=args.fused,
        device=device,
        dtype=dtype,
        **kw,
    )


def run_check(case: str, args: argparse.Namespace, device, dtype) -> float:
    """This rank's share of the sharded layer against the whole layer on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = whole_layer(args, device, dtype, aux_loss_coef=0.0)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn(args.tokens, args.d_model, generator=gen, dtype=torch.float64)
    g = torch.randn(args.tokens, args.d_model, generator=gen, dtype=torch.float64)
    if case == "skewed":  # positive tokens never pick experts with negative gate rows
        local = args.num_experts // world
        dead = [0, *range((world - 1) * local, args.num_experts)]
        with torch.no_grad():
            whole.router.gate.weight.abs_()
            whole.router.gate.weight[dead] *= -1
        x = x.abs()
    x, g = x.to(device, dtype).requires_grad_(), g.to(device, dtype)

    layer = whole.sharded()  # this rank's experts, the same router
    out = layer(x)
    (out * g).sum().backward()
    router_grad = layer.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad)  # what DDP does for a replicated parameter
    got = {
        "output": all_gather_cat(out.detach()),
        "input grad": all_gather_cat(x.grad),
        "router grad": router_grad,
        "w_in grad": all_gather_cat(layer.experts.w_in.grad),
        "w_out grad": all_gather_cat(layer.experts.w_out.grad),
    }
    # rows each rank's experts receive from each rank (for the printout)
    local = layer.experts.num_experts
    ids = layer.router(x.detach()).expert_ids
    sent = torch.bincount(ids.reshape(-1) // local, minlength=world)
    received = all_gather_cat(sent.view(1, -1)).t()  # [receiver, sender]
    all_x, all_g = all_gather_cat(x.detach()), all_gather_cat(g)
    if rank != 0:
        return 0.0
    xr = all_x.clone().requires_grad_()
    ref = whole(xr)
    (ref * all_g).sum().backward()
    want = {
        "output": ref.detach(),
        "input grad": xr.grad,
        "router grad": whole.router.gate.weight.grad,
        "w_in grad": whole.experts.w_in.grad,
        "w_out grad": whole.experts.w_out.grad,
    }
    errs = {k: (got[k] - want[k]).abs().max().item() for k in want}
    print(f"[{case}] rows received per rank (rows: receiver, cols: sender):")
    for r, row in enumerate(received.tolist()):
        print(f"    rank {r}: {row}")
    print(f"[{case}] " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    return max(errs.values())


def run_train(args: argparse.Namespace, device, dtype) -> None:
    """A few Adam steps of the sharded layer towards a fixed random teacher."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layer = whole_layer(args, device, dtype).sharded()
    teacher = nn.Linear(args.d_model, args.d_model, device=device, dtype=dtype)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for step in range(args.steps):
        x = torch.randn(args.tokens, args.d_model, generator=gen).to(device, dtype)
        with torch.no_grad():
            target = teacher(x)
        out, aux = layer(x, return_aux_loss=True)
        loss = (out - target).square().mean()
        opt.zero_grad()
        (loss + aux).backward()
        # the router is replicated: average its gradient over the ranks (DDP's job)
        grad = layer.router.gate.weight.grad
        dist.all_reduce(grad)
        grad /= world
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1:3d}  loss {total.item() / world:.5f}")
    if rank == 0:
        print(f"final loss {total.item() / world:.5f}")


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
    path = p.add_mutually_exclusive_group()
    path.add_argument("--fused", dest="fused", action="store_true", default=None, help="default")
    path.add_argument("--unfused", dest="fused", action="store_false", help="fused=False")
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
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = getattr(torch, args.dtype or ("float64" if args.check else "float32"))
    if args.num_experts % world:
        if rank == 0:
            print(f"--num-experts {args.num_experts} is not divisible by world size {world}")
        dist.destroy_process_group()
        return 2

    code = 0
    if args.check:
        tol = 1e-10 if dtype == torch.float64 else 1e-4
        err = max(run_check(case, args, device, dtype) for case in ("random", "skewed"))
        ok = torch.tensor([1 if err <= tol else 0], device=device)
        dist.broadcast(ok, src=0)
        code = 0 if ok.item() else 1
        if rank == 0:
            path_name = "unfused" if args.fused is False else "fused"
            print(
                f"world size {world}, backend {args.backend}, {dtype}, {path_name}, "
                f"tolerance {tol:g}: " + ("OK" if code == 0 else "MISMATCH")
            )
            print(f"max error {err:.3e}")
    else:
        run_train(args, device, dtype)
    sys.stdout.flush()
    dist.barrier()
    # no destroy_process_group(): gloo's teardown after collectives sometimes aborts the
    # process ("terminate called without an active exception"); the barrier above has
    # every rank past its last collective, and exiting releases the group
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
