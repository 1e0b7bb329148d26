"""bench_moe.py's rows, summaries and rendering: pure functions of numbers (CPU-tested).

A row (:func:`make_row`) holds per implementation (``IMPLS``) the median ms, its spread
and per-round samples, the peak bytes of a step, the output and gradient differences to
fused's, fused's speed and memory over each other implementation (:func:`ratios`,
``paired``: round by round) and why any has no figure; :func:`summarize` sums them up
over the rows; :func:`render_md` is the markdown table, :func:`render_png`
the chart, :func:`merge_docs` and :func:`upgrade_legacy` what ``--from-json`` reads.
"""

from __future__ import annotations

from harness.configs import PASSES
from harness.report import (
    build_info_text,
    chart,
    commands,
    differ,
    fmt,
    md_head,
    merge_runs,
    min_stats,
    no_figure_lines,
    save_png,
    timed_errors,
    timed_fields,
    with_spread,
)
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
    """One result row. ``timed``: implementation -> ``round_robin`` result (any may be
    missing or failed); ``peaks``: implementation -> peak bytes; ``diffs`` /
    ``grad_diffs``: relative differences to fused's output / gradients; ``errors``:
    implementation -> why it has no figure (merged with round_robin's errors)."""
    peaks, diffs, grad_diffs = peaks or {}, diffs or {}, grad_diffs or {}
    row = dict(base)
    row.update(timed_fields(timed, IMPLS))
    row["host_ms"] = {k: timed[k]["host_ms"] for k in row["spread_ms"]}
    row["peak_bytes"] = {k: peaks.get(k) for k in IMPLS}
    row["rel_diff"] = dict(diffs)
    row["grad_rel_diff"] = dict(grad_diffs)
    row.update(ratios(row))
    g = row["samples_ms"].get("fused")
    row["paired"] = {k: paired(g, row["samples_ms"].get(k)) for k in IMPLS if k != "fused"}
    row["errors"] = timed_errors(timed, IMPLS, errors)
    return row


def ratios(row: dict) -> dict:
    """fused's speed over each other implementation (their time over fused's: > 1 favours
    fused) and fused's peak memory over theirs (< 1: fused takes less)."""
    ms, pk = row.get("ms", {}), row.get("peak_bytes", {})
    f, pf = ms.get("fused"), pk.get("fused")
    speed = {k: (ms[k] / f if f and ms.get(k) else None) for k in IMPLS if k != "fused"}
    mem = {k: (pf / pk[k] if pf and pk.get(k) else None) for k in IMPLS if k != "fused"}
    return {"speed": speed, "mem": mem}


def label(row: dict) -> str:
    return f"{row['config']} T={row['T']} {row['routing']} {row['pass']}"


def summarize(rows) -> dict:
    """Over the fwd+bwd rows: fused's speed over SonicMoE, torch-gmm and plain (count,
    geomean, min and the row holding it, max) and fused's memory over SonicMoE's (max and
    the rows above 1)."""
    rs = [r for r in rows if r.get("pass", "fwd+bwd") == "fwd+bwd"]
    out = {"rows": len(rs), "speed": {}, "mem": {}}
    for k in ("sonicmoe", "torch-gmm", "plain", "groupmm"):
        vals = [(r["speed"][k], r) for r in rs if (r.get("speed") or {}).get(k)]
        if vals:
            out["speed"][k] = {**min_stats(vals, label), "max": max(v for v, _ in vals)}
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


def _mib(v):
    return "-" if v is None else f"{v / 2**20:.0f}"


