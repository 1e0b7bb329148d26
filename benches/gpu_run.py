"""bench_gpu.py's measurements on the GPU: the ceilings of the roofline (:func:`ceilings`),
every row of one shape (:func:`run_shape`: the implementations of each pass, quack's
configuration chosen per row first, then all of them round-robin) and the host cost of a
small call (:func:`host_cost`).
"""

from __future__ import annotations

import math
import time

import torch
from gpu_report import make_row
from gpu_shapes import counts_for, nbytes_for, pass_mult, row_class
from harness.timing import round_robin, rr_settings
from peers.quack import quack_candidates

_QUACK_FORMS_SEEN = set()


def ceilings(dtype, args) -> dict:
    """Measured dense matmul rate (FLOP/s) and copy bandwidth (bytes/s) of this GPU, timed
    round-robin like the rows."""
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    res, _ = round_robin(
        {"mm": lambda: torch.mm(a, b), "copy": lambda: dst.copy_(src)},
        rounds=max(3, args.rounds),
        sample_ms=args.sample_ms,
        min_calls=args.min_calls,
        max_calls=args.max_calls,
    )
    mm, cp = res["mm"], res["copy"]
    flops, byts = 2.0 * 8192**3, 2.0 * (1 << 30)
    return {
        "dense_flops": flops / (mm["ms"] * 1e-3),
        "copy_bytes_per_s": byts / (cp["ms"] * 1e-3),
        "dense_flops_range": [flops / (mm["max"] * 1e-3), flops / (mm["min"] * 1e-3)],
        "copy_bytes_per_s_range": [byts / (cp["max"] * 1e-3), byts / (cp["min"] * 1e-3)],
    }


