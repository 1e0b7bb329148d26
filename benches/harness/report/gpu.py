"""bench_gpu.py's rows, summaries and tables."""

from __future__ import annotations

from harness import report as rp
from harness.configs import CLASS_TITLE, CLASSES
from harness.report import fmt, md_row
from harness.timing import paired

SCRIPT = "python3 benches/bench_gpu.py"
IMPLS = ("groupmm", "torch", "quack", "loop", "dense")
RATIOS = (("vs_quack", "vs quack"), ("vs_torch", "vs torch"), ("roofline", "of roofline"))


def make_row(base: dict, timed: dict, bound_ms: float, flops: float, quack=None) -> dict:
    """One result row from ``round_robin``'s results (``quack``: its selection pass,
    ``{"config", "select"}``): ms, TFLOP/s, spread, ratios (also round by round), errors."""
    fields = rp.timed_fields(timed, IMPLS)
    ms = fields["ms"]
    ms["bound"] = bound_ms

    def over(a, b):  # speed of a over b
        return None if not ms.get(a) or not ms.get(b) else ms[b] / ms[a]

    row = dict(base, **fields)
    row["tflops"] = {k: None if not t else flops / (t * 1e-3) / 1e12 for k, t in ms.items()}
    row["host_us"] = {k: timed[k]["host_ms"] * 1e3 for k in row["spread_ms"]}
    row["mode"] = {k: timed[k]["mode"] for k in row["spread_ms"]}
    row.update(vs_quack=over("groupmm", "quack"), vs_torch=over("groupmm", "torch"))
    row["vs_dense"] = over("groupmm", "dense")
    row["roofline"] = None if not ms["groupmm"] else bound_ms / ms["groupmm"]
    row["roofline_peers"] = {k: bound_ms / ms[k] for k in ("torch", "quack") if ms.get(k)}
    g = row["samples_ms"].get("groupmm")
    row["paired"] = {f"vs_{k}": paired(g, row["samples_ms"].get(k)) for k in ("quack", "torch")}
    row["quack_config"] = (quack or {}).get("config")
    row["quack_select"] = (quack or {}).get("select")
    row["errors"] = rp.timed_errors(timed, IMPLS)
    return row


def label(row: dict) -> str:
    return f"{row['shape']} {row['routing']} {row['pass']}"


def class_summary(rows) -> list:
    """Per class: its rows and, per ratio, the count, geomean, min and the min's row."""
    out = []
    for c in CLASSES:
        rs = [r for r in rows if r["class"] == c]
        if rs:
            stats = {}
            for key, _ in RATIOS:
                vals = [(r[key], r) for r in rs if r.get(key)]
                if vals:
                    stats[key] = rp.min_stats(vals, label)
            out.append({"class": c, "rows": len(rs), "stats": stats})
    return out


def summary(rows) -> str:
    """Per class: geomean and min of groupmm over quack, over torch and of the roofline."""
    lines = []
    for ent in class_summary(rows):
        parts = [
            f"{lab}: geomean {st['geomean']:.2f}, min {st['min']:.2f} ({st['min_row']}; "
            f"{st['n']} rows)"
            for key, lab in RATIOS
            if (st := ent["stats"].get(key))
        ]
        lines.append(f"{CLASS_TITLE[ent['class']]} ({ent['rows']} rows): " + "; ".join(parts))
    return "\n".join(lines) if lines else "no rows"


