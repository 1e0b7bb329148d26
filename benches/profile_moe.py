"""Where a whole MoE layer's GPU time goes: torch.profiler over forward+backward steps of
bench_moe.py's layers (groupmm's MoELayer, its fused path, and the plain F.grouped_mm
layer), kernels grouped by name, per step.

    cd benches && python3 profile_moe.py [--config qwen3] [--tokens 4096] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_moe import CONFIGS, Plain, moe_forward, routing
from groupmm.moe import MoELayer
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="qwen3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args(argv)
    d, f, E, k = CONFIGS[args.config]
    torch.manual_seed(0)
    dev = torch.device("cuda")
    layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=torch.bfloat16)
    ids = routing(args.tokens, E, k, args.routing, torch.Generator().manual_seed(0)).to(dev)
    x = torch.randn(args.tokens, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)
    plain = Plain(layer)
    impls = (
        ("groupmm", lambda: moe_forward(layer, x, ids)),
        ("fused", lambda: moe_forward(layer, x, ids, fused=True)),
        ("plain", lambda: plain(x, ids)),
    )
    for name, fn in impls:

        def step(fn=fn):
            for p in layer.parameters():
                p.grad = None
            fn().backward(gy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0 and e.device_type.name == "CUDA":
                rows.append((t / args.steps / 1e3, e.count // args.steps, e.key))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        what = f"{args.config} T={args.tokens} {args.routing}"
        print(f"== {name}: {what}: {total:.3f} ms of kernels per step")
        for ms, n, key in rows[: args.top]:
            print(f"{ms:8.3f} ms {n:4d}x  {key[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
