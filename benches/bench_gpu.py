"""Grouped GEMMs: groupmm against F.grouped_mm, quack (when installed), a loop of torch.mm
and a dense torch.mm of the same FLOPs, with each row's roofline bound.

    python3 benches/bench_gpu.py [--shapes all|fine|decode|larger|legacy|NAME,...]
        [--routing uniform,zipf12] [--passes fwd,dX,dW,fwd+bwd] [--rounds 7] [--quick]
        [--no-quack] [--no-loop] [--isolated] [--budget-s S] [--json F] [--md F] [--png F]
    python3 benches/bench_gpu.py --dry-run [...]       # the rows; no GPU
    python3 benches/bench_gpu.py --from-json F.json [--md F] [--png F]   # render; no GPU

quack's configuration is chosen per row first (over --select-rounds rounds). Roofline:
max(FLOPs / R, bytes / B), R and B the dense-mm rate and copy bandwidth of the run.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from harness import configs as shapes
from harness.cli import (
    add_output_args,
    add_rr_args,
    budget_spent,
    check_lists,
    line_buffered_stdout,
    no_cuda,
    parser,
)
from harness.report import from_json, one_file, record, run_doc, skip, write_outputs, write_png
from harness.report.gpu import (
    class_summary,
    describe_env,
    format_row,
    make_row,
    print_table,
    render_md,
    render_png,
)
from harness.timing import round_robin, rr_settings
from peers.quack import load_quack, quack_candidates, quack_host_cost
from peers.torch import grouped_mm

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"
_QUACK_FORMS_SEEN = set()


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--shapes", default="all", help="names and groups: all, legacy, fine, ...")
    p.add_argument("--routing", default="uniform,zipf12", help="uniform, zipf12, skewed")
    p.add_argument("--passes", default="fwd,dX,dW", help="fwd, dX, dW, fwd+bwd")
    notes = {"rounds": "(default 7; quick 3)", "sample_ms": "(default 3; quick 2)"}
    add_rr_args(p, None, None, 3, None, notes=notes)
    p.add_argument("--select-rounds", type=int, help="quack's selection (default 3; quick 1)")
    p.add_argument("--isolated", action="store_true", help="one call per sample, host waits")
    p.add_argument("--no-quack", action="store_true", help="leave quack out")
    p.add_argument("--no-loop", action="store_true", help="leave the loop of torch.mm out")
    p.add_argument("--quick", action="store_true", help="T/8 (not decode), fewer rounds")
    add_output_args(p, budget="shape", png=True, merge=False)
    args = p.parse_args(argv)
    q = args.quick
    for k, full, quick in (("rounds", 7, 3), ("select_rounds", 3, 1), ("sample_ms", 3.0, 2.0)):
        if getattr(args, k) is None:
            setattr(args, k, quick if q else full)
    args.max_calls = args.max_calls or (20 if q else 50)
    if min(args.rounds, args.select_rounds, args.min_calls, args.max_calls) < 1:
        p.error("rounds and calls must be at least 1")
    check_lists(p, (args.routing, shapes.GEMM_ROUTINGS), (args.passes, shapes.GEMM_PASSES))
    return args


def nbytes_for(pname: str, E: int, K: int, N: int, T: int, es: int) -> int:
    """Each operand read once, the output written once."""
    b = {
        "fwd": es * (T * K + E * K * N + T * N),
        "dX": es * (T * N + E * K * N + T * K),
        "dW": es * (T * K + T * N + E * K * N),
    }
    return sum(b.values()) if pname == "fwd+bwd" else b[pname]


def pass_mult(pname: str) -> float:
    return 3.0 if pname == "fwd+bwd" else 1.0


def plan_rows(names, passes, routings, quick) -> list:
    return [
        (n, shapes.SPECS[n], shapes.effective_T(shapes.SPECS[n], quick), r, p)
        for n in names
        for r in routings
        for p in passes
    ]


def dry_run(plan, names, args) -> int:
    for name, s, T, routing, p in plan:
        print(
            f"{name:19} {shapes.row_class(s.E, T, s.decode):6} {routing:7} {p:7} E={s.E:<3} "
            f"K={s.K:<5} N={s.N:<5} T={T:<6} rows/expert {T / s.E:7.1f}  {s.model}, {s.proj}"
        )
    print(f"{len(plan)} rows over {len(names)} shapes")
    return 0


def ceilings(dtype, args) -> dict:
    """This GPU's dense matmul rate (FLOP/s) and copy bandwidth (bytes/s), round-robin."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    rr = {**rr_settings(args), "rounds": max(3, args.rounds), "calls": None, "warmup": 2}
    res, _ = round_robin({"mm": lambda: torch.mm(a, b), "copy": lambda: dst.copy_(src)}, **rr)
    out = {}
    for key, r, work in (
        ("dense_flops", res["mm"], 2.0 * 8192**3),
        ("copy_bytes_per_s", res["copy"], 2.0 * (1 << 30)),
    ):
        out[key] = work / (r["ms"] * 1e-3)
        out[key + "_range"] = [work / (r["max"] * 1e-3), work / (r["min"] * 1e-3)]
    return out


