"""bench_moe.py's rows, summaries and tables: fused is the reference of every ratio."""

from __future__ import annotations

from harness import report as rp
from harness.report import fmt
from harness.timing import paired

#: the columns, in the order of the tables; fused is the reference of every ratio
IMPLS = ("fused", "groupmm", "torch-gmm", "plain", "sonicmoe")
LABELS = {
    "fused": "groupmm fused",
    "groupmm": "groupmm unfused",
    "torch-gmm": "torch-gmm",
    "plain": "plain",
    "sonicmoe": "SonicMoE",
}
#: parity: a speed ratio below it (fused slower) or a memory ratio above it (fused larger)
#: is set in bold in the tables
PARITY = 1.0
#: the command every result document's argv follows
SCRIPT = "python3 benches/bench_moe.py"


def make_row(base: dict, timed: dict, peaks=None, diffs=None, grad_diffs=None, errors=None):
    """One result row: ``round_robin``'s results, peak bytes, the output and gradient
    differences to fused's and why any implementation has no figure."""
    peaks, diffs, grad_diffs = peaks or {}, diffs or {}, grad_diffs or {}
    row = dict(base)
    row.update(rp.timed_fields(timed, IMPLS))
    row["host_ms"] = {k: timed[k]["host_ms"] for k in row["spread_ms"]}
    row["peak_bytes"] = {k: peaks.get(k) for k in IMPLS}
    row["rel_diff"] = dict(diffs)
    row["grad_rel_diff"] = dict(grad_diffs)
    row.update(ratios(row))
    g = row["samples_ms"].get("fused")
    row["paired"] = {k: paired(g, row["samples_ms"].get(k)) for k in IMPLS if k != "fused"}
    row["errors"] = rp.timed_errors(timed, IMPLS, errors)
    return row


def ratios(row: dict) -> dict:
    """fused's speed over each other (> 1 favours fused) and its peak memory over theirs."""
    ms, pk = row.get("ms", {}), row.get("peak_bytes", {})
    f, pf = ms.get("fused"), pk.get("fused")
    speed = {k: (ms[k] / f if f and ms.get(k) else None) for k in IMPLS if k != "fused"}
    mem = {k: (pf / pk[k] if pf and pk.get(k) else None) for k in IMPLS if k != "fused"}
    return {"speed": speed, "mem": mem}


def label(row: dict) -> str:
    return f"{row['config']} T={row['T']} {row['routing']} {row['pass']}"


def summarize(rows) -> dict:
    """Over the fwd+bwd rows: fused's speed and memory over each other implementation."""
    rs = [r for r in rows if r.get("pass", "fwd+bwd") == "fwd+bwd"]
    out = {"rows": len(rs), "speed": {}, "mem": {}}
    for k in ("sonicmoe", "torch-gmm", "plain", "groupmm"):
        vals = [(r["speed"][k], r) for r in rs if (r.get("speed") or {}).get(k)]
        if vals:
            out["speed"][k] = {**rp.min_stats(vals, label), "max": max(v for v, _ in vals)}
        mvals = [(r["mem"][k], r) for r in rs if (r.get("mem") or {}).get(k)]
        if mvals:
            out["mem"][k] = {
                "n": len(mvals),
                "max": max(v for v, _ in mvals),
                "over": [label(r) for v, r in mvals if v > PARITY],
            }
    return out


def summary_lines(rows) -> list:
    s = summarize(rows)
    lines = []
    for k, lab in (("sonicmoe", "SonicMoE"), ("torch-gmm", "torch-gmm"), ("plain", "plain")):
        st = s["speed"].get(k)
        if st:
            lines.append(
                f"fused speed / {lab}: geomean {st['geomean']:.2f}, min {st['min']:.2f} "
                f"({st['min_row']}), max {st['max']:.2f} over {st['n']} fwd+bwd rows"
            )
    m = s["mem"].get("sonicmoe")
    if m:
        over = f"; above SonicMoE's: {', '.join(m['over'])}" if m["over"] else ""
        lines.append(f"peak memory fused / SonicMoE: max {m['max']:.2f}{over}")
    return lines


