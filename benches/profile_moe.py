"""Where a whole MoE layer's step goes, kernel by kernel: torch.profiler over
forward+backward steps of bench_moe.py's layers (groupmm's fused ``MoELayer``, SonicMoE,
and optionally the unfused, torch-gmm and plain layers), each kernel put in a category
(gemm, rows, routing, elementwise, other), per config x tokens row of the layer benchmark.

    python3 benches/profile_moe.py [--configs qwen3|issue22|NAME,...] [--tokens 4096,16384]
        [--routing router|uniform|skewed] [--impls fused,sonicmoe,groupmm,torch-gmm,plain]
        [--steps 5] [--warmup 3] [--top 22] [--json out.json] [--md out.md]
    python3 benches/profile_moe.py --config qwen3 --tokens 4096    # the old single-row form
    python3 benches/profile_moe.py --dry-run [...]                  # the rows; no GPU
    python3 benches/profile_moe.py --from-json out.json [--md out.md]  # render; no GPU

Each row profiles the same layer call bench_moe.py times (``bench_moe.build_impls``): the
same layer (``torch.manual_seed(0)``), x and output gradient (``torch.manual_seed(T)``),
routing (``router`` by default, as issue 22's table: each implementation routes with the
layer's router; ``uniform``/``skewed`` fix the experts, and SonicMoE, which always routes
with its own router, is then skipped and said so), and step (the gradients of x and of the
implementation's parameters set to None, forward, ``backward(gy)``). SonicMoE is optional
(``bench_moe.load_sonic``; absent: one line says why, the rest goes on), called with
``bench_moe.sonic_forward`` on the weights ``bench_moe.sonic_weights`` copies once per
config. Per implementation and shape, ``--warmup`` steps first (SonicMoE JIT-compiles and
autotunes on its first call per shape: minutes; their wall seconds are printed), then
``--steps`` steps under torch.profiler (CUDA activity only). Every figure is device time
from the profiler, per step (kernel time summed, so overlapping kernels would count twice;
the layer's step runs on one stream); no wall clock enters them.

Output: per row the top ``--top`` kernels (name truncated), then a line
``config T=.. impl: total ms = gemm + rows + routing + elementwise + other``. ``--json``:
every kernel of every row, names untruncated, with its category; ``--md``: one table with a
line per (config, tokens): fused's and SonicMoE's totals, each one's gemm / rows / rest
(rest = routing + elementwise + other), and the gap (fused - SonicMoE) split into its gemm
and non-gemm parts; then every row's categories. Both rewritten after every shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import bench_moe as bench  # benches/bench_moe.py, same folder
import groupmm
import torch
from groupmm.moe import MoELayer

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"

#: the categories, in the order of every sum and table
CATEGORIES = ("gemm", "rows", "routing", "elementwise", "other")

#: how a kernel gets its category: case-insensitive substrings of the full kernel name; the
#: first category (in this order) with a matching pattern wins, "other" when none does.
#: gemm comes first because GEMM kernel names carry words of the others (CuTe DSL names
#: spell out copy atoms, quack's gathered-A GEMMs "gather"); routing before rows because
#: top-k and the routing-metadata kernels gather and scatter indices (``gatherTopK``,
#: SonicMoE's ``_softmax_bwd_scatter_small_kernel``); rows before elementwise because
#: copies run as at::native elementwise kernels (``direct_copy_kernel_cuda``). Not a
#: pattern: "cutlass" (CuTe DSL names every kernel it compiles ``kernel_cutlass_...``,
#: SonicMoE's top-k included; CUTLASS GEMMs say "gemm" anyway).
#: SonicMoE's own kernels: GEMMs are quack's CuTe DSL ones
#: (``kernel_cutlass_kernel_quackgemm_actGemmGatedSm90...``, ``..._default_epiGemmDefaultSm90``,
#: ``..._dactGemmDGatedSm90``), routing a CuTe DSL ``TopK_Softmax`` and Triton
#: ``_compute_col_partial_sum_kernel`` / ``_bitmatrix_metadata_compute_stage{1,2}`` /
#: ``_softmax_bwd_scatter_small_kernel``, rows Triton ``token_gather_sum_kernel`` (the
#: weighted combine and the backward's sum over k). Adjust here after seeing real names
#: (the JSON keeps them whole, and records these patterns).
KERNEL_PATTERNS = (
    (
        "gemm",
        (
            "gemm",  # cuBLAS, CUTLASS GemmUniversal / GemmGrouped, torch grouped_gemm, quack
            "varlen",  # groupmm's sm90 grouped GEMMs (gmm::varlen::varlen_kernel)
            "grouped2x_kernel",  # groupmm's sm80 grouped GEMMs
            "build_packed_args",  # groupmm's grouped-GEMM arguments, built on the device
            "nvjet",  # cuBLAS(Lt) on Hopper
            "xmma",
            "wgmma",
            "mma",  # generous: any name that says MMA
            "splitkreduce",  # cuBLAS split-K reduction
            "gemv",
        ),
    ),
    (
        "routing",
        (
            "topk",  # at::native sbtopk/mbtopk, SonicMoE TopK_Softmax
            "softmax",
            "sort",  # cub radix sort, at::native sort
            "radix",
            "histogram",
            "bincount",
            "cumsum",
            "scan",  # cub DeviceScan
            "searchsorted",
            "bitmatrix",  # SonicMoE's routing metadata
            "col_partial_sum",
            "invert",  # groupmm: the inverse of the routing permutation
        ),
    ),
    (
        "rows",
        (
            "gather",  # gmm gather_sum, vectorized_gather_kernel, token_gather_sum_kernel
            "scatter",  # gmm scatter_rows, _scatter_gather_elementwise_kernel
            "index",  # index_select, indexing_backward_kernel, index_elementwise, index_put
            "catarray",  # torch.cat
            "copy",  # direct_copy_kernel_cuda (copies and casts)
            "memcpy",
            "row_dots",  # gmm: the router-weight gradient's per-row dots
            "_rows",
        ),
    ),
    (
        "elementwise",
        (
            "elementwise",  # at::native (vectorized_/unrolled_)elementwise_kernel
            "reduce",  # at::native reduce_kernel
            "fill",  # FillFunctor (gmm::zero_fill(GemmSet) is gemm: its name says so)
            "memset",
            "swiglu",  # gmm swiglu / swiglu_backward
            "silu",
            "at::native",
        ),
    ),
)


def classify(name: str) -> str:
    """The category of a kernel name (KERNEL_PATTERNS; "other" when nothing matches)."""
    low = name.lower()
    for cat, pats in KERNEL_PATTERNS:
        if any(p in low for p in pats):
            return cat
    return "other"


def kernel_table(events, steps: int) -> list:
    """``events``: ``(name, device_us, count)`` over ``steps`` steps (torch.profiler's
    key_averages); the kernels per step, longest first: ``{"name", "ms", "count",
    "category"}``. Events with no device time are left out."""
    if steps < 1:
        raise ValueError("steps must be at least 1")
    out = []
    for name, us, count in events:
        if us <= 0:
            continue
        n = count / steps
        out.append(
            {
                "name": name,
                "ms": us / 1e3 / steps,
                "count": int(n) if n == int(n) else n,
                "category": classify(name),
            }
        )
    out.sort(key=lambda r: (-r["ms"], r["name"]))
    return out


def by_category(kernels) -> dict:
    """ms per step of each category (every category present, in CATEGORIES order)."""
    sums = dict.fromkeys(CATEGORIES, 0.0)
    for kern in kernels:
        sums[kern["category"]] += kern["ms"]
    return sums


def make_row(config: str, tokens: int, impl: str, kernels, **extra) -> dict:
    """One profiled row: its kernels, their total and the per-category totals."""
    row = {"config": config, "tokens": tokens, "impl": impl}
    row["total_ms"] = sum(kern["ms"] for kern in kernels)
    row["by_category"] = by_category(kernels)
    row.update(extra)
    row["kernels"] = list(kernels)
    return row


def summary_line(row: dict) -> str:
    """``config T=.. impl: total ms = a gemm + b rows + c routing + d elementwise + e other``"""
    cats = " + ".join(f"{row['by_category'][c]:.3f} {c}" for c in CATEGORIES)
    return f"{row['config']} T={row['tokens']} {row['impl']}: {row['total_ms']:.3f} ms = {cats}"


def kernel_block(row: dict, top: int, width: int = 110) -> list:
    """The text block of one row: a header, then its ``top`` longest kernels (names cut to
    ``width`` characters) and how many were left out."""
    what = f"{row['config']} T={row['tokens']} {row.get('routing', '')}".rstrip()
    lines = [f"== {row['impl']}: {what}: {row['total_ms']:.3f} ms of kernels per step"]
    ks = row["kernels"]
    for kern in ks[:top]:
        n = kern["count"]
        cnt = f"{n:4d}" if isinstance(n, int) else f"{n:4.1f}"
        lines.append(f"{kern['ms']:8.3f} ms {cnt}x  {kern['category']:11} {kern['name'][:width]}")
    if len(ks) > top:
        rest = sum(kern["ms"] for kern in ks[top:])
        lines.append(f"{rest:8.3f} ms in {len(ks) - top} more kernels")
    return lines


def pairs(rows) -> list:
    """``(config, tokens, fused row or None, SonicMoE row or None)`` per (config, tokens),
    in the order the rows ran."""
    seen = {}
    for r in rows:
        key = (r["config"], r["tokens"])
        seen.setdefault(key, {})[r["impl"]] = r
    return [(c, t, d.get("fused"), d.get("sonicmoe")) for (c, t), d in seen.items()]


def split3(row) -> tuple:
    """``(gemm, rows, rest)`` ms of a row, rest = routing + elementwise + other."""
    c = row["by_category"]
    return c["gemm"], c["rows"], row["total_ms"] - c["gemm"] - c["rows"]


def gap(fused, sonic):
    """``(total, gemm, non-gemm)``: fused's ms minus SonicMoE's (None when either is
    missing); total = gemm + non-gemm."""
    if fused is None or sonic is None:
        return None
    total = fused["total_ms"] - sonic["total_ms"]
    g = fused["by_category"]["gemm"] - sonic["by_category"]["gemm"]
    return total, g, total - g


def gap_line(config, tokens, fused, sonic):
    gp = gap(fused, sonic)
    if gp is None:
        return None
    return (
        f"{config} T={tokens} gap fused - SonicMoE: {gp[0]:+.3f} ms "
        f"(gemm {gp[1]:+.3f}, non-gemm {gp[2]:+.3f})"
    )


def _f(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def render_md(doc: dict) -> str:
    """The markdown of a result document: where the fused step and SonicMoE's go, per
    (config, tokens), then every row's categories."""
    rows = doc.get("rows", [])
    out = [
        "# Where the MoE layer's step goes (torch.profiler)",
        "",
        f"Device: {doc.get('device')}; torch {doc.get('torch')}; routing "
        f"{doc.get('routing')}; forward+backward, ms of kernels per step (device time, "
        f"mean of {doc.get('steps')} profiled steps after {doc.get('warmup')} warm-up steps).",
        "",
        f"Command: `python3 benches/profile_moe.py {' '.join(doc.get('command', []))}`",
        "",
    ]
    if doc.get("sonicmoe_why"):
        out += [f"SonicMoE not profiled: {doc['sonicmoe_why']}", ""]
    out += [
        "| config | T | fused ms | SonicMoE ms | fused gemm | fused rows | fused rest "
        "| SonicMoE gemm | SonicMoE rows | SonicMoE rest | gap ms (gemm, non-gemm) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for config, tokens, fz, sn in pairs(rows):
        fs = split3(fz) if fz else (None,) * 3
        ss = split3(sn) if sn else (None,) * 3
        gp = gap(fz, sn)
        gtxt = "-" if gp is None else f"{gp[0]:+.3f} ({gp[1]:+.3f}, {gp[2]:+.3f})"
        cells = [
            config,
            str(tokens),
            _f(fz and fz["total_ms"]),
            _f(sn and sn["total_ms"]),
            *(_f(v) for v in fs),
            *(_f(v) for v in ss),
            gtxt,
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "rest = routing + elementwise + other; gap = fused - SonicMoE (> 0: fused is "
        "behind), split as gemm + non-gemm. Categories: `KERNEL_PATTERNS` in "
        "benches/profile_moe.py.",
        "",
        "| config | T | impl | total ms | " + " | ".join(CATEGORIES) + " |",
        "| --- | ---: | --- | ---: | " + " | ".join(["---:"] * len(CATEGORIES)) + " |",
    ]
    for r in rows:
        cats = " | ".join(f"{r['by_category'][c]:.3f}" for c in CATEGORIES)
        out.append(
            f"| {r['config']} | {r['tokens']} | {r['impl']} | {r['total_ms']:.3f} | {cats} |"
        )
    skipped = doc.get("skipped", [])
    if skipped:
        out.append("")
    for s in skipped:
        out.append(f"- skipped {s['config']} T={s['tokens']} {s['impl']}: {s['why']}")
    return "\n".join(out) + "\n"


def summary_lines(doc: dict) -> list:
    """The row summaries, then the gaps fused - SonicMoE."""
    lines = [summary_line(r) for r in doc.get("rows", [])]
    for config, tokens, fz, sn in pairs(doc.get("rows", [])):
        ln = gap_line(config, tokens, fz, sn)
        if ln:
            lines.append(ln)
    return lines


def write_outputs(doc: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(render_md(doc))


# ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs",
        "--config",
        dest="configs",
        default="qwen3",
        help="comma list of bench_moe config names and groups (issue22, extra, legacy, all); "
        "default qwen3",
    )
    p.add_argument("--tokens", default="4096", help="comma list of T (tokens); default 4096")
    p.add_argument(
        "--routing",
        default="router",
        choices=bench.ROUTINGS,
        help="router (default: issue 22's table, SonicMoE included), uniform, skewed",
    )
    p.add_argument(
        "--impls",
        default="fused,sonicmoe",
        help=f"comma list of {', '.join(bench.IMPLS)}; default fused,sonicmoe",
    )
    p.add_argument("--steps", type=int, default=5, help="profiled steps per row")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling, per row")
    p.add_argument("--top", type=int, default=22, help="kernels printed per row")
    p.add_argument("--json", help="every row and kernel, rewritten after every shape")
    p.add_argument("--md", help="the tables in markdown, rewritten after every shape")
    p.add_argument("--dry-run", action="store_true", help="print the rows; no GPU")
    p.add_argument("--from-json", help="render a result file (--md); no GPU")
    args = p.parse_args(argv)
    args.config_names = bench.select_configs(args.configs)
    if not args.config_names:
        p.error("no config selected")
    try:
        args.token_list = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens takes a comma list of integers, not {args.tokens!r}")
    if not args.token_list or min(args.token_list) < 1:
        p.error("--tokens: at least one T, each at least 1")
    impls = []
    for name in (s.strip() for s in args.impls.split(",")):
        if not name:
            continue
        if name not in bench.IMPLS:
            p.error(f"unknown implementation {name!r}; choose from {', '.join(bench.IMPLS)}")
        if name not in impls:
            impls.append(name)
    if not impls:
        p.error("--impls: at least one implementation")
    args.impl_list = impls
    if min(args.steps, args.warmup, args.top) < 1:
        p.error("steps, warmup and top must be at least 1")
    return args


def profile_steps(step, steps: int) -> list:
    """``(kernel name, device µs over all steps, calls)`` of ``steps`` calls of ``step``
    under torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA":
            events.append((e.key, float(t), int(e.count)))
    return events


def profile_shape(cname, T, layer, S, sonic_w, why_no_sonic, args, dev, dtype):
    """Profile every requested implementation at one (config, tokens): ``(rows, skipped)``."""
    d, _f_, E, k = bench.CONFIGS[cname]
    ids = None
    if args.routing != "router":  # bench_moe.run_row's fixed routing
        gen = torch.Generator().manual_seed(T + E)
        ids = bench.routing(T, E, k, args.routing, gen).to(dev)
    torch.manual_seed(T)
    x = torch.randn(T, d, device=dev, dtype=dtype).requires_grad_()
    gy = torch.randn(T, d, device=dev, dtype=dtype)
    fwd, leaves, errors = bench.build_impls(layer, ids, k, S, sonic_w, why_no_sonic)
    rows, skipped = [], []

    def skip(name, why):
        skipped.append({"config": cname, "tokens": T, "impl": name, "why": why})
        print(f"   {name}: skipped: {why}")

    for name in args.impl_list:
        if name not in fwd:
            skip(name, errors.get(name, "not available"))
            continue
        fn, ls = fwd[name], [x, *leaves[name]]

        def step(fn=fn, ls=ls):
            for t in ls:
                t.grad = None
            fn(x).backward(gy)

        t0 = time.perf_counter()
        try:
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            skip(name, f"{type(e).__name__}: {str(e).strip()[:160]}")
            continue
        warm_s = time.perf_counter() - t0
        jit = " (JIT compile and autotune on first use)" if name == "sonicmoe" else ""
        print(f"   {name} warm-up: {args.warmup} steps took {warm_s:.1f} s wall{jit}")
        events = profile_steps(step, args.steps)
        row = make_row(
            cname,
            T,
            name,
            kernel_table(events, args.steps),
            routing=args.routing,
            steps=args.steps,
            warmup_s=warm_s,
        )
        for ln in kernel_block(row, args.top):
            print(ln)
        print(summary_line(row))
        rows.append(row)
    for t in [x, *(t for ls in leaves.values() for t in ls)]:
        t.grad = None
    return rows, skipped


def main(argv=None) -> int:
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except AttributeError:
        pass
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            doc = json.load(fh)
        for ln in summary_lines(doc):
            print(ln)
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(render_md(doc))
        return 0
    plan = [(c, T) for c in args.config_names for T in args.token_list]
    if args.dry_run:
        for c, T in plan:
            d, f, E, k = bench.CONFIGS[c]
            print(
                f"{c:15} T={T:<6} d={d:<5} d_ff={f:<5} E={E:<3} k={k} {args.routing}: "
                + ", ".join(args.impl_list)
            )
        print(
            f"{len(plan)} shapes x {len(args.impl_list)} implementations, {args.warmup} "
            f"warm-up + {args.steps} profiled steps each"
        )
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile (--dry-run or --from-json work on the CPU)")
        return 2
    dev = torch.device(DEV)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    S, why = None, None
    if "sonicmoe" in args.impl_list:
        S, why = bench.load_sonic()
        if S is None:
            print(f"SonicMoE skipped: {why}")
    doc = {
        "schema": "moe-profile-1",
        "complete": False,
        "command": list(sys.argv[1:] if argv is None else argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).replace("torch.", ""),
        "groupmm": groupmm.build_info(),
        "versions": bench.peer_versions() if "sonicmoe" in args.impl_list else {},
        "sonicmoe_why": why,
        "routing": args.routing,
        "steps": args.steps,
        "warmup": args.warmup,
        "patterns": {c: list(p) for c, p in KERNEL_PATTERNS},
        "rows": [],
        "skipped": [],
    }
    print(f"{doc['device']}, torch {doc['torch']}, {doc['dtype']}, routing {args.routing}")
    for cname in args.config_names:
        d, f, E, k = bench.CONFIGS[cname]
        print(f"== {cname}: d={d} d_ff={f} E={E} k={k} ({bench.MODELS.get(cname, cname)})")
        torch.manual_seed(0)  # bench_moe.main's layer
        layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype)
        sonic_w = bench.sonic_weights(layer) if S is not None else None
        for T in args.token_list:
            try:
                rows, skipped = profile_shape(cname, T, layer, S, sonic_w, why, args, dev, dtype)
            except torch.cuda.OutOfMemoryError as e:
                rows = []
                skipped = [
                    {"config": cname, "tokens": T, "impl": "*", "why": f"out of memory: {e}"[:120]}
                ]
                print(f"skip {cname} T={T}: out of memory")
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            doc["rows"] += rows
            doc["skipped"] += skipped
            write_outputs(doc, args)  # after every shape: a run cut short keeps what ran
        del layer, sonic_w
    doc["complete"] = True
    write_outputs(doc, args)
    print()
    for ln in summary_lines(doc):
        print(ln)
    return 0


if __name__ == "__main__":
    sys.exit(main())
