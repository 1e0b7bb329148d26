"""bench_gpu.py's rows, summaries and rendering: pure functions of numbers (CPU-tested).

A row (:func:`make_row`) holds per implementation (groupmm, torch, quack, loop, dense)
the median ms and TFLOP/s, the spread and per-round samples, the ratios (vs quack, vs
torch, of the roofline; ``paired``: round by round) and why any has no figure;
:func:`class_summary` sums them up per class;
:func:`render_md` is the markdown (md_table.py's table comes from the same rows),
:func:`render_png` the chart.
"""

from __future__ import annotations

from gpu_shapes import CLASS_TITLE, CLASSES, row_class
from harness.report import (
    build_info_text,
    chart,
    commands,
    fmt,
    md_head,
    min_stats,
    save_png,
    spread_pct,
    timed_errors,
    timed_fields,
)
from harness.timing import paired

#: the command every result document's argv follows
SCRIPT = "python3 benches/bench_gpu.py"


def make_row(base: dict, timed: dict, bound_ms: float, flops: float, quack=None) -> dict:
    """One result row from ``round_robin``'s results. ``base``: shape, class, routing, pass
    and sizes; ``timed``: implementation -> round_robin result (groupmm, torch, quack,
    loop, dense; any may be missing or failed); ``quack``: the selection pass
    (``{"config": chosen, "select": {config: ms or error}}``)."""
    impls = ("groupmm", "torch", "quack", "loop", "dense")
    fields = timed_fields(timed, impls)
    ms = fields["ms"]
    ms["bound"] = bound_ms

    def tf(t):
        return None if not t else flops / (t * 1e-3) / 1e12

    def over(a, b):  # speed of a over b (time of b / time of a)
        return None if not ms.get(a) or not ms.get(b) else ms[b] / ms[a]

    row = dict(base)
    row["ms"] = ms
    row["tflops"] = {k: tf(v) for k, v in ms.items()}
    for key in ("spread_ms", "samples_ms", "calls"):
        row[key] = fields[key]
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
    row["errors"] = timed_errors(timed, impls)
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


def upgrade(doc: dict) -> dict:
    """A result document as --from-json renders it: rows of files written before classes
    existed get theirs (:func:`class_of`)."""
    for r in doc.get("rows", []):
        r.setdefault("class", class_of(r))
    return doc


def label(row: dict) -> str:
    return f"{row['shape']} {row['routing']} {row['pass']}"


def class_summary(rows) -> list:
    """Per class: rows, and for each ratio (vs quack, vs torch, of roofline) its count,
    geomean, min and the row holding the min."""
    out = []
    for c in CLASSES:
        rs = [r for r in rows if class_of(r) == c]
        if not rs:
            continue
        ent = {"class": c, "rows": len(rs), "stats": {}}
        for key in ("vs_quack", "vs_torch", "roofline"):
            vals = [(ratio(r, key), r) for r in rs if ratio(r, key)]
            if vals:
                ent["stats"][key] = min_stats(vals, label)
        out.append(ent)
    return out


def summary(rows) -> str:
    """Per class: geomean and min of groupmm over quack, over torch and of the roofline
    (a few lines of text; md_table.py prints it too)."""
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
    return "\n".join(lines) if lines else "no rows"


def format_row(row: dict) -> str:
    """One progress line: TFLOP/s per implementation (groupmm, torch and quack with ± half
    their min-max range over the rounds, in % of the median), the ratios."""
    t = row["tflops"]

    def cell(k):
        sp = spread_pct(row, k)
        return f"{fmt(t.get(k), '.0f'):>5}" + (f" ±{sp / 2:3.1f}%" if sp is not None else "       ")

    q = f" ({row['quack_config']})" if row.get("quack_config") else ""
    return (
        f"{row['shape']:19} {row['routing']:7} {row['pass']:7} {row['class']:6} "
        f"gmm {cell('groupmm')} torch {cell('torch')} quack {cell('quack')} "
        f"loop {fmt(t.get('loop'), '.0f'):>4} dense {fmt(t.get('dense'), '.0f'):>4} "
        f"bound {fmt(t.get('bound'), '.0f'):>4} | vs quack {fmt(row.get('vs_quack'), '.2f')} "
        f"vs torch {fmt(row.get('vs_torch'), '.2f')} roof {fmt(row.get('roofline'), '.2f')}{q}"
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions and timer of a result document."""
    gm_s = build_info_text(doc) or "not recorded"
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
    out = md_head(describe_env(doc), doc, commands(doc, SCRIPT) if doc.get("argv") else [])
    rows = doc.get("rows", [])
    out += [
        "",
        "| class | rows | vs quack geomean | vs quack min | vs torch geomean | vs torch min "
        "| of roofline geomean | of roofline min |",
    ]
    out.append("| --- |" + " ---: |" * 7)
    for ent in class_summary(rows):
        st = ent["stats"]
        cells = [CLASS_TITLE[ent["class"]], str(ent["rows"])]
        for key in ("vs_quack", "vs_torch", "roofline"):
            s = st.get(key)
            cells += [fmt(s and s["geomean"], ".2f"), fmt(s and s["min"], ".2f")]
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
            fmt(t.get("loop"), ".0f"),
            fmt(t.get("dense"), ".0f"),
            fmt(t.get("bound"), ".0f"),
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
    got = chart(doc)
    if got is None:
        return False
    plt, rows = got
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
    return save_png(plt, fig, path)


def print_table(doc):
    print(f"\nTFLOP/s, {doc.get('dtype')}")
    for ln in describe_env(doc):
        print(ln)
    for r in doc.get("rows", []):
        print(format_row(r) if "class" in r else label(r))
    print("\n" + summary(doc.get("rows", [])))
