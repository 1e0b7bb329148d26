"""bench_ep.py's rows and tables: step times, EP efficiency, the split, exchanges, checks."""

from __future__ import annotations

import statistics

from harness import report as rp
from harness.report import fmt, md_row
from harness.timing import paired

#: the phases of a step, in table order
PHASES = ("dispatch", "experts", "combine")

#: the implementations, in table order (a result file's others are left out of its tables)
LABELS = {
    "fused": "groupmm fused",
    "fixed": "groupmm fused, fixed sizes",
    "pipelined": "groupmm fused, fixed sizes, pipelined",
    "torchtitan": "torchtitan",
    "whole": "whole layer, one GPU (ref)",
}
IMPLS = tuple(LABELS)
#: the reference on one GPU: no exchange, the whole step is experts
LOCAL = ("whole",)
#: the EP implementations, in table order (each has an EP efficiency against ``whole``)
EP_IMPLS = tuple(n for n in IMPLS if n not in LOCAL)
#: groupmm's fused EP paths, whose exchanges the row sizes (exact and fixed sizes)
EXCHANGED = ("fused", "fixed")
#: the all-to-all bandwidth measurements of a row, in table order
ALLTOALL = {
    "fixed": "all_to_all_single, fixed-size rows (W*T)",
    "exact": "all_to_all_single, exact dispatch rows",
}


def phases_of(ms, st: dict, ep: bool = True) -> dict:
    """One step's ``{"step", "dispatch", "experts", "combine"}`` ms from its stamps
    (``ms(a, b)``: ms between two stamps); an EP step missing a boundary has only
    ``step``; a non-EP step (``ep=False``) is all experts (no dispatch, no combine)."""
    out = {"step": ms(st["t0"], st["t1"])}
    if not ep:
        out["experts"] = out["step"]
        return out
    if not all(k in st for k in ("f1", "f2", "f3", "b2", "b1")):
        return out
    out["dispatch"] = ms(st["t0"], st["f1"]) + ms(st["b1"], st["t1"])
    out["experts"] = ms(st["f1"], st["f2"]) + ms(st["b2"], st["b1"])
    out["combine"] = ms(st["f2"], st["f3"]) + ms(st["f3"], st["b2"])
    return out


def exchange_sizes(ins: list, outs: list, row_bytes: int) -> dict:
    """The rows and bytes of one EP step's exchanges on every rank (``ins[r]``/``outs[r]``:
    the rows rank r sends to/receives from each rank in the forward dispatch, which the
    forward return sends back; the backward sends the same sizes the other way). Bytes: the
    ``[rows, d]`` rows (``row_bytes`` each) that leave the rank (not the ids and weights)."""
    out: dict = {"row_bytes": row_bytes}
    for key, splits in (("dispatch", ins), ("return", outs)):
        out[f"{key}_rows"] = [sum(s) for s in splits]
        out[f"{key}_bytes_off"] = [(sum(s) - s[r]) * row_bytes for r, s in enumerate(splits)]
    # the dispatch phase holds the forward dispatch and its gradient (the return's sizes);
    # the combine phase the forward return and its gradient (the dispatch's): the same sum
    off = [a + b for a, b in zip(out["dispatch_bytes_off"], out["return_bytes_off"])]
    out["phase_bytes_off"] = off
    out["step_bytes_off"] = [2 * v for v in off]
    return out


def alltoall_figures(rows: int, world: int, row_bytes: int, per_rank: list) -> dict:
    """One all-to-all of ``rows`` per rank (``per_rank[r]``: rank r's sample ms): the median
    of the slowest rank's samples, and the bytes leaving a rank over it (None at W = 1)."""
    n = min(len(p) for p in per_rank) if per_rank else 0
    worst = [max(p[i] for p in per_rank) for i in range(n)]
    ms = statistics.median(worst) if worst else None
    off = rows // world * (world - 1) * row_bytes
    return {
        "rows": rows,
        "bytes_off_rank": off,
        "ms": ms,
        "samples_ms": worst,
        "per_rank_ms": [statistics.median(p) if p else None for p in per_rank],
        "gb_per_s": off / ms / 1e6 if ms and off else None,
    }