def format_row(row: dict) -> str:
    """One progress line: TFLOP/s (± half the min-max range over the rounds), the ratios."""
    t = row["tflops"]

    def cell(k):
        sp = rp.spread_pct(row, k)
        return f"{fmt(t.get(k), '.0f'):>5}" + (f" ±{sp / 2:3.1f}%" if sp is not None else " " * 7)

    q = f" ({row['quack_config']})" if row.get("quack_config") else ""
    return (
        f"{row['shape']:19} {row['routing']:7} {row['pass']:7} {row['class']:6} "
        f"gmm {cell('groupmm')} torch {cell('torch')} quack {cell('quack')} "
        f"loop {fmt(t.get('loop'), '.0f'):>4} dense {fmt(t.get('dense'), '.0f'):>4} "
        f"bound {fmt(t.get('bound'), '.0f'):>4} | vs quack {fmt(row.get('vs_quack'))} "
        f"vs torch {fmt(row.get('vs_torch'))} roof {fmt(row.get('roofline'))}{q}"
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions, ceilings and timer of a result document."""
    if doc.get("quack"):
        cutlass = f" (nvidia-cutlass-dsl {doc['cutlass_dsl']})" if doc.get("cutlass_dsl") else ""
        ver = doc.get("quack_version") or "(version not recorded)"
        quack = f"quack-kernels {ver}{cutlass}"
    else:
        quack = f"quack not measured ({doc.get('quack_why') or 'not in this run'})"
    lines = [
        rp.device_line(doc, f"; {quack}"),
        f"groupmm build_info: {rp.build_info_text(doc) or 'not recorded'}",
    ]
    if c := doc.get("ceilings"):
        lines.append(
            f"{doc.get('dtype')}; ceilings measured in this run: dense mm "
            f"{c['dense_flops'] / 1e12:.0f} TFLOP/s, copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s"
        )
    if tm := doc.get("timer"):
        per = f"{tm['calls']} calls" if tm.get("calls") else f"~{tm['sample_ms']} ms"
        lines.append(
            f"timer: round-robin over {tm['rounds']} rounds (quack config chosen over "
            f"{tm['select_rounds']} rounds first), {per}"
            f" per sample{', CUDA graphs' if tm.get('graph') else ''}; medians, spread min-max"
        )
    return lines


def render_md(doc: dict) -> str:
    """Environment, the summary per class, one line per row (TFLOP/s with the min-max
    over the rounds; ratios with their round-by-round range)."""
    out = rp.md_head(describe_env(doc), doc, rp.commands(doc, SCRIPT) if doc.get("argv") else [])
    rows = doc.get("rows", [])
    out += [
        "",
        "| class | rows | vs quack geomean | vs quack min | vs torch geomean | vs torch min "
        "| of roofline geomean | of roofline min |",
        "| --- |" + " ---: |" * 7,
    ]
    for ent in class_summary(rows):
        cells = [CLASS_TITLE[ent["class"]], str(ent["rows"])]
        for key, _ in RATIOS:
            s = ent["stats"].get(key)
            cells += [fmt(s and s["geomean"]), fmt(s and s["min"])]
        out.append(md_row(cells))

    def rng(r, k):
        sp, t = r.get("spread_ms", {}).get(k), r["tflops"].get(k)
        if t is None or not sp:
            return fmt(t, ".0f")
        work = t * r["ms"][k]  # TFLOP/s x ms
        return f"{t:.0f} ({work / sp['max']:.0f}–{work / sp['min']:.0f})"

    out += [
        "",
        "| shape (E, K, N, T) | class | routing | pass | groupmm | F.grouped_mm | quack "
        "| quack config | loop of mm | dense mm | bound | vs quack | vs torch | of roofline |",
        "| --- | --- | --- | --- |" + " ---: |" * 3 + " --- |" + " ---: |" * 6,
    ]
    for r in rows:
        t, p = r["tflops"], r.get("paired") or {}
        cells = [f"{r['shape']} ({r['E']}, {r['K']}, {r['N']}, {r['T']})", r["class"]]
        cells += [r["routing"], r["pass"], *(rng(r, k) for k in ("groupmm", "torch", "quack"))]
        cells += [r.get("quack_config") or "-"]
        cells += [fmt(t.get(k), ".0f") for k in ("loop", "dense", "bound")]
        cells += [rp.ratio_range(r.get(k), p.get(k)) for k in ("vs_quack", "vs_torch")]
        out.append(md_row([*cells, fmt(r.get("roofline"))]))
    if host := doc.get("host_us"):
        out += ["", "host µs per small call: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items())]
    out += rp.skipped_lines(doc, "shape")
    return "\n".join(out) + "\n"


def render_png(doc: dict, path: str) -> bool:
    """TFLOP/s per row (min-max whiskers) over the ratios per row."""
    got = rp.chart(doc)
    if got is None:
        return False
    plt, rows = got
    xs = list(range(len(rows)))
    fig, (ax, ax2) = plt.subplots(
        2,
        1,
        figsize=(min(60, max(12, 0.3 * len(rows))), 9),
        sharex=True,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    peers = [
        p for p in ("groupmm", "torch", "quack", "bound") if any(r["tflops"].get(p) for r in rows)
    ]

    def whisker(r, k):
        sp, v = r.get("spread_ms", {}).get(k), r["tflops"].get(k)
        if not sp or not v or k == "bound":
            return None
        work = v * r["ms"][k]
        return (v - work / sp["max"], work / sp["min"] - v)

    labels = {"bound": "roofline bound", "torch": "F.grouped_mm"}
    rp.bars(ax, rows, peers, lambda r, k: r["tflops"].get(k), whisker, labels)
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)
    ax.set_title("\n".join(ln[:160] for ln in describe_env(doc)[:3]), fontsize=8)
    for key, lab in (
        ("vs_quack", "groupmm / quack"),
        ("vs_torch", "groupmm / F.grouped_mm"),
        ("roofline", "groupmm of roofline"),
    ):
        ys = [r.get(key) for r in rows]
        if any(y is not None for y in ys):
            ax2.plot(xs, [float("nan") if y is None else y for y in ys], "o", ms=3, label=lab)
    ax2.axhline(1.0, color="k", lw=0.6)
    ax2.axhline(0.8, color="k", lw=0.4, ls=":")
    ax2.set_ylabel("ratio")
    ax2.legend(fontsize=8)
    ax2.set_xticks(xs)
    ticks = [f"{r['shape']} {r['routing'][:4]} {r['pass']} [{r['class'][0]}]" for r in rows]
    ax2.set_xticklabels(ticks, rotation=90, fontsize=6)
    return rp.save_png(plt, fig, path)


def print_table(doc):
    print(f"\nTFLOP/s, {doc.get('dtype')}")
    print("\n".join(describe_env(doc)))
    for r in doc.get("rows", []):
        print(format_row(r))
    print("\n" + summary(doc.get("rows", [])))
