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
    python3 benches/profile_moe.py --bytes-only [--configs ..] [--tokens ..] [--bytes-detail]
        [--gather-x-in-gemm] [--dy-in-gemm] [--md out.md] [--json out.json]  # no GPU

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
and non-gemm parts, and both implementations' routed-row bytes (below); then every row's
categories; then the byte budget per pass of the first (config, tokens), or of every one
with ``--bytes-detail``. Both rewritten after every shape.

Byte budget (``byte_budget``; analytic, no GPU): for one forward+backward step, the bytes of
the routed-row tensors (``[R, ·]``, R = T*k rows, of the run's element size) that each pass
reads and writes, forward and backward apart, for groupmm's fused block and for SonicMoE,
and the ratio of their totals: the md table's R-GiB columns, each JSON row's ``"bytes"``
(``{"fused": {"fwd", "bwd", "passes": [..]}, "sonicmoe": {..}}``, bytes) and a summary line
per (config, tokens). Token-order ``[T, ·]`` tensors and weights are listed at 0, index
vectors and per-row scalars not at all. The passes are declarative tables of symbolic
shapes (``fused_passes``, ``SONICMOE_PASSES``) that ``pass_bytes`` multiplies out. The
fused table must follow groupmm/fused.py's forward and backward; update it when fused.py
changes. Its switches ``--gather-x-in-gemm`` (the up projection and dW_in read x's rows
through the index: no gather passes) and ``--dy-in-gemm`` (the dgated and dW_out GEMMs
read d_out's rows through the index: no dy copy) say which path the fused run took; both
off is the default path. SonicMoE's table is its design (its GEMMs read the rows of x and
d_out through the index). ``--bytes-only`` prints the budget tables of the selected
configs x tokens (bf16) without profiling; ``--from-json`` of a file without budgets
computes them from the config (bf16 unless the file names its dtype; "-" for a config
bench_moe.py does not know).
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
from groupmm import fused as _fused  # _slabs: the dW_in slabs the byte budget counts
from groupmm.moe import MoELayer
from timing import line_buffered_stdout  # benches/timing.py, same folder

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


# ---------------------------------------------------------------------- byte budget
#
# The bytes of the routed rows (tensors of R = T*k rows) that one forward+backward step
# reads and writes, pass by pass, for groupmm's fused block and for SonicMoE: analytic,
# from the config and T alone. A pass is (phase, name, reads, writes), each of reads and
# writes a tuple of (tensor, shape) with a symbolic shape (DIMS): ("R", "D") is R rows of
# D elements. Only tensors whose first dimension is R count (``shape_bytes``); token-order
# [T, ·] tensors and weights are listed at 0 so that each pass reads whole. Index vectors
# (src, inverse, offs) and per-row scalars (the router-weight scale, its gradient's
# partial sums: 4 bytes a row) are not listed.

#: the symbols of a shape and what each stands for (``dims``)
DIMS = ("R", "T", "k", "D", "F", "2F", "E")

_RD, _RF, _R2F, _TD, _TK = ("R", "D"), ("R", "F"), ("R", "2F"), ("T", "D"), ("T", "k")
_W_IN, _W_OUT = ("E", "D", "2F"), ("E", "F", "D")


def fused_passes(gather_x_in_gemm: bool = False, dy_in_gemm: bool = False, slabs: int = 2) -> tuple:
    """groupmm's fused block (``groupmm.fused.expert_block``) as passes over the routed
    rows, forward then backward, in the order they run: a tuple of (phase, pass, reads,
    writes).

    This table MUST follow groupmm/fused.py's forward and backward; update it when
    fused.py changes. The defaults are the default path: ``x``'s rows gathered into a
    copy ``xs`` before the up projection, ``dy = d_out[src]`` copied once for the dgated
    and dW_out GEMMs, and ``x``'s rows gathered again for dW_in, one column slab at a
    time (``slabs`` of them: ``groupmm.fused._slabs``, two where D >= 128, one below; each
    slab's GEMM reads all of ``d_pre``). ``gather_x_in_gemm``: the up projection and dW_in
    read ``x``'s rows through ``src`` (no gather passes; dW_in still runs slab by slab).
    ``dy_in_gemm``: the dgated and dW_out GEMMs read ``d_out``'s rows through ``src`` (no
    ``dy``)."""
    gx, gy = gather_x_in_gemm, dy_in_gemm
    # the tensors: (name, symbolic shape)
    x_src, xs = ("x[src]", _RD), ("xs", _RD)
    x_rows = ("x[src] (in the GEMM)", _RD) if gx else xs  # what the x-side GEMMs read
    d_src, dy = ("d_out[src]", _RD), ("dy", _RD)
    dy_rows = ("d_out[src] (in the GEMM)", _RD) if gy else dy  # what the dy-side GEMMs read
    pre, act, y, out = ("pre", _R2F), ("act", _RF), ("y", _RD), ("out", _TD)
    d_pre, act_s, dxr, dx = ("d_pre", _R2F), ("act_s", _RF), ("dx rows", _RD), ("dx", _TD)
    w_in, w_out, weights = ("w_in", _W_IN), ("w_out", _W_OUT), ("weights", _TK)
    dw_in, dw_out = ("dw_in", _W_IN), ("dw_out", _W_OUT)
    # dW_in reads d_pre once per slab of x's columns
    d_pres = (
        tuple((f"d_pre (slab {i})", _R2F) for i in range(1, slabs + 1)) if slabs > 1 else (d_pre,)
    )
    in_slabs = f" in {slabs} column slabs" if slabs > 1 else ""
    # fmt: off
    table = (
        # (phase, pass, reads, writes); None where a switch removes the pass
        None if gx else
        ("fwd", "gather x[src] (row kernel)",           (x_src,),                (xs,)),
        ("fwd", "up projection + SwiGLU GEMM",          (x_rows, w_in),          (pre, act)),
        ("fwd", "down projection GEMM",                 (act, w_out),            (y,)),
        ("fwd", "combine (weighted sum over k)",        (y, weights),            (out,)),
        None if gy else
        ("bwd", "gather dy = d_out[src] (row kernel)",  (d_src,),                (dy,)),
        ("bwd", "dgated GEMM (d_pre over pre)",         (dy_rows, pre, w_out),   (d_pre, act_s)),
        ("bwd", "dW_out GEMM",                          (act_s, dy_rows),        (dw_out,)),
        ("bwd", "dX GEMM",                              (d_pre, w_in),           (dxr,)),
        ("bwd", "sum over k (row kernel)",              (dxr,),                  (dx,)),
        None if gx else
        ("bwd", f"gather x[src]{in_slabs} (row kernel)", (x_src,),               (xs,)),
        ("bwd", f"dW_in GEMM{in_slabs}",                (x_rows, *d_pres),       (dw_in,)),
    )
    # fmt: on
    return tuple(p for p in table if p is not None)


def _sonicmoe_passes() -> tuple:
    x_src, d_src = ("x[src] (in the GEMM)", _RD), ("d_out[src] (in the GEMM)", _RD)
    h, a, y, out = ("h", _R2F), ("a", _RF), ("y", _RD), ("out", _TD)
    dh, a_s, dxr, dx = ("dh", _R2F), ("a'", _RF), ("dx rows", _RD), ("dx", _TD)
    w1, w2, weights = ("w1", _W_IN), ("w2", _W_OUT), ("weights", _TK)
    dw1, dw2 = ("dw1", _W_IN), ("dw2", _W_OUT)
    # fmt: off
    return (
        ("fwd", "up projection + SwiGLU GEMM, x gathered",  (x_src, w1),      (h, a)),
        ("fwd", "down projection GEMM",                     (a, w2),          (y,)),
        ("fwd", "combine (weighted sum over k)",            (y, weights),     (out,)),
        ("bwd", "dgated GEMM, dO gathered",                 (d_src, h, w2),   (dh, a_s)),
        ("bwd", "dW2 GEMM, dO gathered",                    (a_s, d_src),     (dw2,)),
        ("bwd", "dX GEMM",                                  (dh, w1),         (dxr,)),
        ("bwd", "sum over k",                               (dxr,),           (dx,)),
        ("bwd", "dW1 GEMM, x gathered",                     (x_src, dh),      (dw1,)),
    )
    # fmt: on


#: SonicMoE's layer as passes over the routed rows (phase, pass, reads, writes), from its
#: design: its GEMMs read the rows of x and of the output gradient dO through the routing
#: index (no gathered copies); h/dh [R, 2F] are its pre-activation and its gradient, a
#: the activation, a' the activation scaled by the router weight
SONICMOE_PASSES = _sonicmoe_passes()

#: element bytes of the dtypes a result file names (``doc["dtype"]``)
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def dims(d: int, f: int, experts: int, k: int, tokens: int) -> dict:
    """What each symbol of DIMS stands for at a config ``(d, f, experts, k)`` and T."""
    return {"R": tokens * k, "T": tokens, "k": k, "D": d, "F": f, "2F": 2 * f, "E": experts}


def shape_bytes(shape: tuple, sizes: dict, es: int) -> int:
    """The bytes a tensor of symbolic ``shape`` counts: its size times ``es`` when its
    rows are the routed rows (first symbol "R"), else 0."""
    if shape[0] != "R":
        return 0
    n = es
    for s in shape:
        n *= sizes[s]
    return n


def pass_bytes(passes, config: tuple, tokens: int, es: int = 2) -> dict:
    """A pass table multiplied out at ``config = (d, f, experts, k)``, T = ``tokens`` and
    ``es`` bytes an element: ``{"fwd", "bwd"}`` bytes read + written per phase and
    ``"passes"``: per pass its phase, name, ``read_bytes``, ``write_bytes`` and each
    tensor (``{"tensor", "shape", "bytes"}``)."""
    sizes = dims(*config, tokens)
    out = {"fwd": 0, "bwd": 0, "passes": []}
    for phase, name, reads, writes in passes:
        entry = {"phase": phase, "pass": name}
        for key, tensors in (("read", reads), ("write", writes)):
            ts = [
                {"tensor": t, "shape": " x ".join(s), "bytes": shape_bytes(s, sizes, es)}
                for t, s in tensors
            ]
            entry[key + "_bytes"] = sum(t["bytes"] for t in ts)
            entry[key + "s"] = ts
        out[phase] += entry["read_bytes"] + entry["write_bytes"]
        out["passes"].append(entry)
    return out


def byte_budget(
    config: tuple,
    tokens: int,
    es: int = 2,
    gather_x_in_gemm: bool = False,
    dy_in_gemm: bool = False,
) -> dict:
    """The routed-row bytes of one step, ``{"fused": .., "sonicmoe": ..}`` (each
    ``pass_bytes``), with the element size, R and the fused table's switches (and its
    dW_in slabs, as ``groupmm.fused`` splits D)."""
    slabs = len(_fused._slabs(config[0]))
    fused = fused_passes(gather_x_in_gemm, dy_in_gemm, slabs)
    return {
        "element_bytes": es,
        "R": tokens * config[3],
        "fused_switches": {"gather_x_in_gemm": gather_x_in_gemm, "dy_in_gemm": dy_in_gemm},
        "fused": pass_bytes(fused, config, tokens, es),
        "sonicmoe": pass_bytes(SONICMOE_PASSES, config, tokens, es),
    }


def gib(n: int) -> float:
    return n / 2**30


def budget_totals(budget) -> tuple:
    """``(fused fwd, fused bwd, SonicMoE fwd, SonicMoE bwd, fused/SonicMoE)``: GiB and the
    ratio of the totals; all None without a budget."""
    if budget is None:
        return (None,) * 5
    fz, sn = budget["fused"], budget["sonicmoe"]
    ratio = (fz["fwd"] + fz["bwd"]) / (sn["fwd"] + sn["bwd"])
    return gib(fz["fwd"]), gib(fz["bwd"]), gib(sn["fwd"]), gib(sn["bwd"]), ratio


def doc_budget(doc: dict, config: str, tokens: int, *rows):
    """The byte budget of a (config, tokens): the first of ``rows`` that has one (a
    result file's ``"bytes"``), else computed from the config (element size from the
    file's dtype, bf16 if it names none; the fused switches it records), else None (a
    config this file's bench_moe does not know)."""
    for r in rows:
        if r and r.get("bytes"):
            return r["bytes"]
    if config not in bench.CONFIGS:
        return None
    es = ELEMENT_BYTES.get(doc.get("dtype") or "bfloat16", 2)
    sw = doc.get("bytes_switches") or {}
    return byte_budget(bench.CONFIGS[config], tokens, es, **sw)


def _tensor_cell(tensors) -> str:
    return ", ".join(f"{t['tensor']} [{t['shape'].replace(' x ', ', ')}]" for t in tensors)


def bytes_pass_table(config: str, tokens: int, budget: dict) -> list:
    """The markdown lines of one (config, tokens)'s byte budget per pass, both
    implementations, with each phase's totals."""
    R, es = budget["R"], budget["element_bytes"]
    sw = [k for k, on in budget.get("fused_switches", {}).items() if on]
    lines = [
        f"### Byte budget per pass: {config} T={tokens} (R = {R} routed rows, {es} bytes an "
        f"element{'; fused with ' + ', '.join(sw) if sw else ''})",
        "",
        "| impl | phase | pass | reads | writes | read GiB | written GiB |",
        "| --- | --- | --- | --- | --- | ---: | ---: |",
    ]
    for impl in ("fused", "sonicmoe"):
        b = budget[impl]
        label = bench.LABELS.get(impl, impl)
        for i, p in enumerate(b["passes"], 1):
            lines.append(
                f"| {label} | {p['phase']} | {i}. {p['pass']} | {_tensor_cell(p['reads'])} | "
                f"{_tensor_cell(p['writes'])} | {gib(p['read_bytes']):.3f} | "
                f"{gib(p['write_bytes']):.3f} |"
            )
        for phase in ("fwd", "bwd"):
            ps = [p for p in b["passes"] if p["phase"] == phase]
            rd = gib(sum(p["read_bytes"] for p in ps))
            wr = gib(sum(p["write_bytes"] for p in ps))
            lines.append(
                f"| {label} | {phase} | **total {gib(b[phase]):.3f} GiB** |  |  | "
                f"{rd:.3f} | {wr:.3f} |"
            )
    lines += [
        "",
        "Only tensors of R rows count; [T, ·] tensors and weights are listed at 0. The "
        "tables: `fused_passes` and `SONICMOE_PASSES` in benches/profile_moe.py.",
    ]
    return lines


def bytes_line(config: str, tokens: int, budget) -> str | None:
    """``config T=.. routed-row bytes: fused a + b GiB, SonicMoE c + d GiB (fwd + bwd),
    fused/SonicMoE r``; None without a budget."""
    if budget is None:
        return None
    ff, fb, sf, sb, ratio = budget_totals(budget)
    return (
        f"{config} T={tokens} routed-row bytes (fwd + bwd): fused {ff:.3f} + {fb:.3f} GiB, "
        f"SonicMoE {sf:.3f} + {sb:.3f} GiB, fused/SonicMoE {ratio:.2f}"
    )


def render_md(doc: dict, bytes_detail: bool = False) -> str:
    """The markdown of a result document: where the fused step and SonicMoE's go, per
    (config, tokens), beside their routed-row bytes; then every row's categories; then
    the byte budget per pass of the first (config, tokens) (every one: ``bytes_detail``)."""
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
        "| SonicMoE gemm | SonicMoE rows | SonicMoE rest | gap ms (gemm, non-gemm) "
        "| fused R-GiB fwd | fused R-GiB bwd | SonicMoE R-GiB fwd | SonicMoE R-GiB bwd "
        "| R-bytes fused/SonicMoE |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    budgets = []
    for config, tokens, fz, sn in pairs(rows):
        budget = doc_budget(doc, config, tokens, fz, sn)
        budgets.append((config, tokens, budget))
        *gibs, ratio = budget_totals(budget)
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
            *(_f(v) for v in gibs),
            _f(ratio, ".2f"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "rest = routing + elementwise + other; gap = fused - SonicMoE (> 0: fused is "
        "behind), split as gemm + non-gemm. Categories: `KERNEL_PATTERNS` in "
        "benches/profile_moe.py. R-GiB: the bytes of routed-row tensors ([T*k, ·]) that "
        "the step's passes read and write, per forward and backward (analytic, from the "
        "config: the byte budget per pass below); R-bytes fused/SonicMoE: of the totals.",
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
    out += bytes_detail_lines(budgets, bytes_detail)
    return "\n".join(out) + "\n"


def bytes_detail_lines(budgets, every: bool) -> list:
    """The per-pass tables of the first ``(config, tokens, budget)`` that has a budget, or
    of every one (``every``), each after an empty line."""
    out = []
    for config, tokens, budget in budgets:
        if budget is None:
            continue
        out += ["", *bytes_pass_table(config, tokens, budget)]
        if not every:
            break
    return out


def render_bytes_md(budgets, bytes_detail: bool = False) -> str:
    """``--bytes-only``'s markdown: per ``(config, tokens, budget)`` the routed-row bytes
    of both implementations, then the per-pass tables (the first row's, or every row's)."""
    out = [
        "# Routed-row byte budget of one forward+backward step (analytic)",
        "",
        "| config | T | R | fused R-GiB fwd | fused R-GiB bwd | SonicMoE R-GiB fwd "
        "| SonicMoE R-GiB bwd | R-bytes fused/SonicMoE |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config, tokens, budget in budgets:
        *gibs, ratio = budget_totals(budget)
        R = budget["R"] if budget else None
        cells = [config, str(tokens), _f(R, "d"), *(_f(v) for v in gibs), _f(ratio, ".2f")]
        out.append("| " + " | ".join(cells) + " |")
    out += bytes_detail_lines(budgets, bytes_detail)
    return "\n".join(out) + "\n"


def summary_lines(doc: dict) -> list:
    """The row summaries, then per (config, tokens) the gap fused - SonicMoE and the
    routed-row bytes."""
    lines = [summary_line(r) for r in doc.get("rows", [])]
    for config, tokens, fz, sn in pairs(doc.get("rows", [])):
        for ln in (
            gap_line(config, tokens, fz, sn),
            bytes_line(config, tokens, doc_budget(doc, config, tokens, fz, sn)),
        ):
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
            fh.write(render_md(doc, args.bytes_detail))


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
    p.add_argument(
        "--bytes-only",
        action="store_true",
        help="print the routed-row byte budget of each config x tokens (also to --md, "
        "--json); no profiling, no GPU",
    )
    p.add_argument(
        "--bytes-detail",
        action="store_true",
        help="the byte budget per pass of every config x tokens (default: the first)",
    )
    p.add_argument(
        "--gather-x-in-gemm",
        action="store_true",
        help="byte budget: the fused up projection and dW_in read x's rows through the "
        "index (no gather passes)",
    )
    p.add_argument(
        "--dy-in-gemm",
        action="store_true",
        help="byte budget: the fused dgated and dW_out GEMMs read d_out's rows through "
        "the index (no dy copy)",
    )
    args = p.parse_args(argv)
    args.argv = argv
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


def switches(args) -> dict:
    """The fused byte budget's switches (``fused_passes``) the arguments ask for."""
    return {"gather_x_in_gemm": args.gather_x_in_gemm, "dy_in_gemm": args.dy_in_gemm}


def bytes_only(args, plan) -> int:
    """``--bytes-only``: the byte budget of every (config, tokens) of ``plan``, printed
    (and written to --md, and --json as ``{"schema", "switches", "budgets": [..]}``)."""
    budgets = [(c, T, byte_budget(bench.CONFIGS[c], T, 2, **switches(args))) for c, T in plan]
    md = render_bytes_md(budgets, args.bytes_detail)
    print(md, end="")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(md)
    if args.json:
        doc = {
            "schema": "moe-bytes-1",
            "command": list(sys.argv[1:] if args.argv is None else args.argv),
            "dtype": "bfloat16",
            "bytes_switches": switches(args),
            "budgets": [{"config": c, "tokens": T, "bytes": b} for c, T, b in budgets],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    return 0


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
    es = torch.empty((), dtype=dtype).element_size()
    budget = byte_budget(bench.CONFIGS[cname], T, es, **switches(args))

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
            bytes=budget,
        )
        for ln in kernel_block(row, args.top):
            print(ln)
        print(summary_line(row))
        rows.append(row)
    for t in [x, *(t for ls in leaves.values() for t in ls)]:
        t.grad = None
    return rows, skipped


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as fh:
            doc = json.load(fh)
        for ln in summary_lines(doc):
            print(ln)
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(render_md(doc, args.bytes_detail))
        return 0
    plan = [(c, T) for c in args.config_names for T in args.token_list]
    if args.bytes_only:
        return bytes_only(args, plan)
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
        print(
            "no CUDA device: nothing to profile (--dry-run, --bytes-only or --from-json "
            "work on the CPU)"
        )
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
        "bytes_switches": switches(args),
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
