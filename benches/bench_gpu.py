"""GPU benchmark: groupmm against torch.nn.functional.grouped_mm, quack (the grouped GEMM of
SonicMoE, when installed), a loop of torch.mm and a dense torch.mm of the same FLOPs, with
each row's roofline bound: every column measured in one process, row by row interleaved.

    python3 benches/bench_gpu.py [--shapes all|fine|decode|larger|legacy|NAME,...]
        [--routing uniform,zipf12] [--passes fwd,dX,dW] [--rounds 7] [--select-rounds 3]
        [--quick] [--no-quack] [--no-loop] [--graph] [--budget-s SECONDS]
        [--json out.json] [--md out.md] [--png out.png]
    python3 benches/bench_gpu.py --dry-run [...]     # the rows and a time estimate; no GPU
    python3 benches/bench_gpu.py --from-json out.json [--md out.md] [--png out.png]

Timing (benches/timing.py, ``round_robin``; the clocks of these GPUs drift by up to ~10 %
within seconds): per row, the implementations run round-robin over --rounds rounds, the
start rotating each round; a sample is CUDA events around N back-to-back calls (N chosen per
implementation so a sample lasts ~--sample-ms, or fixed with --calls; --graph: one CUDA
graph replay of the N calls where capture works), each sample preceded by the same GPU spin,
long enough for the host to enqueue the sample, so every figure is GPU time (quack's
Python planning included only if the GPU waited for it, which the spin prevents). Reported:
the median per implementation and its spread (min-max over the rounds), and each ratio both
as a ratio of medians and round by round (min-max of the per-round ratios). quack's
configuration is chosen per row in a separate pass first (its default, 128x192 ping-pong in
2x1 clusters, and the three forced ones of ../shared/PEERS.md: 128x128 ping-pong, 128x192
ping-pong, 128x256 cooperative, all 1x1; the same round-robin, --select-rounds rounds), then
only the chosen one is timed with the others: a max over four noisy configurations would
favour quack by the noise. quack JIT-compiles each configuration once per compile key
(dtype, operand majors, varlen mode; not the sizes), during the first shape.

Passes: fwd (x @ w: [T, K] x [E, K, N]), dX (dy @ wᵀ), dW (xᵀ @ dy grouped along T, [E, K, N])
and, with --passes, fwd+bwd through autograd (no quack or loop column). Up projections are
x @ W_up with N = 2·d_ff (gate and up in one weight) unless the shape says otherwise; down
projections K = d_ff, N = d. T is the number of routed rows (tokens x top-k).

Routing: uniform; zipf12 (Zipf 1.2 over a fixed permutation, E/8 experts empty); skewed
(Zipf 1.1, E/16 empty).

Classes (the targets of issue 20 are per class): "decode" (serving batches: T = tokens x
top-k of a few hundred rows, a handful per expert; bound by reading the weights), "fine"
(fine-grained experts, at most 256 routed rows per expert on average), "larger" (more).

Roofline: a row's time can be no lower than max(FLOPs / R, bytes / B), R the dense matmul
rate and B the device-to-device copy bandwidth (bytes read plus written), both measured at
the start of the same run (an 8192³ torch.mm; a 1 GiB copy); bytes are each operand read
once and the output written once (x, the E·K·N weights and the output for fwd; dy, the
weights and dX for dX; x, dy and the E·K·N gradient for dW). "of roofline" is bound time
over measured time.

Outputs: a line per row as it finishes (unbuffered), then the table and a summary per class
against issue 20's targets; --json (rewritten after every shape, so a run cut short keeps
what ran), --md (the same table in markdown, also rewritten after every shape), --png
(matplotlib, optional). Every output names the device, torch and CUDA versions, the quack
version and groupmm's build_info. --from-json renders a JSON file's table, markdown and
chart without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from typing import NamedTuple

import torch
from report import (  # benches/report.py, same folder
    gmean,
    line_buffered_stdout,
)
from report import mark as _mark
from report import spread_pct as _spread_pct
from report import write_outputs as timing_write
from timing import (  # benches/timing.py, same folder
    calls_for,
    lead_for,
    paired,
    round_robin,
    rr_settings,
)


class Spec(NamedTuple):
    E: int  # experts (local experts for an expert-parallel shard)
    K: int  # reduction size of the forward product
    N: int  # output columns of the forward product
    T: int  # routed rows (tokens x top-k)
    model: str
    proj: str
    tokens: int  # tokens of the batch (per rank for a shard)
    topk: int
    decode: bool = False


# Fine-grained first, then decode sizes, then larger experts: a run cut short by --budget-s
# or a timeout keeps the rows issue 20's targets are strictest on.
SPECS = {
    # --- fine-grained (≤ 256 routed rows per expert on average)
    "qwen3-up": Spec(128, 2048, 768, 32768, "Qwen3-30B-A3B", "up, one half", 4096, 8),
    "qwen3-down": Spec(128, 768, 2048, 32768, "Qwen3-30B-A3B", "down", 4096, 8),
    "qwen3-30b-up": Spec(128, 2048, 1536, 32768, "Qwen3-30B-A3B", "up (gate+up)", 4096, 8),
    "small64": Spec(64, 1024, 1024, 8192, "synthetic", "square", 1024, 8),
    "olmoe-up": Spec(64, 2048, 2048, 16384, "OLMoE-1B-7B", "up (gate+up)", 2048, 8),
    "olmoe-down": Spec(64, 1024, 2048, 16384, "OLMoE-1B-7B", "down", 2048, 8),
    "qwen3-235b-up": Spec(128, 4096, 3072, 32768, "Qwen3-235B-A22B", "up (gate+up)", 4096, 8),
    "qwen3-235b-down": Spec(128, 1536, 4096, 32768, "Qwen3-235B-A22B", "down", 4096, 8),
    "dsv2-up": Spec(160, 5120, 3072, 24576, "DeepSeek-V2", "up (gate+up)", 4096, 6),
    "dsv2-down": Spec(160, 1536, 5120, 24576, "DeepSeek-V2", "down", 4096, 6),
    # --- decode sizes (a handful of rows per expert: reading the weights bounds them)
    "qwen3-30b-up-dec": Spec(128, 2048, 1536, 512, "Qwen3-30B-A3B", "up (gate+up)", 64, 8, True),
    "qwen3-30b-down-dec": Spec(128, 768, 2048, 512, "Qwen3-30B-A3B", "down", 64, 8, True),
    "olmoe-up-dec": Spec(64, 2048, 2048, 256, "OLMoE-1B-7B", "up (gate+up)", 32, 8, True),
    "olmoe-down-dec": Spec(64, 1024, 2048, 256, "OLMoE-1B-7B", "down", 32, 8, True),
    "gpt-oss-up-dec": Spec(32, 2880, 5760, 256, "gpt-oss-20b", "up (gate+up)", 64, 4, True),
    "dsv3-local-up-dec": Spec(
        32, 7168, 4096, 512, "DeepSeek-V3, 32 of 256 experts", "up (gate+up)", 64, 8, True
    ),
    # --- larger experts
    "gpt-oss-up": Spec(32, 2880, 5760, 16384, "gpt-oss-20b", "up (gate+up)", 4096, 4),
    "gpt-oss-down": Spec(32, 2880, 2880, 16384, "gpt-oss-20b", "down", 4096, 4),
    "gpt-oss-up-8k": Spec(32, 2880, 5760, 32768, "gpt-oss-20b", "up (gate+up)", 8192, 4),
    "dsv2-up-16k": Spec(160, 5120, 3072, 98304, "DeepSeek-V2", "up (gate+up)", 16384, 6),
    "qwen3-30b-up-16k": Spec(128, 2048, 1536, 131072, "Qwen3-30B-A3B", "up (gate+up)", 16384, 8),
    "qwen3-30b-down-16k": Spec(128, 768, 2048, 131072, "Qwen3-30B-A3B", "down", 16384, 8),
    "dsv3-local-up": Spec(
        32, 7168, 4096, 32768, "DeepSeek-V3, 32 of 256 experts", "up (gate+up)", 4096, 8
    ),
    "dsv3-local-down": Spec(
        32, 2048, 7168, 32768, "DeepSeek-V3, 32 of 256 experts", "down", 4096, 8
    ),
    "mixtral-up": Spec(8, 4096, 14336, 32768, "Mixtral-8x7B", "up, one half", 16384, 2),
    "mixtral-down": Spec(8, 14336, 4096, 32768, "Mixtral-8x7B", "down", 16384, 2),
    "dsv3-up": Spec(
        32, 7168, 2048, 65536, "DeepSeek-V3, 32 of 256 experts", "up, one half", 8192, 8
    ),
    "dsv3-down": Spec(32, 2048, 7168, 65536, "DeepSeek-V3, 32 of 256 experts", "down", 8192, 8),
}

#: the seven shapes of the benchmark before issue 20 (docs/performance.md's tables)
LEGACY = ("mixtral-up", "mixtral-down", "dsv3-up", "dsv3-down", "qwen3-up", "qwen3-down", "small64")

#: name -> (E, K, N, T): the shape table as other benches read it (profile_gpu.py)
SHAPES = {k: (s.E, s.K, s.N, s.T) for k, s in SPECS.items()}

CLASSES = ("fine", "larger", "decode")
CLASS_TITLE = {"fine": "fine-grained", "larger": "larger experts", "decode": "decode sizes"}

#: issue 20's targets per class: (key, label, threshold, "min" or "geomean")
TARGETS = {
    "fine": [
        ("vs_quack", "vs quack", 1.0, "min"),
        ("vs_quack", "vs quack", 1.15, "geomean"),
        ("vs_torch", "vs torch", 1.0, "min"),
        ("roofline", "of roofline", 0.80, "min"),
    ],
    "larger": [("vs_torch", "vs torch", 1.0, "min")],
    "decode": [("vs_torch", "vs torch", 1.0, "min")],
}

PASSES = ("fwd", "dX", "dW", "fwd+bwd")
ROUTINGS = ("uniform", "skewed", "zipf12")

#: quack's configurations (PEERS.md): name -> (tile_m, tile_n, pingpong), None = its default
QUACK_CONFIGS = {
    "default 128x192 pp 2x1": None,
    "128x128 pp 1x1": (128, 128, True),
    "128x192 pp 1x1": (128, 192, True),
    "128x256 coop 1x1": (128, 256, False),
}

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"

#: H200 figures of PEERS.md, used only by --dry-run's estimate
EST_RATE, EST_BW = 790e12, 4.3e12
#: assumed seconds of one quack JIT compile (one configuration, one pass form), --dry-run only
EST_QUACK_JIT_S = 10.0


def row_class(E: int, T: int, decode: bool = False) -> str:
    if decode:
        return "decode"
    return "fine" if T / E <= 256 else "larger"


def counts_for(E: int, T: int, routing: str) -> list:
    if routing == "uniform":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    # Zipf-like over a fixed permutation: "skewed" exponent 1.1 with E//16 (≥1) experts
    # empty; "zipf12" exponent 1.2 with E//8 (≥1) empty (the routing of issue 11's table).
    expo, frac = (1.2, 8) if routing == "zipf12" else (1.1, 16)
    empty = max(1, E // frac)
    live = E - empty
    w = [1.0 / (r + 1) ** expo for r in range(live)]
    s = sum(w)
    c = [int(T * x / s) for x in w]
    c[0] += T - sum(c)
    g = torch.Generator().manual_seed(E)
    perm = torch.randperm(E, generator=g).tolist()
    out = [0] * E
    for i, cnt in enumerate(c + [0] * empty):
        out[perm[i]] = cnt
    return out


def select_shapes(arg: str) -> list:
    """Shape names from a comma list of names and groups (all, legacy, fine, larger,
    decode), in SPECS order, each once."""
    want = set()
    for tok in (t.strip() for t in arg.split(",")):
        if not tok:
            continue
        if tok == "all":
            want.update(SPECS)
        elif tok == "legacy":
            want.update(LEGACY)
        elif tok in CLASSES:
            want.update(k for k, s in SPECS.items() if row_class(s.E, s.T, s.decode) == tok)
        elif tok in SPECS:
            want.add(tok)
        else:
            groups = "all, legacy, " + ", ".join(CLASSES)
            raise SystemExit(f"unknown shape {tok!r}; groups: {groups}; shapes: {', '.join(SPECS)}")
    return [k for k in SPECS if k in want]


def effective_T(spec: Spec, quick: bool) -> int:
    """Routed rows measured: --quick divides all but decode sizes by 8."""
    return spec.T if (spec.decode or not quick) else max(spec.E, spec.T // 8)


def nbytes_for(pname: str, E: int, K: int, N: int, T: int, es: int) -> int:
    """Each operand read once, the output written once."""
    b = {
        "fwd": es * (T * K + E * K * N + T * N),
        "dX": es * (T * N + E * K * N + T * K),
        "dW": es * (T * K + T * N + E * K * N),
    }
    if pname == "fwd+bwd":
        return b["fwd"] + b["dX"] + b["dW"]
    return b[pname]


def pass_mult(pname: str) -> float:
    return 3.0 if pname == "fwd+bwd" else 1.0


def fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


# ----------------------------------------------------------------------------------------
# rows, summaries and rendering: pure functions of numbers (CPU-tested)


def make_row(base: dict, timed: dict, bound_ms: float, flops: float, quack=None) -> dict:
    """One result row from ``round_robin``'s results. ``base``: shape, class, routing, pass
    and sizes; ``timed``: implementation -> round_robin result (groupmm, torch, quack,
    loop, dense; any may be missing or failed); ``quack``: the selection pass
    (``{"config": chosen, "select": {config: ms or error}}``)."""
    impls = ("groupmm", "torch", "quack", "loop", "dense")
    ms = {k: (timed.get(k) or {}).get("ms") for k in impls}
    ms["bound"] = bound_ms

    def tf(t):
        return None if not t else flops / (t * 1e-3) / 1e12

    def over(a, b):  # speed of a over b (time of b / time of a)
        return None if not ms.get(a) or not ms.get(b) else ms[b] / ms[a]

    row = dict(base)
    row["ms"] = ms
    row["tflops"] = {k: tf(v) for k, v in ms.items()}
    row["spread_ms"] = {
        k: {q: timed[k][q] for q in ("min", "q1", "q3", "max")}
        for k in impls
        if timed.get(k) and timed[k].get("ms")
    }
    row["samples_ms"] = {k: timed[k]["samples"] for k in row["spread_ms"]}
    row["calls"] = {k: timed[k]["calls"] for k in row["spread_ms"]}
    row["host_us"] = {k: timed[k]["host_ms"] * 1e3 for k in row["spread_ms"]}
    row["mode"] = {k: timed[k]["mode"] for k in row["spread_ms"]}
    row["vs_quack"] = over("groupmm", "quack")
    row["vs_torch"] = over("groupmm", "torch")
    row["vs_dense"] = over("groupmm", "dense")
    row["roofline"] = None if not ms["groupmm"] else bound_ms / ms["groupmm"]
    row["roofline_peers"] = {
        k: bound_ms / ms[k] for k in ("torch", "quack") if ms.get(k) is not None
    }
    g = row["samples_ms"].get("groupmm")
    row["paired"] = {
        "vs_quack": paired(g, row["samples_ms"].get("quack")),
        "vs_torch": paired(g, row["samples_ms"].get("torch")),
    }
    row["quack_config"] = (quack or {}).get("config")
    row["quack_select"] = (quack or {}).get("select")
    row["errors"] = {
        k: timed[k].get("error") for k in impls if timed.get(k) and timed[k].get("error")
    }
    return row


def ratio(row: dict, key: str):
    """A row's ratio (vs_quack, vs_torch, roofline), recomputed from TFLOP/s for rows of
    JSON files written before these fields existed."""
    v = row.get(key)
    if v is not None or key == "roofline":
        return v
    t = row.get("tflops", {})
    peer = {"vs_quack": "quack", "vs_torch": "torch"}[key]
    return t["groupmm"] / t[peer] if t.get("groupmm") and t.get(peer) else None


def class_of(row: dict) -> str:
    """A row's class; JSON rows written before classes existed: derived from T and E."""
    return row.get("class") or row_class(row["E"], row["T"], row["T"] <= 1024)