def make_row(spec: dict, W: int, everyone: list, names: list, errors, check, dtype) -> dict:
    """The row from every rank's numbers: per implementation the step time, tokens/s per
    GPU, phases, EP efficiency, speed against torchtitan, exchanges; all-to-all bandwidth."""
    recv = [o["recv_rows"] for o in everyone]
    mean = sum(recv) / len(recv)
    row = dict(spec, world=W, dtype=dtype, recv_rows=recv)
    row["recv_imbalance"] = max(recv) / mean if mean else None
    impls = {}
    for n in names:
        per_round = []
        for r in range(len(everyone[0]["samples"][n])):
            vals = [o["samples"][n][r] for o in everyone]
            per_round.append(max(vals) if all(v is not None for v in vals) else None)
        got = [v for v in per_round if v is not None]
        step = statistics.median(got) if got else None
        per_rank_ph = [o["phases"].get(n, {}) for o in everyone]
        ph = {
            p: max(q[p] for q in per_rank_ph) if all(p in q for q in per_rank_ph) else None
            for p in PHASES
        }
        impls[n] = {
            "step_ms": step,
            "samples_ms": per_round,
            "spread_ms": {"min": min(got), "max": max(got)} if got else None,
            "tokens_per_s_per_gpu": spec["T"] / (step / 1e3) if step else None,
            "phases_ms": ph,
            "per_rank": [
                {"samples_ms": o["samples"][n], "phases_ms": o["phases"].get(n, {})}
                for o in everyone
            ],
        }
    tt, whole = impls.get("torchtitan"), impls.get("whole")
    for n, v in impls.items():
        ep = n not in LOCAL  # the references on one GPU are no EP step: no speed against them
        v["vs_torchtitan"] = (
            tt["step_ms"] / v["step_ms"] if ep and tt and tt["step_ms"] and v["step_ms"] else None
        )
        v["vs_torchtitan_rounds"] = (
            paired(v["samples_ms"], tt["samples_ms"]) if ep and tt and n != "torchtitan" else None
        )
        has_whole = ep and whole and whole["step_ms"] and v["step_ms"]
        v["ep_efficiency"] = whole["step_ms"] / v["step_ms"] if has_whole else None
        v["ep_efficiency_rounds"] = (
            paired(v["samples_ms"], whole["samples_ms"]) if has_whole else None
        )
    row_bytes = everyone[0].get("row_bytes")
    splits = [o.get("splits") for o in everyone]
    if row_bytes:
        T = spec["T"]
        sizes = {"fixed": ([[T] * W] * W, [[T] * W] * W)}
        if all(splits):
            sizes["fused"] = ([s["in"] for s in splits], [s["out"] for s in splits])
        for n in EXCHANGED:
            v = impls.get(n)
            if v is None or n not in sizes:
                continue
            x = exchange_sizes(*sizes[n], row_bytes)
            ms = v["phases_ms"].get("dispatch")
            mean = sum(x["phase_bytes_off"]) / W
            x["achieved_gb_per_s"] = mean / ms / 1e6 if ms and mean else None
            v["exchange"] = x
    a2a = [o.get("alltoall") for o in everyone]
    if row_bytes and all(a2a):
        row["alltoall"] = {
            key: alltoall_figures(a2a[0][key]["rows"], W, row_bytes, [a[key]["ms"] for a in a2a])
            for key in ALLTOALL
            if all(key in a for a in a2a)
        }
    row["impls"] = impls
    row["errors"] = errors
    row["check"] = check
    return row


def fmt_rate(v):
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k"


def label(row: dict) -> str:
    return f"{row['config']} {row['routing']} W={row['world']}"


def format_line(row: dict, name: str) -> str:
    """One progress line: an implementation's row of the step table."""
    v = row["impls"][name]
    ph = v["phases_ms"]
    cells = [config_cell(row), row["routing"], str(row["world"]), LABELS[name]]
    cells += [rp.ratio_range(v.get("ep_efficiency"), v.get("ep_efficiency_rounds"))]
    cells += [fmt(v["step_ms"]), fmt_rate(v["tokens_per_s_per_gpu"])]
    cells += [fmt(ph.get(q)) for q in PHASES]
    cells += [rp.ratio_range(v["vs_torchtitan"], v.get("vs_torchtitan_rounds"))]
    return md_row(cells + [fmt(row.get("recv_imbalance"))])


