#!/usr/bin/env python
"""Soak test: many forward+backward calls on small MoE shapes, checking that process
memory (RSS, from /proc/self/statm) and CUDA memory (torch.cuda.memory_allocated) reach
a steady state and stay there.

    python tests/programs/soak.py --calls 100000 --device cpu
    python tests/programs/soak.py --calls 1000000 --device cuda --json soak.json

Each call is one forward and one backward of a rotating workload: the packed forms
([T,K]x[G,K,N] with empty experts and a tail, [M,T]x[T,N], [G,M,K]x[K,N], batched), the
list form, ``out=`` calls, numpy calls (cpu), 16-bit inputs with ``out_dtype`` and a
failing call (a bad ``offs``: error paths must not leak either). After warm-up (10% of
the calls) RSS may grow by at most ``--rss-growth-mib`` (default 8 MiB) and CUDA
allocated memory by at most ``--cuda-growth-mib`` (default 1 MiB) up to the end.
Exit status 0 and a final ``PASS`` line when it holds, 1 and ``FAIL`` otherwise.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import groupmm
import numpy as np
import torch

MIB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def make_workloads(device: str):
    gen = torch.Generator().manual_seed(0)
    i32 = torch.int32

    def rnd(*shape, dtype=torch.float32, grad=True):
        t = torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)
        return t.requires_grad_(grad)

    T, K, N, E = 24, 8, 12, 4
    offs = torch.tensor([5, 5, 14, 20], dtype=i32, device=device)  # empty expert + tail
    x, w = rnd(T, K), rnd(E, K, N)
    wt = rnd(E, N, K)  # nn.Linear layout, used transposed
    xt, dy = rnd(K, T), rnd(T, N)
    a3, bn = rnd(E, 6, K), rnd(K, 20)
    a_b, b_b = rnd(E, 6, K), rnd(E, K, 5)
    As = [rnd(m, k) for m, k in ((3, 4), (0, 5), (6, 0), (2, 7))]
    Bs = [rnd(k, n) for k, n in ((4, 5), (5, 3), (0, 2), (7, 7))]
    xh, wh = rnd(T, K, dtype=torch.bfloat16), rnd(E, K, N, dtype=torch.bfloat16)
    out = torch.empty(T, N, device=device)
    bad_offs = torch.tensor([5, 3, 14, 20], dtype=i32, device=device)
    x_np, w_np, offs_np = x.detach().cpu().numpy(), w.detach().cpu().numpy(), offs.cpu().numpy()
    gmm = groupmm.grouped_mm

    def packed_rows():
        gmm(x, w, offs=offs).sum().backward()

    def packed_rows_transposed():
        y = gmm(x, wt.transpose(-2, -1), offs=offs)
        y.backward(torch.ones_like(y))

    def packed_reduction():
        gmm(xt, dy, offs=offs).square().sum().backward()

    def packed_columns():
        gmm(a3, bn, offs=offs).sum().backward()

    def batched():
        gmm(a_b, b_b).sum().backward()

    def list_form():
        sum(o.sum() for o in gmm(As, Bs)).backward()

    def bf16_out_f32():
        gmm(xh, wh, offs=offs, out_dtype=torch.float32).sum().backward()

    def out_and_error():
        with torch.no_grad():
            gmm(x, w, offs=offs, out=out)
        try:
            gmm(x, w, offs=bad_offs)
            if device == "cuda":  # CUDA reports bad offs asynchronously, at the next call
                torch.cuda.synchronize()
                gmm(x, w, offs=offs)
        except ValueError:
            pass
        else:  # pragma: no cover
            raise AssertionError("bad offs were accepted")

    def numpy_call():
        gmm(x_np, w_np, offs=offs_np)
        gmm([x_np[:3]], [w_np[0]])

    loads = [
        packed_rows,
        packed_rows_transposed,
        packed_reduction,
        packed_columns,
        batched,
        list_form,
        bf16_out_f32,
        out_and_error,
    ]
    if device == "cpu":
        loads.append(numpy_call)
    leaves = [x, w, wt, xt, dy, a3, bn, a_b, b_b, *As, *Bs, xh, wh]
    return loads, leaves


def run(
    calls: int, device: str, samples: int = 40, warmup_frac: float = 0.1, leak: int = 0
) -> dict:
    loads, leaves = make_workloads(device)
    if leak:  # self-test: a deliberate leak of `leak` bytes per call must be caught
        hoard = []
        loads = [lambda f=f: (f(), hoard.append(bytearray(leak))) for f in loads]
    cuda = device == "cuda"
    sample_every = max(1, calls // samples)
    warm_at = max(1, int(calls * warmup_frac))
    points = []  # (call index, rss, cuda allocated, gc objects)

    def sample(i):
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
        alloc = torch.cuda.memory_allocated() if cuda else 0
        points.append((i, rss_bytes(), alloc, len(gc.get_objects())))

    sample(0)
    t0 = time.perf_counter()
    for i in range(1, calls + 1):
        loads[i % len(loads)]()
        if i % 64 == 0:
            for t in leaves:
                t.grad = None
        if i == warm_at or i % sample_every == 0 or i == calls:
            sample(i)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    base = next(p for p in points if p[0] >= warm_at)
    after = [p for p in points if p[0] >= warm_at]
    rss_growth = max(p[1] for p in after) - base[1]
    cuda_growth = max(p[2] for p in after) - base[2]
    half = [p for p in points if p[0] >= calls // 2]
    slope = 0.0
    if len(half) >= 2 and half[-1][0] > half[0][0]:
        xs = np.array([p[0] for p in half], dtype=np.float64)
        ys = np.array([p[1] for p in half], dtype=np.float64)
        slope = float(np.polyfit(xs, ys, 1)[0])
    return {
        "device": device,
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed if elapsed else float("inf"),
        "rss_start_mib": points[0][1] / MIB,
        "rss_warm_mib": base[1] / MIB,
        "rss_end_mib": points[-1][1] / MIB,
        "rss_growth_mib": rss_growth / MIB,
        "rss_slope_bytes_per_call": slope,
        "cuda_alloc_warm_mib": base[2] / MIB,
        "cuda_alloc_end_mib": points[-1][2] / MIB,
        "cuda_alloc_growth_mib": cuda_growth / MIB,
        "cuda_reserved_mib": torch.cuda.memory_reserved() / MIB if cuda else 0.0,
        "gc_objects_warm": base[3],
        "gc_objects_end": points[-1][3],
        "samples": [list(p) for p in points],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rss-growth-mib", type=float, default=8.0)
    p.add_argument("--cuda-growth-mib", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--json", help="write the measurements here")
    p.add_argument(
        "--inject-leak-bytes", type=int, default=0, help="self-test: leak this much per call"
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("soak: no CUDA device", file=sys.stderr)
        return 2
    r = run(args.calls, args.device, args.samples, leak=args.inject_leak_bytes)
    ok = r["rss_growth_mib"] <= args.rss_growth_mib
    ok = ok and r["cuda_alloc_growth_mib"] <= args.cuda_growth_mib
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(r, ok=ok), f, indent=1)
    line = (
        f"soak: device={r['device']} calls={r['calls']} time={r['seconds']:.1f}s "
        f"({r['calls_per_s']:.0f} calls/s) rss warm={r['rss_warm_mib']:.1f}MiB "
        f"end={r['rss_end_mib']:.1f}MiB growth={r['rss_growth_mib']:.2f}MiB "
        f"(limit {args.rss_growth_mib}) slope={r['rss_slope_bytes_per_call']:.3f}B/call "
        f"gc_objects {r['gc_objects_warm']}->{r['gc_objects_end']}"
    )
    if args.device == "cuda":
        line += (
            f" cuda_alloc warm={r['cuda_alloc_warm_mib']:.2f}MiB "
            f"end={r['cuda_alloc_end_mib']:.2f}MiB growth={r['cuda_alloc_growth_mib']:.2f}MiB "
            f"(limit {args.cuda_growth_mib}) reserved={r['cuda_reserved_mib']:.1f}MiB"
        )
    print(line + (" PASS" if ok else " FAIL"), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