def run_shape(name, spec, T, routings, passes, dtype, args, ceil, torch_gmm, Q, on_row, dev="cuda"):
    """Every (routing, pass) row of one shape; calls on_row(row) as each finishes. (``dev``:
    the CPU tests run it on the CPU under a stand-in for CUDA's events.)"""
    import groupmm

    E, K, N = spec.E, spec.K, spec.N
    torch.manual_seed(0)
    x = torch.randn(T, K, device=dev, dtype=dtype)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) / math.sqrt(K)
    dy = torch.randn(T, N, device=dev, dtype=dtype)
    wd = torch.randn(K, N, device=dev, dtype=dtype)
    es = x.element_size()
    gmm = groupmm.grouped_mm
    rows = []
    for routing in routings:
        counts = counts_for(E, T, routing)
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        cu = torch.cat([offs.new_zeros(1), offs])  # quack's E+1 boundaries
        bounds = [0] + offs.tolist()

        def loop_fwd(bounds=bounds):
            out = torch.empty(T, N, device=dev, dtype=dtype)
            for g in range(E):
                s, e = bounds[g], bounds[g + 1]
                if e > s:
                    torch.mm(x[s:e], w[g], out=out[s:e])
            return out

        def loop_dx(bounds=bounds):
            out = torch.empty(T, K, device=dev, dtype=dtype)
            for g in range(E):
                s, e = bounds[g], bounds[g + 1]
                if e > s:
                    torch.mm(dy[s:e], w[g].t(), out=out[s:e])
            return out

        def loop_dw(bounds=bounds):
            out = torch.empty(E, K, N, device=dev, dtype=dtype)
            for g in range(E):
                s, e = bounds[g], bounds[g + 1]
                torch.mm(x[s:e].t(), dy[s:e], out=out[g])
            return out

        def fb(f, offs=offs):
            xg = x.clone().requires_grad_()
            wg = w.clone().requires_grad_()

            def run():
                xg.grad = None
                wg.grad = None
                f(xg, wg, offs=offs).backward(dy)

            return run

        def dense_fb():  # the three dense products of a forward+backward, same FLOPs
            torch.mm(x, wd)
            torch.mm(dy, wd.t())
            torch.mm(x.t(), dy)

        for pname in passes:
            if pname == "fwd":
                impls = {
                    "groupmm": lambda offs=offs: gmm(x, w, offs=offs),
                    "torch": (lambda offs=offs: torch_gmm(x, w, offs=offs)) if torch_gmm else None,
                    "loop": loop_fwd,
                    "dense": lambda: torch.mm(x, wd),
                }
                qargs = (x, w, "m", (T, N))
            elif pname == "dX":
                wt = w.transpose(-2, -1)
                impls = {
                    "groupmm": lambda offs=offs, wt=wt: gmm(dy, wt, offs=offs),
                    "torch": (lambda offs=offs, wt=wt: torch_gmm(dy, wt, offs=offs))
                    if torch_gmm
                    else None,
                    "loop": loop_dx,
                    "dense": lambda: torch.mm(dy, wd.t()),
                }
                qargs = (dy, wt, "m", (T, K))
            elif pname == "dW":
                impls = {
                    "groupmm": lambda offs=offs: gmm(x.t(), dy, offs=offs),
                    "torch": (lambda offs=offs: torch_gmm(x.t(), dy, offs=offs))
                    if torch_gmm
                    else None,
                    "loop": loop_dw,
                    "dense": lambda: torch.mm(x.t(), dy),
                }
                qargs = (x.t(), dy, "k", (E, K, N))
            else:  # fwd+bwd
                impls = {
                    "groupmm": fb(gmm),
                    "torch": fb(torch_gmm) if torch_gmm else None,
                    "dense": dense_fb,
                }
                qargs = None
            if args.no_loop:
                impls.pop("loop", None)
            rr = {**rr_settings(args), "lead": not args.no_lead, "isolated": args.isolated}
            quack = None
            errors = {}
            if torch_gmm is None:
                errors["torch"] = "no F.grouped_mm in this torch"
            if Q and qargs:
                a, b, kind, oshape = qargs
                cands = quack_candidates(Q, a, b, kind, cu, oshape)
                if (pname, dtype) not in _QUACK_FORMS_SEEN:
                    _QUACK_FORMS_SEEN.add((pname, dtype))
                    print(f"   quack {pname}: first use, JIT-compiling {len(cands)} configurations")
                t0 = time.perf_counter()
                sel, _ = round_robin(cands, **{**rr, "rounds": args.select_rounds})
                ok = {k: v["ms"] for k, v in sel.items() if v.get("ms")}
                quack = {
                    "config": min(ok, key=ok.get) if ok else None,
                    "select": {
                        k: v["ms"] if v.get("ms") else v.get("error") for k, v in sel.items()
                    },
                    "select_s": time.perf_counter() - t0,
                }
                if ok:
                    impls["quack"] = cands[quack["config"]]
                else:
                    errors["quack"] = "; ".join(f"{k}: {v.get('error')}" for k, v in sel.items())
            elif qargs:
                errors["quack"] = "not measured"
            else:
                errors["quack"] = "no autograd op"
            timed, meta = round_robin(impls, **rr)
            flops = pass_mult(pname) * 2.0 * T * K * N
            nb = nbytes_for(pname, E, K, N, T, es)
            bound_ms = max(flops / ceil["dense_flops"], nb / ceil["copy_bytes_per_s"]) * 1e3
            base = {
                "shape": name,
                "model": spec.model,
                "proj": spec.proj,
                "E": E,
                "K": K,
                "N": N,
                "T": T,
                "tokens": spec.tokens if T == spec.T else None,
                "topk": spec.topk,
                "rows_per_group": T / E,
                "class": row_class(E, T, spec.decode),
                "routing": routing,
                "pass": pname,
                "dtype": str(dtype).replace("torch.", ""),
                "bytes": nb,
                "lead_ms": meta["lead_ms"],
            }
            row = make_row(base, timed, bound_ms, flops, quack)
            for k, v in errors.items():
                row["errors"].setdefault(k, v)
            if quack:
                row["quack_select_s"] = quack["select_s"]
            rows.append(row)
            on_row(row)
    return rows


def host_cost(torch_gmm, n=2000):
    """Host (CPU) microseconds per call of a small packed forward and forward+backward."""
    import groupmm
    from host_cost import per_call_us

    dev = "cuda"
    E, K, N, T = 8, 128, 128, 256
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor([T // E] * E, device=dev).cumsum(0).to(torch.int32)
    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    gy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)

    def per_call(fn):
        return per_call_us(fn, n)

    res = {
        "groupmm fwd": per_call(lambda: groupmm.grouped_mm(x, w, offs=offs)),
        "torch.mm fwd": per_call(lambda: torch.mm(x, w[0])),
        "groupmm fwd+bwd": per_call(lambda: groupmm.grouped_mm(xg, wg, offs=offs).backward(gy)),
    }
    if torch_gmm:
        res["F.grouped_mm fwd"] = per_call(lambda: torch_gmm(x, w, offs=offs))
        res["F.grouped_mm fwd+bwd"] = per_call(lambda: torch_gmm(xg, wg, offs=offs).backward(gy))
    return res
