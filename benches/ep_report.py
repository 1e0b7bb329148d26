"""bench_ep.py's rows and rendering: pure functions of numbers (CPU-tested).

A row (:func:`make_row`) is one (config, routing) at W ranks from every rank's numbers:
per implementation the step time (median over the rounds of the slowest rank's sample),
tokens/s per GPU, the phase medians (largest over ranks), the speed against torchtitan
and the experts time against the single-GPU reference's; :func:`render_md` is the
markdown table, :func:`check_lines` the check's summary, :func:`merge_docs` what
``--from-json`` of several runs (e.g. W = 1, 2, 4) reads.
"""

from __future__ import annotations

import statistics

from ep_split import PHASES  # benches/ep_split.py, same folder
from report import commands, fmt, md_head, merge_runs, no_figure_lines
from timing import paired  # benches/timing.py, same folder

#: the implementations, in table order
IMPLS = ("fused", "unfused", "torchtitan", "tt_groupmm", "tt_seam", "single")
LABELS = {
    "fused": "groupmm fused",
    "unfused": "groupmm unfused",
    "torchtitan": "torchtitan",
    "tt_groupmm": "torchtitan + groupmm experts",
    "tt_seam": "torchtitan + groupmm products",
    "single": "single-GPU fused (ref)",
}


def make_row(spec: dict, W: int, everyone: list, names: list, errors, check, dtype) -> dict:
    """The row from every rank's numbers: per implementation the step time (median over
    the rounds of the slowest rank's sample), tokens/s per GPU, the phase medians (largest
    over ranks), the speed against torchtitan and the experts time against single's."""
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
    tt = impls.get("torchtitan")
    for n, v in impls.items():
        ep = n != "single"  # the single-GPU reference is no EP step: no speed against it
        v["vs_torchtitan"] = (
            tt["step_ms"] / v["step_ms"] if ep and tt and tt["step_ms"] and v["step_ms"] else None
        )
        v["vs_torchtitan_rounds"] = (
            paired(v["samples_ms"], tt["samples_ms"]) if ep and tt and n != "torchtitan" else None
        )
        ratios = []
        for o in everyone:
            mine, ref = o["phases"].get(n, {}), o["phases"].get("single", {})
            if mine.get("experts") and ref.get("experts"):
                ratios.append(mine["experts"] / ref["experts"])
        v["experts_vs_single_per_rank"] = ratios if len(ratios) == len(everyone) else None
        v["experts_vs_single"] = max(ratios) if len(ratios) == len(everyone) else None
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
    """One progress line: an implementation's numbers on a row."""
    v = row["impls"][name]
    ph = v["phases_ms"]
    return (
        f"{label(row):28} {name:10} step {fmt(v['step_ms'], '8.3f')} ms  "
        f"{fmt_rate(v['tokens_per_s_per_gpu']):>7} tok/s/GPU  "
        + " ".join(f"{p} {fmt(ph.get(p), '.3f')}" for p in PHASES)
        + f"  vs torchtitan {fmt(v['vs_torchtitan'])}x  experts/single "
        f"{fmt(v['experts_vs_single'])}"
    )


def describe(doc: dict) -> list:
    tt = doc.get("torchtitan") or {}
    tt_s = (
        f"torchtitan {tt.get('version')} ({tt.get('backend')} backend)"
        if tt.get("used")
        else f"torchtitan not measured: {tt.get('why') or 'not in this run'}"
    )
    t = doc.get("timer") or {}
    return [
        f"device {doc.get('device')} x {doc.get('world')} ({doc.get('backend')}); torch "
        f"{doc.get('torch')}, CUDA {doc.get('cuda') or '-'}; {doc.get('dtype')}; "
        f"{doc.get('tokens_per_gpu')} tokens per GPU",
        tt_s,
        f"timer: {t.get('clock')}; {t.get('warmup')} warm-up steps, {t.get('rounds')} "
        f"round-robin rounds of {t.get('calls')} steps per implementation; step = median over "
        "rounds of the slowest rank's sample; split: "
        + ("per step, at the phase boundaries, in the timed steps" if t.get("split") else "off"),
    ]


def render_md(doc: dict) -> str:
    """The result document as markdown: environment, commands, the table, errors, check."""
    out = md_head(describe(doc), doc, commands(doc))
    out += [
        "",
        "| config (d, d_ff, E, k) | routing | W | impl | step ms (max over ranks) "
        "| tokens/s/GPU | dispatch ms | experts ms | combine ms | speed vs torchtitan "
        "| experts / single-GPU | recv rows max/mean |",
        "| --- | --- | ---: | --- |" + " ---: |" * 8,
    ]
    for r in doc.get("rows", []):
        cfg = f"{r['config']} ({r['d_model']}, {r['d_ff']}, {r['experts']}, {r['top_k']})"
        for n in IMPLS:
            v = r["impls"].get(n)
            if v is None:
                continue
            ph = v["phases_ms"]
            p = v.get("vs_torchtitan_rounds")
            vs = fmt(v["vs_torchtitan"])
            if p:
                vs += f" ({p['min']:.2f}–{p['max']:.2f})"
            cells = [
                cfg,
                r["routing"],
                str(r["world"]),
                LABELS[n],
                fmt(v["step_ms"]),
                fmt_rate(v["tokens_per_s_per_gpu"]),
                *(fmt(ph.get(q)) for q in PHASES),
                vs,
                fmt(v["experts_vs_single"]),
                fmt(r.get("recv_imbalance")),
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "step ms: median over the rounds of the slowest rank's time per step (forward + "
        "backward); tokens/s/GPU: tokens per GPU / step; dispatch / experts / combine: "
        "medians per rank, the largest over ranks (a rank waiting for a slower one waits in "
        "its exchanges); speed vs torchtitan: torchtitan's step / this one's (min–max of the "
        "round-by-round ratios); experts / single-GPU: the experts time over the single-GPU "
        "fused block's on the same rank's received rows, the largest over ranks.",
    ]
    out += no_figure_lines(doc.get("rows", []), label, lambda n: LABELS.get(n, n))
    checks = check_lines(doc.get("rows", []))
    if checks:
        out += [""] + [ln + "  " for ln in checks]
    return "\n".join(out) + "\n"


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
    out = merge_runs(docs)
    out["world"] = ",".join(str(d.get("world")) for d in docs)
    return out
