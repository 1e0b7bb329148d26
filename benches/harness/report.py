"""What the benches share besides the timer (benches/timing.py): the result document, its
JSON and markdown, ``--from-json``, the summary figures and the chart's frame, the text
of a failure. The command line they share is benches/cli.py's.

    from harness.report import write_outputs, ...

A result document (``doc``) is one JSON object: ``schema``, ``complete``, ``argv`` (or
``runs`` once several runs are merged), ``started``, the device and versions
(:func:`run_doc`), then the bench's ``rows`` and ``skipped``. A bench rewrites it after
every row (:func:`write_outputs`, atomically: a run cut short keeps what ran) and renders
it as markdown with its own ``render_md``, which starts with :func:`md_head`.
``--from-json`` (:func:`from_json`) reads one or more such files back (a comma list),
merges them (:func:`merge_runs` plus the bench's rule for rows) and renders them without
a GPU.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time

import torch

# ----------------------------------------------------------------------------------------
# text


def error_text(e: BaseException, width: int = 160, first_line: bool = True) -> str:
    """How a failure reads in a row or a line: ``Type: message``, the message's first line
    (or, ``first_line=False``, the whole message) cut to ``width`` characters."""
    msg = str(e).strip()
    if first_line:
        msg = (msg.splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg[:width]}"


def fmt(v, spec=".2f"):
    """A number in a table, "-" for None."""
    return "-" if v is None else format(v, spec)


def dist_version(dists, module=None, unknown="unknown (no package metadata)"):
    """The version of the first of ``dists`` with package metadata here; else, when
    ``module`` is given, that module's ``__version__`` or ``unknown`` (a source copy on
    PYTHONPATH); None when it is not installed."""
    from importlib.metadata import version

    for dist in dists:
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - no metadata under that name
            pass
    if module is None:
        return None
    try:
        import importlib

        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not importable: not installed here
        return None
    return getattr(mod, "__version__", None) or unknown


# ----------------------------------------------------------------------------------------
# the document


def started() -> str:
    """Now, as a result document's ``started`` (UTC, seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_doc(schema, argv) -> dict:
    """The head of a single-GPU bench's result document: schema, not yet complete, the
    command line (``argv``, or this process's), when, the device and torch's versions."""
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
    """The result document as compact JSON (the per-round samples make it large) and as
    markdown (``render_md(doc)``), each written atomically: a run killed mid-write keeps the
    previous file. A None path is skipped."""
    for path, text in (
        (json_path, lambda: json.dumps(doc, separators=(",", ":"))),
        (md_path, lambda: render_md(doc)),
    ):
        if path:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text())
            os.replace(tmp, path)


def load_docs(paths: str, upgrade=None) -> list:
    """The result documents of a comma list of JSON files (``--from-json``), each passed
    through ``upgrade`` (e.g. a reader of an older schema) when given."""
    docs = []
    for path in paths.split(","):
        with open(path) as fh:
            doc = json.load(fh)
        docs.append(upgrade(doc) if upgrade else doc)
    return docs


def merge_runs(docs: list) -> dict:
    """Several result documents as one: the first one's fields, the command of each run
    (``runs``), every run's rows in order, complete only when every run was; the bench's
    own rule (rows measured twice, skipped rows, ...) goes on from there."""
    out = dict(docs[0])
    out["runs"] = [argv for d in docs for argv in (d.get("runs") or [d.get("argv") or []])]
    out.pop("argv", None)
    out["rows"] = [r for d in docs for r in d.get("rows", [])]
    out["complete"] = all(d.get("complete", True) for d in docs)
    return out


def differ(docs: list, out: dict, keys) -> list:
    """The keys of ``keys`` on which the merged runs do not agree (``merged_differ``)."""
    return [k for k in keys if any(d.get(k) != out.get(k) for d in docs)]


def one_file(docs: list) -> dict:
    """The merge of a bench whose ``--from-json`` takes one file."""
    if len(docs) > 1:
        raise SystemExit("--from-json: this bench renders one file")
    return docs[0]


def from_json(args, merge, show, render_md, upgrade=None) -> dict:
    """``--from-json``: the files read (``upgrade``), merged (``merge(docs)``), shown
    (``show(doc)``: the table on stdout), the merged document to ``--json`` when there were
    several, its markdown to ``--md``. Returns the document."""
    docs = load_docs(args.from_json, upgrade)
    doc = merge(docs)
    show(doc)
    if getattr(args, "json", None) and len(docs) > 1:
        write_outputs(doc, args.json, None, render_md)
    write_outputs(doc, None, args.md, render_md)
    return doc


def record(doc: dict, t_start: float, summarize, write, row=None) -> None:
    """The document after a row (``row``, appended) or at the end (no row: complete):
    its elapsed seconds and summary (``summarize(rows)``) updated, then ``write(doc)``, so
    that a run cut short keeps what ran."""
    if row is None:
        doc["complete"] = True
    else:
        doc["rows"].append(row)
    doc["elapsed_s"] = time.perf_counter() - t_start
    doc["summary"] = summarize(doc["rows"])
    write(doc)


