#!/usr/bin/env python
"""CPU benchmark: groupmm against a loop of ``torch.mm`` (and ``F.grouped_mm`` where this torch
has it on the CPU) on MoE-like shapes, float32 and bfloat16, forward and forward+backward.

    python benches/bench_cpu.py [--quick] [--json out.json]

Median of ``--runs`` runs; "ratio" is groupmm time / loop time (< 1: groupmm faster).
``OMP_WAIT_POLICY=PASSIVE`` keeps torch's threads from busy-waiting on a shared machine.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Dict, List, Optional

import groupmm
import torch
import torch.nn.functional as F
from harness.timing import median_ms

I32 = torch.int32


# --------------------------------------------------------------------------- shapes


def counts_uniform(tokens: int, experts: int) -> List[int]:
    base = [tokens // experts] * experts
    base[-1] += tokens - sum(base)
    return base


def counts_skewed(tokens: int, experts: int, gen: torch.Generator) -> List[int]:
    """A Zipf-like routing: a few hot experts, a quarter of the experts empty."""
    w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
    w = w[torch.randperm(experts, generator=gen)]
    w[torch.randperm(experts, generator=gen)[: experts // 4]] = 0.0
    c = torch.floor(w / w.sum() * tokens).long()
    c[int(torch.argmax(w))] += tokens - int(c.sum())
    return [int(v) for v in c]


class Problem:
    def __init__(self, name: str, kind: str, **kw) -> None:
        self.name, self.kind, self.kw = name, kind, kw

    def flops(self) -> float:
        if self.kind == "packed":
            k, n = self.kw["k"], self.kw["n"]
            return 2.0 * sum(self.kw["counts"]) * k * n
        return sum(2.0 * m * n * k for m, n, k in self.kw["dims"])


def problems(quick: bool) -> List[Problem]:
    gen = torch.Generator().manual_seed(0)
    s = 4 if quick else 1
    out = [
        Problem("E8 T2048 K512 N512", "packed", counts=counts_uniform(2048 // s, 8), k=512, n=512),
        Problem(
            "E64 T4096 K256 N256 uniform",
            "packed",
            counts=counts_uniform(4096 // s, 64),
            k=256,
            n=256,
        ),
        Problem(
            "E64 T4096 K256 N256 skewed",
            "packed",
            counts=counts_skewed(4096 // s, 64, gen),
            k=256,
            n=256,
        ),
    ]
    dims = [
        tuple(int(v) for v in torch.randint(32, 512 // s, (3,), generator=gen)) for _ in range(16)
    ]
    out.append(Problem("list 16 random (M,N,K in 32..511)", "list", dims=dims))
    return out


# --------------------------------------------------------------------------- impls


def make_inputs(p: Problem, dtype: torch.dtype, grad: bool):
    gen = torch.Generator().manual_seed(1)
    if p.kind == "packed":
        counts, k, n = p.kw["counts"], p.kw["k"], p.kw["n"]
        t = sum(counts)
        x = torch.randn(t, k, generator=gen).to(dtype).requires_grad_(grad)
        w = (torch.randn(len(counts), k, n, generator=gen) / k**0.5).to(dtype).requires_grad_(grad)
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(I32)
        go = torch.randn(t, n, generator=gen).to(dtype)
        return dict(x=x, w=w, offs=offs, counts=counts, go=go)
    dims = p.kw["dims"]
    As = [torch.randn(m, k, generator=gen).to(dtype).requires_grad_(grad) for m, n, k in dims]
    Bs = [torch.randn(k, n, generator=gen).to(dtype).requires_grad_(grad) for m, n, k in dims]
    gos = [torch.randn(m, n, generator=gen).to(dtype) for m, n, k in dims]
    return dict(As=As, Bs=Bs, gos=gos)


def impl_groupmm(p: Problem, d: dict, backward: bool) -> Callable[[], None]:
    if p.kind == "packed":
        x, w, offs, go = d["x"], d["w"], d["offs"], d["go"]

        def run():
            y = groupmm.grouped_mm(x, w, offs=offs)
            if backward:
                torch.autograd.grad(y, (x, w), go)

        return run
    As, Bs, gos = d["As"], d["Bs"], d["gos"]

    def run_list():
        ys = groupmm.grouped_mm(As, Bs)
        if backward:
            torch.autograd.grad(ys, [*As, *Bs], gos)

    return run_list


def impl_loop(p: Problem, d: dict, backward: bool) -> Callable[[], None]:
    """What one writes without a grouped GEMM: slice per expert, torch.mm, concatenate."""
    if p.kind == "packed":
        x, w, counts, go = d["x"], d["w"], d["counts"], d["go"]

        def run():
            parts = torch.split(x, counts)
            y = torch.cat([torch.mm(xi, w[i]) for i, xi in enumerate(parts)])
            if backward:
                torch.autograd.grad(y, (x, w), go)

        return run
    As, Bs, gos = d["As"], d["Bs"], d["gos"]

    def run_list():
        ys = [torch.mm(a, b) for a, b in zip(As, Bs)]
        if backward:
            torch.autograd.grad(ys, [*As, *Bs], gos)

    return run_list


def torch_grouped_mm() -> Optional[Callable]:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


def impl_torch_grouped(p: Problem, d: dict, backward: bool) -> Optional[Callable[[], None]]:
    fn = torch_grouped_mm()
    if fn is None or p.kind != "packed":
        return None
    x, w, offs, go = d["x"], d["w"], d["offs"], d["go"]

    def run():
        y = fn(x, w, offs=offs)
        if backward:
            torch.autograd.grad(y, (x, w), go)

    try:
        run()
    except RuntimeError:  # not supported on CPU for this dtype/layout
        return None
    return run


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    info = groupmm.build_info()
    tg = torch_grouped_mm()
    print(
        f"groupmm {info['version']} ({info['cpu_gemm']}, {info['cpu_threads']} rayon threads); "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads); "
        f"torch grouped_mm: {tg.__module__ + '.' + tg.__name__ if tg else 'n/a'}; "
        f"median of {args.runs} runs after {args.warmup} warm-up"
    )
    rows: List[Dict] = []
    hdr = (
        f"{'problem':36s} {'dtype':9s} {'pass':7s} {'groupmm ms':>10s} {'GFLOP/s':>8s} "
        f"{'loop ms':>9s} {'GFLOP/s':>8s} {'torch.gmm ms':>12s} {'GFLOP/s':>8s} {'ratio':>6s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for p in problems(args.quick):
        for dtype in dtypes:
            for backward in (False, True):
                d = make_inputs(p, dtype, backward)
                flops = p.flops() * (3 if backward else 1)
                t_g = median_ms(impl_groupmm(p, d, backward), args.runs, args.warmup, cuda=False)
                t_l = median_ms(impl_loop(p, d, backward), args.runs, args.warmup, cuda=False)
                tgf = impl_torch_grouped(p, d, backward)
                t_t = median_ms(tgf, args.runs, args.warmup, cuda=False) if tgf else None
                row = dict(
                    problem=p.name,
                    dtype=str(dtype).replace("torch.", ""),
                    pass_="fwd+bwd" if backward else "fwd",
                    groupmm_ms=t_g,
                    loop_ms=t_l,
                    torch_grouped_mm_ms=t_t,
                    gflop=flops / 1e9,
                    ratio=t_g / t_l,
                )
                rows.append(row)

                def gf(t, flops=flops):
                    return flops / (t * 1e-3) / 1e9

                tt = f"{t_t:12.2f} {gf(t_t):8.1f}" if t_t else f"{'n/a':>12s} {'':>8s}"
                print(
                    f"{p.name:36s} {row['dtype']:9s} {row['pass_']:7s} {t_g:10.2f} {gf(t_g):8.1f} "
                    f"{t_l:9.2f} {gf(t_l):8.1f} {tt} {row['ratio']:6.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(build_info=info, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