def run_shape(name, spec, T, routings, passes, dtype, args, ceil, torch_gmm, Q, on_row, dev="cuda"):
    """Every (routing, pass) row of one shape; ``on_row(row)`` as each finishes."""
    import groupmm

    E, K, N = spec.E, spec.K, spec.N
    torch.manual_seed(0)
    x = torch.randn(T, K, device=dev, dtype=dtype)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) / math.sqrt(K)
    dy = torch.randn(T, N, device=dev, dtype=dtype)
    wd = torch.randn(K, N, device=dev, dtype=dtype)
    wt = w.transpose(-2, -1)
    gmm, rows = groupmm.grouped_mm, []
    rr = {**rr_settings(args), "isolated": args.isolated}
    for routing in routings:
        offs = torch.tensor(shapes.counts_for(E, T, routing), device=dev).cumsum(0).int()
        cu = torch.cat([offs.new_zeros(1), offs])  # quack's E+1 boundaries
        bounds = [0, *offs.tolist()]

        def fb(f, offs=offs):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

            def run():
                xg.grad = wg.grad = None
                f(xg, wg, offs=offs).backward(dy)

            return run

        forms = {"fwd": (x, w, wd, "m", (T, N)), "dX": (dy, wt, wd.t(), "m", (T, K))}
        forms["dW"] = (x.t(), dy, dy, "k", (E, K, N))  # a, b, dense's b, quack's form

        def loop(a, b, shape, dw, bounds=bounds):  # a loop of torch.mm over the groups
            out = torch.empty(shape, device=dev, dtype=dtype)
            for g, (s, e) in enumerate(zip(bounds, bounds[1:])):
                if dw:
                    torch.mm(a[:, s:e], b[s:e], out=out[g])
                elif e > s:
                    torch.mm(a[s:e], b[g], out=out[s:e])
            return out

        for pname in passes:
            errors = {} if torch_gmm else {"torch": "no F.grouped_mm in this torch"}
            if pname == "fwd+bwd":
                impls = {"groupmm": fb(gmm), "torch": fb(torch_gmm) if torch_gmm else None}
                impls["dense"] = lambda: (
                    torch.mm(x, wd),
                    torch.mm(dy, wd.t()),
                    torch.mm(x.t(), dy),
                )
                errors["quack"] = "no autograd op"
            else:
                a, b, bd, kind, oshape = forms[pname]
                dw = len(oshape) == 3
                impls = {"groupmm": lambda a=a, b=b, o=offs: gmm(a, b, offs=o)}
                impls["torch"] = torch_gmm and (lambda a=a, b=b, o=offs: torch_gmm(a, b, offs=o))
                impls["loop"] = (
                    None if args.no_loop else (lambda a=a, b=b, s=oshape, dw=dw: loop(a, b, s, dw))
                )
                impls["dense"] = lambda a=a, bd=bd: torch.mm(a, bd)
            quack = None
            if Q and pname != "fwd+bwd":
                cands = quack_candidates(Q, a, b, kind, cu, oshape)
                if (pname, dtype) not in _QUACK_FORMS_SEEN:
                    _QUACK_FORMS_SEEN.add((pname, dtype))
                    print(f"   quack {pname}: first use, JIT-compiling {len(cands)} configurations")
                t0 = time.perf_counter()
                sel, _ = round_robin(cands, **{**rr, "rounds": args.select_rounds})
                ok = {k: v["ms"] for k, v in sel.items() if v.get("ms")}
                quack = {
                    "config": min(ok, key=ok.get) if ok else None,
                    "select": {k: v["ms"] or v.get("error") for k, v in sel.items()},
                    "select_s": time.perf_counter() - t0,
                }
                if ok:
                    impls["quack"] = cands[quack["config"]]
                else:
                    errors["quack"] = "; ".join(f"{k}: {v.get('error')}" for k, v in sel.items())
            elif pname != "fwd+bwd":
                errors["quack"] = "not measured"
            timed, meta = round_robin(impls, **rr)
            flops = pass_mult(pname) * 2.0 * T * K * N
            nb = nbytes_for(pname, E, K, N, T, x.element_size())
            bound_ms = max(flops / ceil["dense_flops"], nb / ceil["copy_bytes_per_s"]) * 1e3
            base = {"shape": name, "model": spec.model, "proj": spec.proj, "E": E, "K": K, "N": N}
            base.update(T=T, tokens=spec.tokens if T == spec.T else None, topk=spec.topk)
            base.update(rows_per_group=T / E, **{"class": shapes.row_class(E, T, spec.decode)})
            base.update(routing=routing, dtype=str(dtype).replace("torch.", ""), bytes=nb)
            base.update({"pass": pname, "lead_ms": meta["lead_ms"]})
            row = make_row(base, timed, bound_ms, flops, quack)
            for k, v in errors.items():
                row["errors"].setdefault(k, v)
            if quack:
                row["quack_select_s"] = quack["select_s"]
            rows.append(row)
            on_row(row)
    return rows