def chart(doc: dict):
    """``(pyplot, rows)`` for a chart of the document: matplotlib drawing to files (the Agg
    backend) and the document's rows; None where matplotlib is missing or there are no
    rows (a bench's --png then says there is no chart)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = doc.get("rows", [])
    return (plt, rows) if rows else None


def save_png(plt, fig, path) -> bool:
    """A chart's figure laid out, written to ``path`` and closed."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_png(render_png, doc: dict, path) -> None:
    """``--png``: the chart (``render_png(doc, path)``), or a line saying why there is none."""
    if path and not render_png(doc, path):
        print("no chart (matplotlib missing, or no rows)")


def commands(doc: dict, prefix: str = "") -> list:
    """The command line of each run a document holds, after ``prefix`` (the script)."""
    runs = doc.get("runs") or ([doc["argv"]] if doc.get("argv") is not None else [])
    return [" ".join([prefix, *argv] if prefix else argv) for argv in runs]


def md_head(env: list, doc: dict, cmds: list) -> list:
    """The markdown lines a result table starts with: the environment (``env``, the first
    line bold), the commands, and whether the runs differ or the run is incomplete."""
    out = ["**" + env[0] + "**", ""] + [ln + "  " for ln in env[1:]]
    if cmds:
        out += ["", "```bash", *cmds, "```"]
    if doc.get("merged_differ"):
        out += ["", f"*(merged runs differ in: {', '.join(doc['merged_differ'])})*"]
    if not doc.get("complete", True):
        out += ["", "*(incomplete run: the rows measured so far)*"]
    return out


def build_info_text(doc: dict) -> str:
    """groupmm's ``build_info()`` as a result document records it, in words."""
    gm = doc.get("groupmm") or {}
    return ", ".join(f"{k} {v}" for k, v in gm.items()) if isinstance(gm, dict) else str(gm)


# ----------------------------------------------------------------------------------------
# rows and summaries


def timed_fields(timed: dict, impls) -> dict:
    """A row's figures from ``round_robin``'s results (implementation -> result; any may
    be missing or failed): ``ms`` of every implementation (None without a figure) and, of
    those with one, the spread over the rounds, the per-round samples and the calls per
    sample."""
    ms = {k: (timed.get(k) or {}).get("ms") for k in impls}
    ok = [k for k in impls if ms[k]]
    return {
        "ms": ms,
        "spread_ms": {k: {q: timed[k][q] for q in ("min", "q1", "q3", "max")} for k in ok},
        "samples_ms": {k: timed[k]["samples"] for k in ok},
        "calls": {k: timed[k]["calls"] for k in ok},
    }


def timed_errors(timed: dict, impls, first=None) -> dict:
    """Why each implementation has no figure: the reasons of ``first`` that are set, then
    the errors ``round_robin`` reported."""
    errs = {k: v for k, v in (first or {}).items() if v}
    for k in impls:
        if timed.get(k) and timed[k].get("error"):
            errs.setdefault(k, timed[k]["error"])
    return errs


def gmean(v):
    """Geometric mean of positive values; None for none."""
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def min_stats(vals, label) -> dict:
    """Of ``(value, row)`` pairs (at least one): how many, their geometric mean, the least
    and the row holding it (``label(row)``)."""
    lo = min(vals, key=lambda p: p[0])
    return {
        "n": len(vals),
        "geomean": gmean([v for v, _ in vals]),
        "min": lo[0],
        "min_row": label(lo[1]),
    }


def spread_pct(row: dict, k: str):
    """The min-max spread of implementation k's samples in a result row, in % of its median."""
    sp, med = (row.get("spread_ms") or {}).get(k), row["ms"].get(k)
    if not sp or not med:
        return None
    return 100.0 * (sp["max"] - sp["min"]) / med


def with_spread(row: dict, k: str, v, spec: str, sep: str = " ") -> str:
    """Implementation k's figure ``v`` of a row as ``spec`` formats it, then (after
    ``sep``) ± half the min-max spread of its samples over the rounds, in % of the
    median; "-" for None."""
    if v is None:
        return "-"
    sp = spread_pct(row, k)
    return format(v, spec) + (f"{sep}±{sp / 2:.1f}%" if sp is not None else "")


def no_figure_lines(rows, label, name=lambda k: k) -> list:
    """The markdown lines that list the rows' ``errors`` (what had no figure and why),
    each reason once with up to three of its rows (``label(row)``; ``name(key)``: how an
    implementation is named); no lines when nothing failed."""
    errs: dict = {}
    for r in rows:
        for k, why in (r.get("errors") or {}).items():
            errs.setdefault((k, why), []).append(label(r))
    out = ["", "No figure:"] if errs else []
    for (k, why), where in errs.items():
        more = f", {len(where) - 3} more" if len(where) > 3 else ""
        out.append(f"- {name(k)}: {why} ({'; '.join(where[:3])}{more})")
    return out


#: elements of one slice of rel_diff (float32 copies of at most this many)
_CHUNK = 1 << 24


def rel_diff(a, b):
    """Relative Frobenius difference ``|a - b| / |b|`` in float32, a slice of dim 0 at a
    time (the expert-weight gradients are GBs); None when either is missing."""
    if a is None or b is None:
        return None
    num = den = 0.0
    step = max(1, _CHUNK // max(1, b[0].numel())) if b.dim() > 1 else b.numel()
    for i in range(0, b.shape[0], step):
        sa, sb = a[i : i + step].float(), b[i : i + step].float()
        num += float((sa - sb).square().sum())
        den += float(sb.square().sum())
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
