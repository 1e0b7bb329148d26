"""bench_rows.py's rows, summaries and table: groupmm's fraction of the copy bandwidth."""

from __future__ import annotations

from harness import report as rp
from harness.report import fmt
from harness.timing import paired

OPS = ("combine", "sum", "gather", "scatter")
DTYPES = ("bf16", "fp16", "fp32")
#: the columns of a row's round-robin; copy is the reference of the fraction
IMPLS = ("groupmm", "torch", "copy")
#: groupmm / copy below this is flagged
FLAG = 0.85
#: the command every result document's argv follows
SCRIPT = "python3 benches/bench_rows.py"


def make_row(base: dict, timed: dict, chk=None, errors=None) -> dict:
    """One result row: ``base`` (a plan row), ``timed`` (implementation -> round_robin
    result; any may be missing or failed), ``chk`` (:func:`check`'s result, None when not
    checked), ``errors`` (implementation -> why it has no figure)."""
    row = dict(base)
    row.update(rp.timed_fields(timed, IMPLS))
    ms = row["ms"]
    row["host_ms"] = {k: timed[k]["host_ms"] for k in row["spread_ms"]}
    row["gbps"] = {k: (row["bytes"] / (ms[k] * 1e-3) / 1e9 if ms[k] else None) for k in IMPLS}
    g, c, t = ms["groupmm"], ms["copy"], ms["torch"]
    row["frac_copy"] = c / g if g and c else None
    row["speed_torch"] = t / g if g and t else None
    s = row["samples_ms"]
    row["paired"] = {
        "frac_copy": paired(s.get("groupmm"), s.get("copy")),
        "speed_torch": paired(s.get("groupmm"), s.get("torch")),
    }
    chk = chk or {}
    row["ok"] = chk.get("ok")
    row["check_err"] = chk.get("err")
    row["check_how"] = chk.get("how")
    row["errors"] = rp.timed_errors(timed, IMPLS, errors)
    return row


def label(row: dict) -> str:
    return f"{row['op']} {row['dtype']} T={row['T']} D={row['D']} k={row['k']}"


def flagged(row: dict) -> bool:
    f = row.get("frac_copy")
    return f is not None and f < FLAG


def summarize(rows) -> dict:
    """Per op: rows with a fraction, its min (and the row), geomean, max, the rows below
    FLAG; and the rows whose check failed."""
    out = {"ops": {}, "mismatch": [label(r) for r in rows if r.get("ok") is False]}
    for op in OPS:
        vals = [(r["frac_copy"], r) for r in rows if r["op"] == op and r.get("frac_copy")]
        if not vals:
            continue
        sp = [r["speed_torch"] for r in rows if r["op"] == op and r.get("speed_torch")]
        out["ops"][op] = {
            **rp.min_stats(vals, label),
            "max": max(v for v, _ in vals),
            "below": [label(r) for v, r in vals if v < FLAG],
            "speed_torch_geomean": rp.gmean(sp),
        }
    return out


def summary_lines(rows) -> list:
    s = summarize(rows)
    lines = []
    for op, st in s["ops"].items():
        lines.append(
            f"{op}: groupmm / copy min {st['min']:.2f} ({st['min_row']}), geomean "
            f"{st['geomean']:.2f}, {len(st['below'])} of {st['n']} rows below {FLAG:.2f}; "
            f"groupmm speed / torch geomean {fmt(st['speed_torch_geomean'])}"
        )
    checked = [r for r in rows if r.get("ok") is not None]
    if s["mismatch"]:
        lines.append(
            f"MISMATCH: groupmm differs from torch on {len(s['mismatch'])} of {len(checked)} "
            f"checked rows: {', '.join(s['mismatch'])}"
        )
    elif checked:
        lines.append(f"check: groupmm equals torch's equivalent on all {len(checked)} rows")
    return lines


def _mb(b) -> str:
    """Bytes as MB (1e6), two decimals below 1 MB."""
    return f"{b / 1e6:.1f}" if b >= 1e6 else f"{b / 1e6:.2f}"


def in_l2(row: dict, doc: dict) -> bool:
    l2 = doc.get("l2_bytes")
    return bool(l2) and row["bytes"] <= l2