def format_row(row: dict) -> str:
    """One progress line: ms, fused's speed over each, peak MiB, SonicMoE's difference."""

    def cell(k):
        return rp.with_spread(row, k, row["ms"].get(k), ".3f", sep="")

    sp = row.get("speed") or {}
    pk = row.get("peak_bytes") or {}
    d = (row.get("rel_diff") or {}).get("sonicmoe")
    return (
        f"{row['config']:15} {row['T']:6} {row['routing']:7} {row['pass']:7} | ms "
        + " ".join(f"{k} {cell(k)}" for k in IMPLS)
        + " | fused speed / "
        + " ".join(f"{k} {fmt(sp.get(k))}" for k in IMPLS if k != "fused")
        + " | peak MiB "
        + " ".join(f"{k} {rp.mib(pk.get(k))}" for k in IMPLS)
        + (f" | sonic out diff {d:.1e}" if d is not None else "")
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions and timer of a result document."""
    gm_s = rp.build_info_text(doc)
    ver = doc.get("versions") or {}
    stack = ", ".join(f"{k} {v or 'absent'}" for k, v in ver.items()) or "versions not recorded"
    if doc.get("sonicmoe"):
        sonic = f"SonicMoE measured ({stack})"
    else:
        sonic = f"SonicMoE not measured: {doc.get('sonicmoe_why') or 'not in this run'} ({stack})"
    lines = [
        rp.device_line(doc, f"; {doc.get('dtype')}"),
        sonic,
        f"groupmm build_info: {gm_s or 'not recorded'}",
    ]
    tm = doc.get("timer")
    if tm:
        lines.append(
            f"timer: {rp.timer_line(tm, 'steps')}, medians, spread min-max; SonicMoE warmed "
            "up (JIT compile, autotune) with one step per row before timing"
        )
    return lines


def check_lines(rows) -> list:
    """Per implementation, its largest output and gradient difference to fused's."""
    lines = []
    for k in IMPLS[1:]:
        out = [(r["rel_diff"][k], label(r)) for r in rows if (r.get("rel_diff") or {}).get(k)]
        grad = [
            (v, f"{label(r)}, d{name}")
            for r in rows
            for name, v in ((r.get("grad_rel_diff") or {}).get(k) or {}).items()
            if v is not None
        ]
        if out or grad:
            parts = []
            for what, best in (("output", out), ("gradients", grad)):
                if best:
                    v, where = max(best)
                    parts.append(f"{what} at most {v:.1e} ({where})")
            lines.append(f"{LABELS[k]} vs groupmm fused, relative difference: " + "; ".join(parts))
    return lines


def render_md(doc: dict) -> str:
    """Environment, command, summary, one line per row (bold where fused is slower than
    SonicMoE or takes more memory), errors, checks."""
    out = rp.md_head(describe_env(doc), doc, rp.commands(doc, SCRIPT))
    rows = doc.get("rows", [])
    out += [""] + [ln + "  " for ln in summary_lines(rows)]

    def ms_cell(r, k):
        return rp.with_spread(r, k, r["ms"].get(k), ".2f")

    def ratio_cell(r, k, target=None):
        v = (r.get("speed") or {}).get(k)
        if v is None:
            return "-"
        p = (r.get("paired") or {}).get(k)
        s = f"{v:.2f}"
        if target is not None and v < target and r["pass"] == "fwd+bwd":
            s = f"**{s}**"
        return s + (f" ({p['min']:.2f}–{p['max']:.2f})" if p else "")

    def host_cell(r):
        # bold where the host's time per step reaches the GPU's (the GPU waits for it)
        h, g = (r.get("host_ms") or {}).get("fused"), r["ms"].get("fused")
        if h is None:
            return "-"
        return f"**{h:.2f}**" if g is not None and h >= g else f"{h:.2f}"

    def mem_cell(r):
        pk = r.get("peak_bytes") or {}
        s = f"{rp.mib(pk.get('fused'))} / {rp.mib(pk.get('sonicmoe'))}"
        m = (r.get("mem") or {}).get("sonicmoe")
        return f"**{s}**" if m is not None and m > PARITY and r["pass"] == "fwd+bwd" else s

    out += [
        "",
        "| config (d, d_ff, E, k) | T | routing | pass | groupmm fused ms | fused host ms "
        "| groupmm unfused ms | torch-gmm ms | plain ms | SonicMoE ms | fused speed / SonicMoE "
        "| / torch-gmm | / plain | peak MiB fused / SonicMoE "
        "| peak MiB unfused / torch-gmm / plain |",
        "| --- | ---: | --- | --- |" + " ---: |" * 11,
    ]
    for r in rows:
        pk = r.get("peak_bytes") or {}
        cells = [
            f"{r['config']} ({r['d_model']}, {r['d_ff']}, {r['experts']}, {r['top_k']})",
            str(r["T"]),
            r["routing"],
            r["pass"],
            ms_cell(r, IMPLS[0]),
            host_cell(r),
            *(ms_cell(r, k) for k in IMPLS[1:]),
            ratio_cell(r, "sonicmoe", PARITY),
            ratio_cell(r, "torch-gmm"),
            ratio_cell(r, "plain"),
            mem_cell(r),
            " / ".join(rp.mib(pk.get(k)) for k in ("groupmm", "torch-gmm", "plain")),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += rp.no_figure_lines(rows, label, LABELS.__getitem__)
    checks = check_lines(rows)
    if checks:
        out += [""] + [ln + "  " for ln in checks]
    out += rp.skipped_lines(doc)
    return "\n".join(out) + "\n"


#: what must agree between runs merged into one table
ENV_KEYS = ("device", "torch", "cuda", "dtype", "groupmm", "sonicmoe", "versions", "timer")


def merge_docs(docs: list) -> dict:
    return rp.merge_docs(docs, label, ENV_KEYS, summarize)


def print_table(doc) -> None:
    rows = doc.get("rows", [])
    rp.print_doc(describe_env(doc), [*map(format_row, rows), *summary_lines(rows)])
