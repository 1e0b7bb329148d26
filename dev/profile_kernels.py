"""profile_moe.py's rows and tables: each kernel in a category, per-category sums, the gap
between groupmm's fused step and SonicMoE's."""

from __future__ import annotations

from harness.report import fmt

#: the categories, in the order of every sum and table
CATEGORIES = ("gemm", "rows", "routing", "elementwise", "other")

#: a kernel's category: the first (in this order) with a case-insensitive substring of its
#: name; gemm first (GEMM names carry the others' words), routing before rows (top-k
#: kernels gather and scatter indices), rows before elementwise (copies run as elementwise
#: kernels); "other" when none matches
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


def render_md(doc: dict) -> str:
    """The markdown of a result document: where the fused step and SonicMoE's go, per
    (config, tokens); then every row's categories."""
    rows = doc.get("rows", [])
    out = [
        "# Where the MoE layer's step goes (torch.profiler)",
        "",
        f"Device: {doc.get('device')}; torch {doc.get('torch')}; routing "
        f"{doc.get('routing')}; forward+backward, ms of kernels per step (device time, "
        f"mean of {doc.get('steps')} profiled steps after {doc.get('warmup')} warm-up steps).",
        "",
        f"Command: `python3 dev/profile_moe.py {' '.join(doc.get('command', []))}`",
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
            fmt(fz and fz["total_ms"], ".3f"),
            fmt(sn and sn["total_ms"], ".3f"),
            *(fmt(v, ".3f") for v in fs),
            *(fmt(v, ".3f") for v in ss),
            gtxt,
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "rest = routing + elementwise + other; gap = fused - SonicMoE (> 0: fused is "
        "behind), split as gemm + non-gemm. Categories: `KERNEL_PATTERNS` in "
        "dev/profile_kernels.py.",
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
    """The row summaries, then per (config, tokens) the gap fused - SonicMoE."""
    lines = [summary_line(r) for r in doc.get("rows", [])]
    for config, tokens, fz, sn in pairs(doc.get("rows", [])):
        ln = gap_line(config, tokens, fz, sn)
        if ln:
            lines.append(ln)
    return lines