def label(row: dict) -> str:
    return f"{row['shape']} {row['routing']} {row['pass']}"


def class_summary(rows) -> list:
    """Per class: rows, and for each ratio (vs quack, vs torch, of roofline) its count,
    geomean, min and the row holding the min; then each of issue 20's targets met or not."""
    out = []
    for c in CLASSES:
        rs = [r for r in rows if class_of(r) == c]
        if not rs:
            continue
        ent = {"class": c, "rows": len(rs), "stats": {}, "targets": []}
        for key in ("vs_quack", "vs_torch", "roofline"):
            vals = [(ratio(r, key), r) for r in rs if ratio(r, key)]
            if vals:
                lo = min(vals, key=lambda p: p[0])
                ent["stats"][key] = {
                    "n": len(vals),
                    "geomean": gmean([v for v, _ in vals]),
                    "min": lo[0],
                    "min_row": label(lo[1]),
                }
        for key, lab, thr, how in TARGETS.get(c, []):
            st = ent["stats"].get(key)
            val = None if st is None else st[how]
            ent["targets"].append(
                {
                    "what": f"{lab} {how}",
                    "target": thr,
                    "value": val,
                    "met": None if val is None else val >= thr,
                }
            )
        out.append(ent)
    return out


def summary(rows) -> str:
    """Per class: geomean and min of groupmm over quack, over torch and of the roofline,
    with issue 20's targets (a few lines of text; md_table.py prints it too)."""
    lines = []
    for ent in class_summary(rows):
        parts = []
        for key, lab in (
            ("vs_quack", "vs quack"),
            ("vs_torch", "vs torch"),
            ("roofline", "of roofline"),
        ):
            st = ent["stats"].get(key)
            if st:
                parts.append(
                    f"{lab}: geomean {st['geomean']:.2f}, min {st['min']:.2f} "
                    f"({st['min_row']}; {st['n']} rows)"
                )
        lines.append(f"{CLASS_TITLE[ent['class']]} ({ent['rows']} rows): " + "; ".join(parts))
        if ent["targets"]:
            lines.append(
                "  targets: "
                + ", ".join(
                    f"{t['what']} ≥ {t['target']:.2f}: {fmt(t['value'], '.2f')} {_mark(t['met'])}"
                    for t in ent["targets"]
                )
            )
    return "\n".join(lines) if lines else "no rows"


