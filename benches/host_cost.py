"""Host (CPU) cost per call of groupmm's pieces on a tiny packed problem, next to torch's.

    python3 benches/host_cost.py [--calls 3000]

Each figure is wall time per call over many calls issued without a sync (the GPU work
is tiny, so the host is the bottleneck): where groupmm's host time goes.
"""

import argparse
import time

import groupmm
import torch
from groupmm import _native


def per_call(fn, n):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    n = p.parse_args().calls
    dev = "cuda"
    E, K, N, T = 8, 128, 128, 256
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor([T // E] * E, device=dev).cumsum(0).to(torch.int32)
    gy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    f = getattr(torch.nn.functional, "grouped_mm", None)
    rows = [
        ("torch.empty([T,N]) on cuda", lambda: torch.empty(T, N, device=dev, dtype=x.dtype)),
        ("x.new_empty([T,N])", lambda: x.new_empty((T, N))),
        ("torch.mm", lambda: torch.mm(x, w[0])),
        ("_native.grouped_mm (Rust entry, no Python glue)", lambda: _native.grouped_mm(x, w, offs)),
        ("groupmm.grouped_mm, no grad", lambda: groupmm.grouped_mm(x, w, offs=offs)),
        (
            "groupmm.grouped_mm, inputs require grad (fwd only)",
            lambda: groupmm.grouped_mm(xg, wg, offs=offs),
        ),
        (
            "_native.grouped_mm_backward (both products)",
            lambda: _native.grouped_mm_backward(gy, x, w, offs),
        ),
        ("groupmm fwd+bwd", lambda: groupmm.grouped_mm(xg, wg, offs=offs).backward(gy)),
    ]
    if f is not None:
        rows += [
            ("F.grouped_mm, no grad", lambda: f(x, w, offs=offs)),
            ("F.grouped_mm fwd+bwd", lambda: f(xg, wg, offs=offs).backward(gy)),
        ]
    print(f"host µs per call ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    for name, fn in rows:
        print(f"{per_call(fn, n):8.1f}  {name}")


if __name__ == "__main__":
    main()