def format_row(row: dict) -> str:
    """One progress line: ms per implementation (± half the min-max range over the
    rounds, in % of the median), fused's speed over each, peak MiB, SonicMoE's output
    difference to fused's."""

    def cell(k):
        return with_spread(row, k, row["ms"].get(k), ".3f", sep="")

    sp = row.get("speed") or {}
    pk = row.get("peak_bytes") or {}
    d = (row.get("rel_diff") or {}).get("sonicmoe")
    return (
        f"{row['config']:15} {row['T']:6} {row['routing']:7} {row['pass']:7} | ms "
        + " ".join(f"{k} {cell(k)}" for k in IMPLS)
        + " | fused speed / "
        + " ".join(f"{k} {fmt(sp.get(k))}" for k in IMPLS if k != "fused")
        + " | peak MiB "
        + " ".join(f"{k} {_mib(pk.get(k))}" for k in IMPLS)
        + (f" | sonic out diff {d:.1e}" if d is not None else "")
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions and timer of a result document."""
    gm_s = build_info_text(doc)
    ver = doc.get("versions") or {}
    stack = ", ".join(f"{k} {v or 'absent'}" for k, v in ver.items()) or "versions not recorded"
    if doc.get("sonicmoe"):
        sonic = f"SonicMoE measured ({stack})"
    else:
        sonic = f"SonicMoE not measured: {doc.get('sonicmoe_why') or 'not in this run'} ({stack})"
    lines = [
        f"device {doc.get('device')}; torch {doc.get('torch')}, "
        f"CUDA {doc.get('cuda') or '(not recorded)'}; {doc.get('dtype')}",
        sonic,
        f"groupmm build_info: {gm_s or 'not recorded'}",
    ]
    tm = doc.get("timer")
    if tm:
        per = f"{tm['calls']} steps" if tm.get("calls") else f"~{tm['sample_ms']:g} ms"
        lines.append(
            f"timer: round-robin over {tm['rounds']} rounds, {per} per sample, medians, "
            "spread min-max; SonicMoE warmed up (JIT compile, autotune) with one step per "
            "row before timing"
        )
    elif doc.get("legacy"):
        lines.append("timer: CUDA events per step, steps back to back, median (no interleaving)")
    return lines


def check_lines(rows) -> list:
    """Per implementation, the largest relative difference of its output and of its
    gradients to fused's over the rows, and where."""
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
    """The result document as markdown: environment, command, summary, one table row per
    result row (ms: median, and the min-max over the rounds in %; ratios: fused's speed
    over the others, ratio of medians and the range of the round-by-round ratios; bold
    where fused is slower than SonicMoE or takes more memory)."""
    out = md_head(describe_env(doc), doc, commands(doc, SCRIPT))
    rows = doc.get("rows", [])
    out += [""] + [ln + "  " for ln in summary_lines(rows)]

    def ms_cell(r, k):
        return with_spread(r, k, r["ms"].get(k), ".2f")

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
        # the host's time per fused step, bold where it is not below the GPU time (there
        # the GPU waits for the host)
        h, g = (r.get("host_ms") or {}).get("fused"), r["ms"].get("fused")
        if h is None:
            return "-"
        return f"**{h:.2f}**" if g is not None and h >= g else f"{h:.2f}"

    def mem_cell(r):
        pk = r.get("peak_bytes") or {}
        s = f"{_mib(pk.get('fused'))} / {_mib(pk.get('sonicmoe'))}"
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
            " / ".join(_mib(pk.get(k)) for k in ("groupmm", "torch-gmm", "plain")),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += no_figure_lines(rows, label, LABELS.__getitem__)
    checks = check_lines(rows)
    if checks:
        out += [""] + [ln + "  " for ln in checks]
    if doc.get("skipped"):
        out += ["", "skipped: " + "; ".join(f"{s['row']} ({s['why']})" for s in doc["skipped"])]
    return "\n".join(out) + "\n"


def render_png(doc: dict, path: str) -> bool:
    """ms per row and implementation (bars, min-max whiskers) over peak MiB; False when
    matplotlib is missing or there are no rows."""
    got = chart(doc)
    if got is None:
        return False
    plt, rows = got
    impls = [k for k in IMPLS if any(r["ms"].get(k) for r in rows)]
    if not impls:
        return False
    n = len(rows)
    xs = list(range(n))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.3 * n), 8), sharex=True)
    w = 0.8 / len(impls)
    for i, k in enumerate(impls):
        vals, lo, hi, mib = [], [], [], []
        for r in rows:
            v = r["ms"].get(k) or 0.0
            sp = (r.get("spread_ms") or {}).get(k)
            vals.append(v)
            lo.append(v - sp["min"] if sp and v else 0.0)
            hi.append(sp["max"] - v if sp and v else 0.0)
            mib.append(((r.get("peak_bytes") or {}).get(k) or 0) / 2**20)
        pos = [x + (i - (len(impls) - 1) / 2) * w for x in xs]
        ax.bar(pos, vals, w, yerr=[lo, hi], error_kw={"elinewidth": 0.6}, label=LABELS[k])
        ax2.bar(pos, mib, w, label=LABELS[k])
    ax.set_ylabel("ms per step (median, min-max)")
    ax2.set_ylabel("peak MiB above inputs")
    ax.legend(fontsize=8)
    title = describe_env(doc)[:2]
    title += commands(doc, SCRIPT)
    ax.set_title("\n".join(ln[:150] for ln in title), fontsize=8)
    ax2.set_xticks(xs)
    ax2.set_xticklabels(
        [f"{r['config']}\nT={r['T']} {r['routing']}\n{r['pass']}" for r in rows], fontsize=7
    )
    return save_png(plt, fig, path)


#: what must agree between runs merged into one table
ENV_KEYS = ("device", "torch", "cuda", "dtype", "groupmm", "sonicmoe", "versions", "timer")


def merge_docs(docs: list) -> dict:
    """Several result documents (e.g. one per device command) as one: rows in order,
    the command of each run, skipped rows that no other run measured, and the keys of
    ENV_KEYS that differ between the runs (``merged_differ``)."""
    if len(docs) == 1:
        return docs[0]
    out = merge_runs(docs)
    done = {label(r) for r in out["rows"]}
    out["skipped"] = [s for d in docs for s in d.get("skipped", []) if s["row"] not in done]
    out["merged_differ"] = differ(docs, out, ENV_KEYS)
    out["summary"] = summarize(out["rows"])
    return out


def upgrade_legacy(doc: dict) -> dict:
    """A result file of this bench before round-robin timing (rows with ``"<impl> fwd+bwd
    ms"`` keys) as a document of the current form: one fwd+bwd and one fwd row each."""
    if doc.get("schema"):
        return doc
    rows = []
    for old in doc.get("rows", []):
        for p in PASSES:
            r = {k: old[k] for k in ("config", "d_model", "d_ff", "experts", "top_k", "T")}
            r["routing"] = old.get("routing", "uniform")
            r["pass"] = p
            r["ms"] = {k: old.get(f"{k} {p} ms") for k in IMPLS}
            r["peak_bytes"] = {
                k: old.get(f"{k} peak bytes") if p == "fwd+bwd" else None for k in IMPLS
            }
            r["rel_diff"] = old.get("rel_diff") or {}
            r.update(ratios(r))
            rows.append(r)
    return {
        "schema": "moe-legacy",
        "legacy": True,
        "device": doc.get("device"),
        "torch": doc.get("torch"),
        "dtype": str(doc.get("dtype", "")).replace("torch.", ""),
        "sonicmoe": False,
        "sonicmoe_why": "not in this bench then",
        "rows": rows,
    }


def print_table(doc) -> None:
    print()
    for ln in describe_env(doc):
        print(ln)
    for r in doc.get("rows", []):
        print(format_row(r))
    for ln in summary_lines(doc.get("rows", [])):
        print(ln)
