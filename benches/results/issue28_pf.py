# ruff: noqa: B023  (the lambdas are timed within the iteration that made them)
# In-GEMM gathering vs gathering first (index_select + the TMA kernel), per op of the fused
# MoE block; each in-GEMM result is checked bitwise against the pre-gathered one. Prints one
# JSON line per (config, op). Issue 28's measurement (h100_bf16_issue28_gather_in_gemm.md);
# "pf" records GROUPMM_SM90_GATHER_PREFETCH, a knob of a trial build that did not land.
import json
import math
import os
import sys

import groupmm
import torch
from batch_timer import batch_ms, uniform_routes
from groupmm import _native

CFG = {
    "qwen3": (16384, 8, 128, 2048, 768),
    "fine": (16384, 8, 128, 1536, 256),
    "k16": (16384, 16, 256, 1536, 512),
    "olmoe": (16384, 8, 64, 2048, 1024),
}
pf = os.environ.get("GROUPMM_SM90_GATHER_PREFETCH", "0")
names = sys.argv[1].split(",")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20


def t(f, reps=reps):
    return batch_ms(f, reps)


for name in names:
    T, k, E, D, F = CFG[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w_in = torch.randn(E, D, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(D)
    w_out = torch.randn(E, F, D, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(F)
    src, offs = uniform_routes(T, k, E, g, "cuda")
    R = T * k
    d_out = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    d_pre = torch.randn(R, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
    act = torch.randn(R, F, device="cuda", dtype=torch.bfloat16, generator=g)
    pre = torch.randn(R, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = torch.rand(R, device="cuda", dtype=torch.float32, generator=g)
    xs, dys = x.index_select(0, src), d_out.index_select(0, src)
    ops = {
        "up": (
            lambda: _native.gather_mm(x, w_in, offs, src),
            lambda: groupmm.grouped_mm(xs, w_in, offs=offs),
            lambda: x.index_select(0, src),
        ),
        "up_swiglu": (
            lambda: _native.swiglu_mm(x, w_in, offs, src),
            lambda: _native.swiglu_mm(xs, w_in, offs, None),
            lambda: x.index_select(0, src),
        ),
        "dgated": (
            lambda: _native.dgated_mm(d_out, w_out, offs, pre, scale, src, None),
            lambda: _native.dgated_mm(dys, w_out, offs, pre, scale, None, None),
            lambda: d_out.index_select(0, src),
        ),
        "dw_in": (
            lambda: _native.gather_k_mm(x, d_pre, offs, src, False, False),
            lambda: groupmm.grouped_mm(xs.t(), d_pre, offs=offs),
            lambda: x.index_select(0, src),
        ),
        "dw_out": (
            lambda: _native.gather_k_mm(act, d_out, offs, src, True, False),
            lambda: groupmm.grouped_mm(act.t(), dys, offs=offs),
            lambda: d_out.index_select(0, src),
        ),
    }
    for op, (fin, fpre, fgat) in ops.items():
        a, b = fin(), fpre()
        if isinstance(a, tuple):
            same = all(torch.equal(u, v) for u, v in zip(a, b))
        else:
            same = torch.equal(a, b)
        tin, tpre, tg = t(fin), t(fpre), t(fgat)
        tin2 = t(fin)
        rec = dict(
            cfg=name,
            op=op,
            pf=pf,
            ingemm=min(tin, tin2),
            pregathered=tpre,
            gather=tg,
            ratio=(tpre + tg) / min(tin, tin2),
            vs_tma=tpre / min(tin, tin2),
            equal=same,
        )
        print(json.dumps(rec), flush=True)
