"""Result files and their rendering, shared by every bench (one module per bench's table
beside this one). A result document is one JSON object (``schema``, ``complete``, ``argv``
or ``runs``, ``started``, device and versions, ``rows``, ``skipped``), rewritten after
every row (:func:`write_outputs`); :func:`from_json` reads, merges and renders files.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time

import torch

# ---------------------------------------------------------------------------------- text


def error_text(e: BaseException, width: int = 160, first_line: bool = True) -> str:
    """``Type: message`` (its first line, or all of it), cut to ``width`` characters."""
    msg = str(e).strip()
    if first_line:
        msg = (msg.splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg[:width]}"


def fmt(v, spec=".2f"):
    """A number in a table, "-" for None."""
    return "-" if v is None else format(v, spec)


def md_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def mib(v) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def dist_version(dists, module=None, unknown="unknown (no package metadata)"):
    """The version of the first of ``dists`` installed; else ``module``'s ``__version__``
    (or ``unknown``) where it imports; None when it is not installed."""
    import importlib
    from importlib.metadata import version

    for dist in dists:
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - no metadata under that name
            pass
    if module is None:
        return None
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not installed here
        return None
    return getattr(mod, "__version__", None) or unknown


# ------------------------------------------------------------------------------ documents


def started() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_doc(schema, argv) -> dict:
    """The head of a single-GPU bench's result document."""
    return {
        "schema": schema,
        "complete": False,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": started(),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def write_outputs(doc: dict, json_path, md_path, render_md) -> None:
    """Compact JSON and ``render_md(doc)``, each written atomically; None paths skipped."""
    for path, text in (
        (json_path, lambda: json.dumps(doc, separators=(",", ":"))),
        (md_path, lambda: render_md(doc)),
    ):
        if path:
            with open(path + ".tmp", "w") as f:
                f.write(text())
            os.replace(path + ".tmp", path)


def load_docs(paths: str) -> list:
    """The documents of a comma list of JSON files."""
    docs = []
    for path in paths.split(","):
        with open(path) as fh:
            docs.append(json.load(fh))
    return docs


def merge_runs(docs: list) -> dict:
    """Several documents as one: the first one's fields, each run's command (``runs``),
    every run's rows in order, complete only when every run was."""
    out = dict(docs[0])
    out["runs"] = [argv for d in docs for argv in (d.get("runs") or [d.get("argv") or []])]
    out.pop("argv", None)
    out["rows"] = [r for d in docs for r in d.get("rows", [])]
    out["complete"] = all(d.get("complete", True) for d in docs)
    return out


def merge_docs(docs: list, key, env_keys, summarize, shape_of=None) -> dict:
    """:func:`merge_runs`, a row measured twice (same ``key(row)``) taken from the later
    file, the skipped rows no run measured (``shape_of(row)``: more names that count as
    measured), the ``env_keys`` on which the runs differ (``merged_differ``)."""
    if len(docs) == 1:
        return docs[0]
    out = merge_runs(docs)
    out["rows"] = list({key(r): r for r in out["rows"]}.values())
    done = {key(r) for r in out["rows"]} | {shape_of(r) for r in out["rows"] if shape_of}
    skipped = {}
    for s in (s for d in docs for s in d.get("skipped", [])):
        if s["row"] not in done:
            skipped.setdefault(s["row"], s)
    out["skipped"] = list(skipped.values())
    out["merged_differ"] = [k for k in env_keys if any(d.get(k) != out.get(k) for d in docs)]
    out["summary"] = summarize(out["rows"])
    return out


def one_file(docs: list) -> dict:
    if len(docs) > 1:
        raise SystemExit("--from-json: this bench renders one file")
    return docs[0]


def from_json(args, merge, show, render_md) -> dict:
    """``--from-json``: the files read, merged, shown on stdout (``show``), the merged
    document to ``--json`` when there were several, the markdown to ``--md``."""
    docs = load_docs(args.from_json)
    doc = merge(docs)
    show(doc)
    if getattr(args, "json", None) and len(docs) > 1:
        write_outputs(doc, args.json, None, render_md)
    write_outputs(doc, None, args.md, render_md)
    return doc


def record(doc: dict, t_start: float, summarize, write, row=None) -> None:
    """Append ``row`` (or, without one, mark the document complete), update its elapsed
    seconds and summary, then ``write(doc)``."""
    if row is None:
        doc["complete"] = True
    else:
        doc["rows"].append(row)
    doc["elapsed_s"] = time.perf_counter() - t_start
    doc["summary"] = summarize(doc["rows"])
    write(doc)


def skip(doc: dict, name: str, why: str, key: str = "row", said=None) -> None:
    """A row (or shape) not measured: listed under ``skipped`` with why, said on stdout."""
    doc["skipped"].append({key: name, "why": why})
    print(f"skip {name}: {said or why}")


def run_rows(doc, plan, args, t_start, label, measure, summarize, write, show) -> None:
    """A bench's rows in turn: none after ``--budget-s``; ``measure(row)`` (a result, or None
    when it skipped the row), out of memory a skip; each result recorded, its progress
    line (``show(result, prefix)``) and errors printed; then the document complete."""
    from harness.cli import budget_spent

    for i, r in enumerate(plan):
        if spent := budget_spent(args, t_start):
            skip(doc, label(r), spent, said="budget spent")
            continue
        try:
            row = measure(r)
        except torch.cuda.OutOfMemoryError as e:
            skip(doc, label(r), f"out of memory: {str(e)[:80]}", said="out of memory")
            continue
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if row is None:
            continue
        record(doc, t_start, summarize, write, row)
        show(row, f"[{i + 1:3}/{len(plan)} {doc['elapsed_s']:5.0f}s] ")
        for who, err in row["errors"].items():
            print(f"      {who}: {err}")
    record(doc, t_start, summarize, write)


def commands(doc: dict, prefix: str = "") -> list:
    """The command line of each run a document holds, after ``prefix`` (the script)."""
    runs = doc.get("runs") or ([doc["argv"]] if doc.get("argv") is not None else [])
    return [" ".join([prefix, *argv] if prefix else argv) for argv in runs]


def md_head(env: list, doc: dict, cmds: list) -> list:
    """The lines a table starts with: the environment (the first line bold), the
    commands, whether the merged runs differ or the run is incomplete."""
    out = ["**" + env[0] + "**", ""] + [ln + "  " for ln in env[1:]]
    if cmds:
        out += ["", "```bash", *cmds, "```"]
    if doc.get("merged_differ"):
        out += ["", f"*(merged runs differ in: {', '.join(doc['merged_differ'])})*"]
    if not doc.get("complete", True):
        out += ["", "*(incomplete run: the rows measured so far)*"]
    return out


def build_info_text(doc: dict) -> str:
    gm = doc.get("groupmm") or {}
    return ", ".join(f"{k} {v}" for k, v in gm.items()) if isinstance(gm, dict) else str(gm)


def device_line(doc: dict, tail: str = "") -> str:
    return (
        f"device {doc.get('device')}; torch {doc.get('torch')}, "
        f"CUDA {doc.get('cuda') or '(not recorded)'}" + tail
    )


def timer_line(tm: dict, unit: str = "calls", tail: str = "") -> str:
    per = f"{tm['calls']} {unit}" if tm.get("calls") else f"~{tm['sample_ms']:g} ms"
    return f"round-robin over {tm['rounds']} rounds{tail}, {per} per sample"


def print_doc(env: list, lines: list) -> None:
    print()
    for ln in env + lines:
        print(ln)


def skipped_lines(doc: dict, key: str = "row") -> list:
    s = doc.get("skipped")
    return ["", "skipped: " + "; ".join(f"{x[key]} ({x['why']})" for x in s)] if s else []


# ---------------------------------------------------------------------------------- charts


def chart(doc: dict):
    """``(pyplot, rows)`` drawing to files, or None without matplotlib or rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = doc.get("rows", [])
    return (plt, rows) if rows else None


def bars(ax, rows, names, value, spread_of, labels=None):
    """Bars of ``value(row, name)`` per row and name, whiskers ``spread_of(row, name)``
    (``(below, above)`` or None)."""
    xs, w = range(len(rows)), 0.8 / len(names)
    for i, k in enumerate(names):
        vals = [value(r, k) or 0.0 for r in rows]
        err = [spread_of(r, k) or (0.0, 0.0) for r in rows]
        ax.bar(
            [x + (i - (len(names) - 1) / 2) * w for x in xs],
            vals,
            width=w,
            yerr=[[e[0] for e in err], [e[1] for e in err]] if any(map(any, err)) else None,
            error_kw={"elinewidth": 0.6, "capsize": 0},
            label=(labels or {}).get(k, k),
        )


def write_png(render_png, doc: dict, path) -> None:
    """``--png``: the chart, or a line saying why there is none."""
    if path and not render_png(doc, path):
        print("no chart (matplotlib missing, or no rows)")


def save_png(plt, fig, path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------- rows and summaries


def timed_fields(timed: dict, impls) -> dict:
    """A row's figures from ``round_robin``'s results: ``ms`` of every implementation (None
    without one) and, of those with one, the spread, the per-round samples and the calls."""
    ms = {k: (timed.get(k) or {}).get("ms") for k in impls}
    ok = [k for k in impls if ms[k]]
    return {
        "ms": ms,
        "spread_ms": {k: {q: timed[k][q] for q in ("min", "q1", "q3", "max")} for k in ok},
        "samples_ms": {k: timed[k]["samples"] for k in ok},
        "calls": {k: timed[k]["calls"] for k in ok},
    }


def timed_errors(timed: dict, impls, first=None) -> dict:
    """Why each implementation has no figure: ``first``'s reasons, then round_robin's."""
    errs = {k: v for k, v in (first or {}).items() if v}
    for k in impls:
        if timed.get(k) and timed[k].get("error"):
            errs.setdefault(k, timed[k]["error"])
    return errs


def gmean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def min_stats(vals, label) -> dict:
    """Of ``(value, row)`` pairs: how many, their geomean, the least and its row's label."""
    lo = min(vals, key=lambda p: p[0])
    return {
        "n": len(vals),
        "geomean": gmean([v for v, _ in vals]),
        "min": lo[0],
        "min_row": label(lo[1]),
    }


def spread_pct(row: dict, k: str):
    """The min-max spread of k's samples in a row, in % of its median."""
    sp, med = (row.get("spread_ms") or {}).get(k), row["ms"].get(k)
    return 100.0 * (sp["max"] - sp["min"]) / med if sp and med else None


def with_spread(row: dict, k: str, v, spec: str, sep: str = " ") -> str:
    """``v`` as ``spec`` formats it, then ± half k's min-max spread in % of the median."""
    if v is None:
        return "-"
    sp = spread_pct(row, k)
    return format(v, spec) + (f"{sep}±{sp / 2:.1f}%" if sp is not None else "")


def ratio_range(v, p) -> str:
    """A ratio and, with round-by-round ratios ``p``, their min–max."""
    if v is None:
        return "-"
    return f"{v:.2f}" + (f" ({p['min']:.2f}–{p['max']:.2f})" if p else "")


def no_figure_lines(rows, label, name=lambda k: k) -> list:
    """Lines listing each reason a figure is missing once, with up to three of its rows."""
    errs: dict = {}
    for r in rows:
        for k, why in (r.get("errors") or {}).items():
            errs.setdefault((k, why), []).append(label(r))
    out = ["", "No figure:"] if errs else []
    for (k, why), where in errs.items():
        more = f", {len(where) - 3} more" if len(where) > 3 else ""
        out.append(f"- {name(k)}: {why} ({'; '.join(where[:3])}{more})")
    return out


#: elements of one slice of :func:`rel_diff`
_CHUNK = 1 << 24


def rel_diff(a, b):
    """``|a - b| / |b|`` (Frobenius), a slice of dim 0 at a time, in float32 (float64 for
    float64 tensors); None when either is missing."""
    if a is None or b is None:
        return None
    ct = torch.float64 if b.dtype == torch.float64 else torch.float32
    num = den = 0.0
    step = max(1, _CHUNK // max(1, b[0].numel())) if b.dim() > 1 else b.numel()
    for i in range(0, b.shape[0], step):
        sa, sb = a[i : i + step].to(ct), b[i : i + step].to(ct)
        num += float((sa - sb).square().sum())
        den += float(sb.square().sum())
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