def format_row(row: dict, doc=None) -> str:
    """One progress line: GB/s of each implementation (± half the min-max range over the
    rounds, in % of the median), the fraction of the copy, the speed over torch, the
    check."""

    def cell(k):
        return rp.with_spread(row, k, row["gbps"].get(k), ".0f", sep="")

    f = row.get("frac_copy")
    ok = {True: "ok", False: "MISMATCH", None: "not checked"}[row.get("ok")]
    l2 = " (in L2)" if doc and in_l2(row, doc) else ""
    return (
        f"{row['op']:7} {row['dtype']:4} T={row['T']:<5} D={row['D']:<4} k={row['k']:<2} "
        f"{_mb(row['bytes']):>9} MB{l2} | GB/s groupmm {cell('groupmm')} copy {cell('copy')}"
        f" torch {cell('torch')} | groupmm / copy {fmt(f)}"
        + (f" (below {FLAG:.2f})" if flagged(row) else "")
        + f" | speed / torch {fmt(row.get('speed_torch'))} | {ok}"
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions and timer of a result document."""
    gm_s = rp.build_info_text(doc)
    cap = doc.get("capability")
    l2 = doc.get("l2_bytes")
    dev = f"device {doc.get('device')}"
    if cap:
        dev += f" (sm_{cap[0]}{cap[1]}"
        dev += f", L2 {l2 / 2**20:.0f} MiB)" if l2 else ")"
    lines = [
        f"{dev}; torch {doc.get('torch')}, CUDA {doc.get('cuda') or '(not recorded)'}",
        f"groupmm build_info: {gm_s or 'not recorded'}",
    ]
    tm = doc.get("timer")
    if tm:
        lines.append(
            "timer: groupmm, torch and the copy (dst.copy_(src), bytes/2 uint8 each way) "
            + rp.timer_line(tm, "calls", " per row")
            + ", medians, spread min-max"
        )
    if doc.get("started"):
        lines.append(f"started {doc['started']}")
    return lines


def ordered(rows) -> list:
    """Rows for the table: by op (OPS order), dtype, T, D, k."""
    return sorted(
        rows, key=lambda r: (OPS.index(r["op"]), DTYPES.index(r["dtype"]), r["T"], r["D"], r["k"])
    )


TABLE_HEAD = (
    "| op | dtype | T | D | k | bytes (MB) | groupmm GB/s | copy GB/s | groupmm / copy "
    "| torch GB/s | groupmm speed / torch |"
)


def table_lines(doc: dict) -> list:
    """The markdown table: one line per row (GB/s: of the median time, ± half the min-max
    range over the rounds; ratios: of medians, with the range of the round-by-round ratios;
    groupmm / copy in bold below FLAG; bytes marked † where they fit in L2)."""

    def gb(r, k):
        return rp.with_spread(r, k, (r.get("gbps") or {}).get(k), ".0f")

    def ratio(r, name):
        v = r.get(name)
        if v is None:
            return "-"
        s = f"{v:.2f}"
        if name == "frac_copy" and v < FLAG:
            s = f"**{s}**"
        p = (r.get("paired") or {}).get(name)
        return s + (f" ({p['min']:.2f}–{p['max']:.2f})" if p else "")

    out = [TABLE_HEAD, "| --- | --- |" + " ---: |" * 9]
    for r in ordered(doc.get("rows", [])):
        mb = _mb(r["bytes"]) + (" †" if in_l2(r, doc) else "")
        cells = [
            r["op"],
            r["dtype"],
            str(r["T"]),
            str(r["D"]),
            str(r["k"]),
            mb,
            gb(r, "groupmm"),
            gb(r, "copy"),
            ratio(r, "frac_copy"),
            gb(r, "torch"),
            ratio(r, "speed_torch"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def render_md(doc: dict) -> str:
    """The result document as markdown: environment, command, summary, the table, then
    mismatches, implementations without a figure, skipped rows."""
    out = rp.md_head(describe_env(doc), doc, rp.commands(doc, SCRIPT))
    rows = doc.get("rows", [])
    out += [""] + [ln + "  " for ln in summary_lines(rows)]
    out += [""] + table_lines(doc)
    out += [
        "",
        f"bytes: the minimum the op must move (bench_rows.py, op_bytes); groupmm / copy = "
        f"copy ms / groupmm ms for those bytes, bold below {FLAG:.2f}; † the bytes fit in L2.",
    ]
    bad = [r for r in ordered(rows) if r.get("ok") is False]
    if bad:
        out += ["", "MISMATCH (groupmm's output differs from torch's):"]
        out += [
            f"- {label(r)}: {r.get('check_how')}, error {fmt(r.get('check_err'), '.2e')}"
            for r in bad
        ]
    out += rp.no_figure_lines(ordered(rows), label)
    out += rp.skipped_lines(doc)
    return "\n".join(out) + "\n"


#: what must agree between runs merged into one table
ENV_KEYS = ("device", "torch", "cuda", "groupmm", "timer")


def merge_docs(docs: list) -> dict:
    """Several documents as one; a row measured twice taken from the later file."""
    return rp.merge_docs(docs, label, ENV_KEYS, summarize, lambda r: label(r).split(" ", 1)[1])


def print_table(doc) -> None:
    lines = ["", *table_lines(doc), "", *summary_lines(doc.get("rows", []))]
    rp.print_doc(describe_env(doc), lines)