def bandwidth_lines(row: dict) -> list:
    """The row's lines of the bandwidth table: the all-to-all measurements and the
    exchanges of groupmm's fused EP paths."""
    head, out = [config_cell(row), row["routing"], str(row["world"])], []
    for key, what in ALLTOALL.items():
        a = (row.get("alltoall") or {}).get(key)
        if a:
            cells = [what, str(a["rows"]), "-", fmt_mb(a["bytes_off_rank"])]
            cells += [fmt(a["ms"], ".3f"), fmt_gbps(a["gb_per_s"])]
            out.append(md_row(head + cells))
    for n in EXCHANGED:
        x = (row["impls"].get(n) or {}).get("exchange")
        if not x:
            continue
        gb = x.get("achieved_gb_per_s")
        cells = [f"{LABELS[n]}: dispatch phase", fmt(_mean(x["dispatch_rows"]), ".0f")]
        cells += [fmt(_mean(x["return_rows"]), ".0f"), fmt_mb(_mean(x["phase_bytes_off"]))]
        cells += [fmt(row["impls"][n]["phases_ms"].get("dispatch"), ".3f")]
        cells += ["-" if gb is None else fmt_gbps(gb) + " (lower bound)"]
        out.append(md_row(head + cells))
    return out


def _mean(v):
    return sum(v) / len(v) if v else None


def fmt_gbps(v) -> str:
    """GB/s: one decimal, three significant digits below 10 (the CPU's tiny runs)."""
    return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def fmt_mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.3g}" if v < 1e5 else f"{v / 1e6:.1f}"


def describe(doc: dict) -> list:
    tt = doc.get("torchtitan") or {}
    tt_s = f"torchtitan not measured: {tt.get('why') or 'not in this run'}"
    if tt.get("used"):
        tt_s = f"torchtitan {tt.get('version')} ({tt.get('backend')} backend)"
    t, a2a = doc.get("timer") or {}, ""
    if t.get("a2a_samples"):
        a2a = f"; all_to_all_single: median of {t['a2a_samples']} samples per size"
    return [
        f"device {doc.get('device')} x {doc.get('world')} ({doc.get('backend')}); torch "
        f"{doc.get('torch')}, CUDA {doc.get('cuda') or '-'}; {doc.get('dtype')}; "
        f"{doc.get('tokens_per_gpu')} tokens per GPU",
        tt_s,
        f"timer: {t.get('clock')}; {t.get('warmup')} warm-up steps, {t.get('rounds')} "
        f"round-robin rounds of {t.get('calls')} steps per implementation; step = median over "
        "rounds of the slowest rank's sample; split: "
        + ("per step, at the phase boundaries, in the timed steps" if t.get("split") else "off")
        + a2a,
    ]


def render_md(doc: dict) -> str:
    """The result document as markdown: environment, commands, the EP efficiency table,
    the step table, the bandwidth table, errors, check."""
    out = rp.md_head(describe(doc), doc, rp.commands(doc))
    rows = doc.get("rows", [])
    out += efficiency_md(rows)
    out += [
        "",
        "| config (d, d_ff, E, k) | routing | W | impl | EP efficiency | step ms (max over "
        "ranks) | tokens/s/GPU | dispatch ms | experts ms | combine ms | speed vs torchtitan "
        "| recv rows max/mean |",
        "| --- | --- | ---: | --- |" + " ---: |" * 8,
    ]
    out += [format_line(r, n) for r in rows for n in IMPLS if n in r["impls"]]
    out += [
        "",
        "EP efficiency: the whole layer's step on one GPU (every expert, this rank's tokens, "
        "no exchange) over this implementation's (min–max of the round-by-round ratios); "
        "step ms: median over the rounds of the slowest rank's time per step (forward + "
        "backward); tokens/s/GPU: tokens per GPU / step; dispatch / experts / combine: "
        "medians per rank, the largest over ranks (a rank waiting for a slower one waits in "
        "its exchanges); speed vs torchtitan: torchtitan's step / this one's (min–max of the "
        "round-by-round ratios).",
    ]
    out += bandwidth_md(rows)
    out += rp.no_figure_lines(rows, label, lambda n: LABELS.get(n, n))
    checks = check_lines(rows)
    if checks:
        out += [""] + [ln + "  " for ln in checks]
    return "\n".join(out) + "\n"