def host_cost(torch_gmm, n=2000):
    """Host µs per call of a small packed forward and forward+backward."""
    import groupmm
    from harness.timing import per_call_us

    E, K, N, T = 8, 128, 128, 256
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([T // E] * E, device="cuda").cumsum(0).int()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    fns = {
        "groupmm fwd": lambda: groupmm.grouped_mm(x, w, offs=offs),
        "torch.mm fwd": lambda: torch.mm(x, w[0]),
        "groupmm fwd+bwd": lambda: groupmm.grouped_mm(xg, wg, offs=offs).backward(gy),
    }
    if torch_gmm:
        fns["F.grouped_mm fwd"] = lambda: torch_gmm(x, w, offs=offs)
        fns["F.grouped_mm fwd+bwd"] = lambda: torch_gmm(xg, wg, offs=offs).backward(gy)
    return {k: per_call_us(f, n) for k, f in fns.items()}


def main(argv=None):
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        doc = from_json(args, one_file, print_table, render_md)
        write_png(render_png, doc, args.png)
        return 0
    names = shapes.select_shapes(args.shapes)
    routings, passes = args.routing.split(","), args.passes.split(",")
    plan = plan_rows(names, passes, routings, args.quick)
    if args.dry_run:
        return dry_run(plan, names, args)
    import groupmm

    if no_cuda():
        return 2
    t_start = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch_gmm = grouped_mm()
    Q, why = (None, "--no-quack") if args.no_quack else load_quack()
    doc = run_doc(2, argv)
    doc.update(
        quack=Q is not None,
        quack_version=Q["version"]["quack"] if Q else None,
        cutlass_dsl=Q["version"].get("cutlass") if Q else None,
        quack_why=why,
        groupmm=groupmm.build_info(),
        dtype=args.dtype,
        timer={**rr_settings(args), "select_rounds": args.select_rounds, "isolated": args.isolated},
        rows=[],
        skipped=[],
    )
    env = describe_env(doc)
    print("\n".join(env[:2]))
    doc["ceilings"] = ceilings(dtype, args)
    torch.cuda.empty_cache()
    print("\n".join(describe_env(doc)[2:]))

    def write(d):
        write_outputs(d, args.json, args.md, render_md)

    def on_row(row):
        doc["rows"].append(row)
        doc["elapsed_s"] = time.perf_counter() - t_start
        write(doc)
        print(f"[{len(doc['rows']):3}/{len(plan)} {doc['elapsed_s']:5.0f}s] " + format_row(row))
        for who, err in row["errors"].items():
            if who in ("groupmm", "torch") or (who == "quack" and row.get("quack_select")):
                print(f"      {who}: {err}")

    for name in names:
        if spent := budget_spent(args, t_start, ".0f"):
            skip(doc, name, spent, "shape", f"budget of {args.budget_s:.0f} s spent")
            continue
        s = shapes.SPECS[name]
        T = shapes.effective_T(s, args.quick)
        t0 = time.perf_counter()
        print(
            f"== {name}: E={s.E} K={s.K} N={s.N} T={T} ({T / s.E:.0f} rows per expert, "
            f"{shapes.row_class(s.E, T, s.decode)}; {s.model}, {s.proj})"
        )
        try:
            args_ = (name, s, T, routings, passes, dtype, args, doc["ceilings"], torch_gmm, Q)
            run_shape(*args_, on_row, DEV)
        except torch.cuda.OutOfMemoryError as e:
            skip(doc, name, f"out of memory: {str(e)[:80]}", "shape", "out of memory")
        torch.cuda.empty_cache()
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s")
        doc["summary"] = class_summary(doc["rows"])
        write(doc)
    doc["host_us"] = host_cost(torch_gmm)
    if Q:
        try:
            doc["host_us"]["quack fwd (default config)"] = quack_host_cost(Q)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"quack host cost: {type(e).__name__}: {str(e)[:80]}")
    record(doc, t_start, class_summary, write)
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    write_png(render_png, doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
