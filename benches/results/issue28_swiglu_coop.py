# ruff: noqa: B023, E501  (the lambdas are timed within the iteration that made them)
# The SwiGLU up projection in the configuration GROUPMM_SM90_SWIGLU (co256 | pp128) names,
# one process each: "check TAG" compares swiglu_mm with a float32 reference on 24 cases and
# saves the outputs to /tmp/sw_TAG.pt (compared bitwise across processes); "time TAG CFGS"
# times it on gathered and on pre-gathered rows. Issue 28's h100_bf16_issue28_swiglu_coop.md.
import json
import math
import sys

import torch
from batch_timer import batch_ms, uniform_routes
from groupmm import _native

mode, tag = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
dev = "cuda"


def ref(x, w, offs, src, R):
    xs = x[src.long()] if src is not None else x
    out = torch.zeros(R, w.shape[-1], dtype=torch.float32, device=dev)
    lo = 0
    for g, hi in enumerate(offs.tolist()):
        if hi > lo:
            out[lo:hi] = xs[lo:hi].float() @ w[g].float()
        lo = hi
    F = w.shape[-1] // 2
    act = torch.nn.functional.silu(out[:, :F]) * out[:, F:]
    return out, act


if mode == "check":
    res = {}
    cases = []
    for T, K, F, E, kk in [
        (300, 64, 8, 3, 2),
        (517, 200, 200, 5, 3),
        (1000, 2048, 768, 16, 4),
        (64, 136, 1408, 4, 1),
        (2000, 512, 256, 8, 8),
        (3, 72, 40, 6, 2),
    ]:
        for kmaj in (False, True):
            for gath in (False, True):
                cases.append((T, K, F, E, kk, kmaj, gath))
    worst = 0.0
    for ci, (T, K, F, E, kk, kmaj, gath) in enumerate(cases):
        g = torch.Generator(device=dev).manual_seed(ci)
        x = torch.randn(T, K, device=dev, dtype=torch.bfloat16, generator=g)
        if kmaj:
            w = (
                torch.randn(E, 2 * F, K, device=dev, dtype=torch.bfloat16, generator=g)
                / math.sqrt(K)
            ).transpose(1, 2)
        else:
            w = torch.randn(E, K, 2 * F, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(
                K
            )
        R = T * kk
        counts = torch.randint(0, 3 * R // E + 1, (E,), generator=g, device=dev)
        counts[E // 2] = 0
        offs = counts.cumsum(0).clamp(max=R - 5 if R > 10 else R).to(torch.int32)
        src = (
            torch.randint(0, T, (R,), device=dev, dtype=torch.int32, generator=g) if gath else None
        )
        xin = x if gath else x[torch.randint(0, T, (R,), device=dev, generator=g)]
        pre, act = _native.swiglu_mm(xin, w, offs, src)
        rp, ra = ref(xin, w, offs, src, R)
        n = int(offs[-1])
        e1 = (
            ((pre[:n].float() - rp[:n]).abs().max() / (rp[:n].abs().max() + 1e-6)).item()
            if n
            else 0
        )
        e2 = (
            ((act[:n].float() - ra[:n]).abs().max() / (ra[:n].abs().max() + 1e-6)).item()
            if n
            else 0
        )
        z = (pre[n:].abs().max().item() if n < R else 0) + (
            act[n:].abs().max().item() if n < R else 0
        )
        worst = max(worst, e1, e2)
        res[ci] = (pre.cpu(), act.cpu())
        print(
            json.dumps(
                dict(
                    tag=tag,
                    case=ci,
                    T=T,
                    K=K,
                    F=F,
                    E=E,
                    k=kk,
                    kmaj=kmaj,
                    gath=gath,
                    err_pre=e1,
                    err_act=e2,
                    tail=z,
                    ok=e1 < 2e-2 and e2 < 2e-2 and z == 0,
                )
            ),
            flush=True,
        )
    torch.save(res, f"/tmp/sw_{tag}.pt")
    print(json.dumps(dict(tag=tag, worst=worst)))
else:
    CFG = {
        "qwen3": (16384, 8, 128, 2048, 768),
        "fine": (16384, 8, 128, 1536, 256),
        "k16": (16384, 16, 256, 1536, 512),
        "olmoe": (16384, 8, 64, 2048, 1024),
        "235b": (16384, 8, 128, 4096, 1536),
    }

    for name in sys.argv[3].split(","):
        T, k, E, D, F = CFG[name]
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16, generator=g)
        w_in = torch.randn(E, D, 2 * F, device=dev, dtype=torch.bfloat16, generator=g) / math.sqrt(
            D
        )
        src, offs = uniform_routes(T, k, E, g, dev)
        xs = x.index_select(0, src)
        tg = batch_ms(lambda: _native.swiglu_mm(x, w_in, offs, src))
        tp = batch_ms(lambda: _native.swiglu_mm(xs, w_in, offs, None))
        print(json.dumps(dict(tag=tag, cfg=name, gathered=tg, packed=tp)), flush=True)