def format_row(row: dict) -> str:
    """One progress line: TFLOP/s per implementation (groupmm, torch and quack with ± half
    their min-max range over the rounds, in % of the median), the ratios."""
    t = row["tflops"]

    def cell(k):
        sp = _spread_pct(row, k)
        return f"{fmt(t.get(k)):>5}" + (f" ±{sp / 2:3.1f}%" if sp is not None else "       ")

    q = f" ({row['quack_config']})" if row.get("quack_config") else ""
    return (
        f"{row['shape']:19} {row['routing']:7} {row['pass']:7} {row['class']:6} "
        f"gmm {cell('groupmm')} torch {cell('torch')} quack {cell('quack')} "
        f"loop {fmt(t.get('loop')):>4} dense {fmt(t.get('dense')):>4} "
        f"bound {fmt(t.get('bound')):>4} | vs quack {fmt(row.get('vs_quack'), '.2f')} "
        f"vs torch {fmt(row.get('vs_torch'), '.2f')} roof {fmt(row.get('roofline'), '.2f')}{q}"
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions and timer of a result document."""
    gm = doc.get("groupmm") or {}
    gm_s = ", ".join(f"{k} {v}" for k, v in gm.items()) if isinstance(gm, dict) else str(gm)
    gm_s = gm_s or "not recorded"
    quack = (
        f"quack-kernels {doc.get('quack_version') or '(version not recorded)'}"
        + (f" (nvidia-cutlass-dsl {doc['cutlass_dsl']})" if doc.get("cutlass_dsl") else "")
        if doc.get("quack")
        else f"quack not measured ({doc.get('quack_why') or 'not in this run'})"
    )
    lines = [
        f"device {doc.get('device')}; torch {doc.get('torch')}, "
        f"CUDA {doc.get('cuda') or '(not recorded)'}; {quack}",
        f"groupmm build_info: {gm_s}",
    ]
    c = doc.get("ceilings")
    if c:
        lines.append(
            f"{doc.get('dtype')}; ceilings measured in this run: dense mm "
            f"{c['dense_flops'] / 1e12:.0f} TFLOP/s, copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s"
        )
    tm = doc.get("timer")
    if tm:
        lines.append(
            f"timer: round-robin over {tm['rounds']} rounds (quack config chosen over "
            f"{tm['select_rounds']} rounds first), "
            + (f"{tm['calls']} calls" if tm.get("calls") else f"~{tm['sample_ms']} ms")
            + f" per sample{', CUDA graphs' if tm.get('graph') else ''}; medians, spread min-max"
        )
    return lines


def render_md(doc: dict) -> str:
    """The result document as markdown: environment, summary per class, one table row per
    result row (TFLOP/s; ranges are min-max over the rounds, for the ratios round by
    round)."""
    out = ["**" + describe_env(doc)[0] + "**", ""]
    out += [ln + "  " for ln in describe_env(doc)[1:]]
    if doc.get("argv"):
        out += ["", "```bash", "python3 benches/bench_gpu.py " + " ".join(doc["argv"]), "```"]
    if not doc.get("complete", True):
        out += ["", "*(incomplete run: the rows measured so far)*"]
    rows = doc.get("rows", [])
    out += [
        "",
        "| class | rows | vs quack geomean | vs quack min | vs torch geomean | vs torch min "
        "| of roofline geomean | of roofline min | issue 20 targets |",
    ]
    out.append("| --- |" + " ---: |" * 7 + " --- |")
    for ent in class_summary(rows):
        st = ent["stats"]
        cells = [CLASS_TITLE[ent["class"]], str(ent["rows"])]
        for key in ("vs_quack", "vs_torch", "roofline"):
            s = st.get(key)
            cells += [fmt(s and s["geomean"], ".2f"), fmt(s and s["min"], ".2f")]
        cells.append(
            "; ".join(f"{t['what']} ≥ {t['target']:.2f} {_mark(t['met'])}" for t in ent["targets"])
        )
        out.append("| " + " | ".join(cells) + " |")

    def rng(r, k):
        sp, t = r.get("spread_ms", {}).get(k), r["tflops"].get(k)
        if t is None:
            return "-"
        if not sp:
            return f"{t:.0f}"
        f = r["tflops"][k] * r["ms"][k]  # TFLOP/s x ms: the row's work
        return f"{t:.0f} ({f / sp['max']:.0f}–{f / sp['min']:.0f})"

    def rr(r, key):
        v, p = ratio(r, key), (r.get("paired") or {}).get(key)
        if v is None:
            return "-"
        return f"{v:.2f}" + (f" ({p['min']:.2f}–{p['max']:.2f})" if p else "")

    out += [
        "",
        "| shape (E, K, N, T) | class | routing | pass | groupmm | F.grouped_mm | quack "
        "| quack config | loop of mm | dense mm | bound | vs quack | vs torch | of roofline |",
        "| --- | --- | --- | --- |" + " ---: |" * 3 + " --- |" + " ---: |" * 6,
    ]
    for r in rows:
        t = r["tflops"]
        cells = [
            f"{r['shape']} ({r['E']}, {r['K']}, {r['N']}, {r['T']})",
            class_of(r),
            r["routing"],
            r["pass"],
            rng(r, "groupmm"),
            rng(r, "torch"),
            rng(r, "quack"),
            r.get("quack_config") or "-",
            fmt(t.get("loop")),
            fmt(t.get("dense")),
            fmt(t.get("bound")),
            rr(r, "vs_quack"),
            rr(r, "vs_torch"),
            fmt(r.get("roofline"), ".2f"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    host = doc.get("host_us") or {}
    if host:
        out += ["", "host µs per small call: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
    if doc.get("skipped"):
        out += ["", "skipped: " + "; ".join(f"{s['shape']} ({s['why']})" for s in doc["skipped"])]
    return "\n".join(out) + "\n"


def render_png(doc: dict, path: str) -> bool:
    """TFLOP/s per row (bars with min-max whiskers) over the ratios per row; False when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc.get("rows", [])
    if not rows:
        return False
    n = len(rows)
    xs = list(range(n))
    fig, (ax, ax2) = plt.subplots(
        2,
        1,
        figsize=(min(60, max(12, 0.3 * n)), 9),
        sharex=True,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    peers = ["groupmm", "torch", "quack", "bound"]
    peers = [p for p in peers if any(r["tflops"].get(p) for r in rows)]
    wbar = 0.8 / len(peers)
    for i, who in enumerate(peers):
        vals, lo, hi = [], [], []
        for r in rows:
            v = r["tflops"].get(who) or 0.0
            sp = r.get("spread_ms", {}).get(who)
            vals.append(v)
            if sp and v:
                work = v * r["ms"][who]
                lo.append(v - work / sp["max"])
                hi.append(work / sp["min"] - v)
            else:
                lo.append(0.0)
                hi.append(0.0)
        ax.bar(
            [x + (i - (len(peers) - 1) / 2) * wbar for x in xs],
            vals,
            width=wbar,
            yerr=[lo, hi] if who != "bound" else None,
            error_kw={"elinewidth": 0.6, "capsize": 0},
            label={"bound": "roofline bound", "torch": "F.grouped_mm"}.get(who, who),
        )
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)
    ax.set_title("\n".join(ln[:160] for ln in describe_env(doc)[:3]), fontsize=8)
    for key, lab in (
        ("vs_quack", "groupmm / quack"),
        ("vs_torch", "groupmm / F.grouped_mm"),
        ("roofline", "groupmm of roofline"),
    ):
        ys = [ratio(r, key) for r in rows]
        if any(y is not None for y in ys):
            ax2.plot(xs, [float("nan") if y is None else y for y in ys], "o", ms=3, label=lab)
    ax2.axhline(1.0, color="k", lw=0.6)
    ax2.axhline(0.8, color="k", lw=0.4, ls=":")
    ax2.set_ylabel("ratio")
    ax2.legend(fontsize=8)
    ax2.set_xticks(xs)
    ax2.set_xticklabels(
        [f"{r['shape']} {r['routing'][:4]} {r['pass']} [{class_of(r)[0]}]" for r in rows],
        rotation=90,
        fontsize=6,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_outputs(doc: dict, args) -> None:
    """JSON and markdown of the result document (timing.write_outputs)."""
    timing_write(doc, args.json, args.md, render_md)


# ----------------------------------------------------------------------------------------
# the plan and its estimate (--dry-run; no GPU)


def plan_rows(names, passes, routings, quick) -> list:
    rows = []
    for name in names:
        s = SPECS[name]
        T = effective_T(s, quick)
        for routing in routings:
            for p in passes:
                rows.append((name, s, T, routing, p))
    return rows


def estimate_s(plan, args, quack: bool) -> dict:
    """A rough wall-time estimate of a plan on an H200 (GPU time of every sample, the
    warm-ups and the quack selection, plus host overhead; quack's JIT compiles assumed at
    EST_QUACK_JIT_S each): the budget check of --dry-run, not a measurement."""
    gpu, host = 0.0, 0.0  # ms of GPU, s of host
    forms = set()
    for _name, s, T, _routing, p in plan:
        flops = pass_mult(p) * 2.0 * T * s.K * s.N
        byts = nbytes_for(p, s.E, s.K, s.N, T, 2)
        t = max(flops / (0.6 * EST_RATE), byts / (0.75 * EST_BW)) * 1e3  # ms
        impl = {
            "groupmm": (t, 0.03),
            "torch": (t, 0.03),
            "dense": (flops / (0.85 * EST_RATE) * 1e3, 0.01),
        }
        if not args.no_loop and p != "fwd+bwd":
            impl["loop"] = (max(1.5 * t, s.E * 0.006), s.E * 0.008)
        q = quack and p != "fwd+bwd"
        if q:
            impl["quack"] = (t, 0.1)
            forms.add(p)
        calls = {
            k: args.calls or calls_for(v[0], args.sample_ms, args.min_calls, args.max_calls)
            for k, v in impl.items()
        }
        lead = max(lead_for(h, g, calls[k]) for k, (g, h) in impl.items())
        for k, (g, h) in impl.items():
            gpu += (args.warmup + 4) * max(g, h) + args.rounds * (calls[k] * g + lead)
        if q:
            gpu += len(QUACK_CONFIGS) * (
                (args.warmup + 4) * max(t, 0.1) + args.select_rounds * (calls["quack"] * t + lead)
            )
        samples = len(impl) * args.rounds + (len(QUACK_CONFIGS) * args.select_rounds if q else 0)
        host += 0.2 + 0.002 * samples  # tensors, closures, events, outputs (seconds)
    jit = len(forms) * len(QUACK_CONFIGS) * EST_QUACK_JIT_S
    shapes = len({name for name, *_ in plan})
    total = gpu / 1e3 + host + jit + 10 + 0.5 * shapes  # + ceilings, host cost; allocations
    return {"rows": len(plan), "gpu_s": gpu / 1e3, "host_s": host, "jit_s": jit, "total_s": total}


# ----------------------------------------------------------------------------------------
# GPU


def load_quack():
    """quack's gemm entry points and version, or (None, why)."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm, gemm_tuned
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return None, f"{type(e).__name__}: {str(e)[:100]}"
    from importlib.metadata import version

    ver = {}
    for dist, key in (("quack-kernels", "quack"), ("nvidia-cutlass-dsl", "cutlass")):
        try:
            ver[key] = version(dist)
        except Exception:  # noqa: BLE001 - installed without metadata (--target copies)
            ver[key] = None
    if not ver.get("quack"):
        import quack

        ver["quack"] = getattr(quack, "__version__", "unknown")
    return {"GemmConfig": GemmConfig, "gemm": gemm, "tuned": gemm_tuned, "version": ver}, None


_QUACK_FORMS_SEEN = set()


def quack_candidates(Q, a, b, kind, cu, oshape) -> dict:
    """config name -> callable computing the product with that configuration."""
    kw = {"cu_seqlens_m": cu} if kind == "m" else {"cu_seqlens_k": cu}
    cands = {}
    for name, cfg in QUACK_CONFIGS.items():
        if cfg is None:
            cands[name] = lambda: Q["gemm"](a, b, tuned=False, **kw)
            continue
        tm, tn, pp = cfg
        try:
            c = Q["GemmConfig"](
                tile_m=tm,
                tile_n=tn,
                pingpong=pp,
                cluster_m=1,
                cluster_n=1,
                is_dynamic_persistent=False,
                device_capacity=9,
            )
        except Exception:  # noqa: BLE001 - a config this quack cannot express: left out
            continue
        out = torch.empty(oshape, device=a.device, dtype=a.dtype)
        cands[name] = lambda c=c, out=out: Q["tuned"].fn(a, b, out, config=c, **kw)
    return cands


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
    from host_cost import per_call_us  # benches/host_cost.py, same folder

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


def quack_host_cost(Q, n=500):
    """Host µs per call of quack's default configuration on the same small packed forward."""
    from host_cost import per_call_us  # benches/host_cost.py, same folder

    E, K, N, T = 8, 128, 128, 256
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, T // E, device="cuda", dtype=torch.int32)
    return per_call_us(lambda: Q["gemm"](x, w, cu_seqlens_m=cu, tuned=False), n)


# ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument(
        "--shapes",
        default="all",
        help="comma list of shape names and groups: all, legacy (the seven of the README), "
        "fine, larger, decode (default all; --dry-run lists them)",
    )
    p.add_argument("--routing", default="uniform,zipf12", help="uniform, zipf12, skewed")
    p.add_argument("--passes", default="fwd,dX,dW", help="fwd, dX, dW, fwd+bwd")
    p.add_argument("--rounds", type=int, help="round-robin rounds per row (default 7; quick 3)")
    p.add_argument(
        "--select-rounds", type=int, help="rounds of quack's selection pass (default 3; quick 1)"
    )
    p.add_argument(
        "--sample-ms", type=float, help="target GPU ms of one sample (default 3; quick 2)"
    )
    p.add_argument("--calls", type=int, help="fixed back-to-back calls per sample")
    p.add_argument("--reps", type=int, help="old name of --calls")
    p.add_argument("--min-calls", type=int, default=3)
    p.add_argument("--max-calls", type=int, help="default 50; quick 20")
    p.add_argument("--warmup", type=int, default=2, help="calls before timing (JIT, caches)")
    p.add_argument("--graph", action="store_true", help="a sample = one CUDA graph replay")
    p.add_argument("--no-lead", action="store_true", help="no GPU spin before each sample")
    p.add_argument(
        "--isolated",
        action="store_true",
        help="one call per sample, the host waiting for each (launch latency inside)",
    )
    p.add_argument("--no-quack", action="store_true", help="leave quack out even if installed")
    p.add_argument("--no-loop", action="store_true", help="leave the loop of torch.mm out")
    p.add_argument("--quick", action="store_true", help="T/8 (not decode), fewer rounds")
    p.add_argument(
        "--budget-s", type=float, default=0, help="start no new shape after this many seconds"
    )
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--png")
    p.add_argument("--dry-run", action="store_true", help="print the rows and an estimate")
    p.add_argument("--from-json", help="render a result file (table, --md, --png); no GPU")
    args = p.parse_args(argv)
    q = args.quick
    if args.rounds is None:
        args.rounds = 3 if q else 7
    if args.select_rounds is None:
        args.select_rounds = 1 if q else 3
    if args.sample_ms is None:
        args.sample_ms = 2.0 if q else 3.0
    if args.max_calls is None:
        args.max_calls = 20 if q else 50
    if args.calls is None:
        args.calls = args.reps
    if min(args.rounds, args.select_rounds, args.min_calls, args.max_calls) < 1:
        p.error("rounds and calls must be at least 1")
    for lst, ok in ((args.routing, ROUTINGS), (args.passes, PASSES)):
        bad = [v for v in lst.split(",") if v not in ok]
        if bad:
            p.error(f"unknown {bad}; choose from {', '.join(ok)}")
    return args


def print_table(doc):
    print(f"\nTFLOP/s, {doc.get('dtype')}")
    for ln in describe_env(doc):
        print(ln)
    for r in doc.get("rows", []):
        print(format_row(r) if "class" in r else label(r))
    print("\n" + summary(doc.get("rows", [])))


def main(argv=None):
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        doc = json.load(open(args.from_json))
        for r in doc.get("rows", []):
            r.setdefault("class", class_of(r))
        print_table(doc)
        if args.md:
            with open(args.md, "w") as f:
                f.write(render_md(doc))
        if args.png and not render_png(doc, args.png):
            print("no chart (matplotlib missing, or no rows)")
        return 0

    names = select_shapes(args.shapes)
    routings = args.routing.split(",")
    passes = args.passes.split(",")
    plan = plan_rows(names, passes, routings, args.quick)
    if args.dry_run:
        for name, s, T, routing, p in plan:
            print(
                f"{name:19} {row_class(s.E, T, s.decode):6} {routing:7} {p:7} E={s.E:<3} "
                f"K={s.K:<5} N={s.N:<5} T={T:<6} rows/expert {T / s.E:7.1f}  {s.model}, {s.proj}"
            )
        est = estimate_s(plan, args, quack=not args.no_quack)
        print(
            f"{est['rows']} rows over {len(names)} shapes; estimated wall on an H200 "
            f"~{est['total_s']:.0f} s (samples and warm-ups ~{est['gpu_s']:.0f} s, quack JIT "
            f"~{est['jit_s']:.0f} s at an assumed {EST_QUACK_JIT_S:.0f} s per configuration "
            f"and pass form; a rough model, not a measurement)"
        )
        return 0

    import groupmm

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--dry-run or --from-json work on the CPU)")
        return 2
    t_start = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch_gmm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
        torch, "_grouped_mm", None
    )
    Q, why = (None, "--no-quack") if args.no_quack else load_quack()
    doc = {
        "schema": 2,
        "complete": False,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quack": Q is not None,
        "quack_version": Q["version"]["quack"] if Q else None,
        "cutlass_dsl": Q["version"].get("cutlass") if Q else None,
        "quack_why": why,
        "groupmm": groupmm.build_info(),
        "dtype": args.dtype,
        "timer": {
            "rounds": args.rounds,
            "select_rounds": args.select_rounds,
            "sample_ms": args.sample_ms,
            "calls": args.calls,
            "min_calls": args.min_calls,
            "max_calls": args.max_calls,
            "graph": args.graph,
            "lead": not args.no_lead,
            "isolated": args.isolated,
        },
        "rows": [],
        "skipped": [],
    }
    for ln in describe_env(doc)[:2]:
        print(ln)
    doc["ceilings"] = ceilings(dtype, args)
    torch.cuda.empty_cache()
    for ln in describe_env(doc)[2:]:
        print(ln)
    n_rows = len(plan)

    def on_row(row):
        doc["rows"].append(row)
        doc["elapsed_s"] = time.perf_counter() - t_start
        write_outputs(doc, args)  # after every row: a run cut short keeps what ran
        el = time.perf_counter() - t_start
        print(f"[{len(doc['rows']):3}/{n_rows} {el:5.0f}s] " + format_row(row))
        for who, err in row["errors"].items():
            if who in ("groupmm", "torch") or (who == "quack" and row.get("quack_select")):
                print(f"      {who}: {err}")

    for name in names:
        el = time.perf_counter() - t_start
        if args.budget_s and el > args.budget_s:
            doc["skipped"].append({"shape": name, "why": f"--budget-s {args.budget_s:.0f} spent"})
            print(f"skip {name}: budget of {args.budget_s:.0f} s spent")
            continue
        s = SPECS[name]
        T = effective_T(s, args.quick)
        t0 = time.perf_counter()
        print(
            f"== {name}: E={s.E} K={s.K} N={s.N} T={T} ({T / s.E:.0f} rows per expert, "
            f"{row_class(s.E, T, s.decode)}; {s.model}, {s.proj})"
        )
        try:
            run_shape(
                name,
                s,
                T,
                routings,
                passes,
                dtype,
                args,
                doc["ceilings"],
                torch_gmm,
                Q,
                on_row,
                DEV,
            )
        except torch.cuda.OutOfMemoryError as e:
            doc["skipped"].append({"shape": name, "why": f"out of memory: {str(e)[:80]}"})
            print(f"skip {name}: out of memory")
        torch.cuda.empty_cache()
        doc["elapsed_s"] = time.perf_counter() - t_start
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s")
        doc["summary"] = class_summary(doc["rows"])
        write_outputs(doc, args)

    doc["host_us"] = host_cost(torch_gmm)
    if Q:
        try:
            doc["host_us"]["quack fwd (default config)"] = quack_host_cost(Q)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"quack host cost: {type(e).__name__}: {str(e)[:80]}")
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - t_start
    doc["summary"] = class_summary(doc["rows"])
    write_outputs(doc, args)
    print_table(doc)
    print("host µs per small call: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["host_us"].items()))
    print(f"wall {doc['elapsed_s']:.0f} s")
    if args.png and not render_png(doc, args.png):
        print("no chart (matplotlib missing, or no rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