def config_cell(r: dict) -> str:
    return f"{r['config']} ({r['d_model']}, {r['d_ff']}, {r['experts']}, {r['top_k']})"


def efficiency_md(rows) -> list:
    """The headline table: every EP implementation's efficiency per row; no lines when no
    row has one (e.g. a file written before it was measured)."""
    names = [
        n for n in EP_IMPLS if any((r["impls"].get(n) or {}).get("ep_efficiency") for r in rows)
    ]
    if not names:
        return []
    out = [
        "",
        "**EP efficiency** = the whole layer's step on one GPU (all E experts, the same "
        "tokens per GPU, no exchange) / the EP step (both the slowest rank's, median over "
        "the rounds); the goal is >= 0.90 on fine-grained configs.",
        "",
        "| config (d, d_ff, E, k) | routing | W | " + " | ".join(LABELS[n] for n in names) + " |",
        "| --- | --- | ---: |" + " ---: |" * len(names),
    ]
    for r in rows:
        cells = [config_cell(r), r["routing"], str(r["world"])]
        for n in names:
            e = (r["impls"].get(n) or {}).get("ep_efficiency")
            cells.append("-" if e is None else f"**{e:.2f}**")
        out.append(md_row(cells))
    return out


def bandwidth_md(rows) -> list:
    """The bandwidth table: per row the all-to-all measurements and the exchanges of
    groupmm's fused EP paths; no lines when no row has them."""
    lines = [ln for r in rows for ln in bandwidth_lines(r)]
    if not lines:
        return []
    return [
        "",
        "| config (d, d_ff, E, k) | routing | W | exchange | rows sent per rank | return "
        "rows per rank | off-rank MB per rank | ms | GB/s per rank |",
        "| --- | --- | ---: | --- |" + " ---: |" * 5,
        *lines,
        "",
        "all_to_all_single: equal splits of contiguous [rows, d] buffers in the bench's "
        "dtype, rows per rank: the fixed-size exchange's (W*T) or the fused plan's dispatch "
        "rows (mean over ranks, rounded to a multiple of W); ms: median over the samples of "
        "the slowest rank's; GB/s per rank: the bytes that leave a rank / ms. Fused paths: "
        "rows sent per rank (means over ranks) by the forward dispatch and the forward return "
        "(the backward sends the same sizes the other way); off-rank MB: the dispatch "
        "phase's (the forward dispatch and its gradient; the combine phase moves as much); "
        "GB/s: those bytes over the dispatch phase's ms, which include the dispatch's other "
        "work (a lower bound of the exchanges' bandwidth).",
    ]


def check_lines(rows) -> list:
    """Per implementation, the largest relative difference to the reference over the
    checked rows, and the failures."""
    worst: dict = {}
    fails = []
    for r in rows:
        c = r.get("check")
        if not c:
            continue
        for n, qs in c["vs_reference"].items():
            for q, v in qs.items():
                if v is not None and (n not in worst or v > worst[n][0]):
                    worst[n] = (v, f"{label(r)}, {q}")
        fails += [f"{label(r)}: {f}" for f in c.get("failed", [])]
    lines = [
        f"check {LABELS.get(n, n)} vs plain-torch reference: at most {v:.1e} ({where})"
        for n, (v, where) in worst.items()
    ]
    if fails:
        lines.append("CHECK FAILED: " + "; ".join(fails))
    elif worst:
        lines.append("check: every implementation within tolerance")
    return lines


def merge_docs(docs: list) -> dict:
    """Several result documents (e.g. W = 1, 2, 4) as one: rows in order, every command."""
    if len(docs) == 1:
        return docs[0]
    out = rp.merge_runs(docs)
    out["world"] = ",".join(str(d.get("world")) for d in docs)
    return out
