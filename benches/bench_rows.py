"""The MoE row ops on their own: the achieved bytes/s of groupmm's row kernels
(``groupmm._rows``), each as a fraction of the device-to-device copy bandwidth measured in
the same round-robin, and torch's equivalent, per op and shape.

    python3 benches/bench_rows.py [--ops combine,sum,gather,scatter] [--dims 768,2048]
        [--topk 1,8] [--tokens 4096,65536] [--dtypes bf16,fp16,fp32] [--rounds 5]
        [--max-gib 3] [--quick] [--budget-s SECONDS] [--json out.json] [--md out.md]
    python3 benches/bench_rows.py --dry-run [...]    # the rows and a time estimate; no GPU
    python3 benches/bench_rows.py --from-json a.json[,b.json] [--json merged.json]
        [--md out.md]                                # render (and merge) results; no GPU

Ops (each is a pass the fused MoE layer runs; R = T*k routed rows, D columns):

- ``combine``: ``gather_sum(y [R, D], inverse [T, k], weights float32 [T, k])`` -> [T, D],
  the weighted sum of each token's k rows (the forward's combine). torch:
  ``(y.index_select(0, inverse.reshape(-1)).view(T, k, D).float() * w.unsqueeze(-1))
  .sum(1).to(y.dtype)``;
- ``sum``: ``gather_sum(y, inverse, None)``, the same without weights (the backward's sum
  over the k copies). torch: ``y.index_select(0, inverse.reshape(-1)).view(T, k, D)
  .sum(1, dtype=torch.float32).to(y.dtype)``;
- ``gather``: ``gather_sum(x [T, D], src.view(-1, 1), None)`` -> [R, D], ``x[src]`` (the
  row gather of the forward's x and of dY; for k = 1 a permutation). torch:
  ``x.index_select(0, src)``;
- ``scatter``: ``scatter_rows(grad [T, D], inverse, None, R)`` -> [R, D],
  ``out[inverse[t, j]] = grad[t]``. torch: ``torch.zeros(R, D).index_add_(0,
  inverse.reshape(-1), grad.repeat_interleave(k, 0))`` (``index_add_``, as the issue names
  it; every row receives one add onto zero, so the result is exact);
- ``copy``: the reference of every row, ``dst.copy_(src)`` of two contiguous uint8 buffers
  of bytes/2 bytes each: it moves the op's bytes (read + write).

Bytes (:func:`op_bytes`, the one definition): what the op must move at the least: every
row it names read once, every output row written once, the int32 index read once and the
float32 weights read once (es = element size):

- combine = (R + T)*D*es + R*4 (index) + R*4 (weights);
- sum = (R + T)*D*es + R*4;
- gather = 2*R*D*es + R*4;
- scatter = 2*R*D*es + R*4 + 2*R*4: the kernel zeroes an int32 [R] scratch (the row each
  routed row comes from) and writes it before the row pass, counted here; the row pass
  reading it back (another R*4) is not.

groupmm GB/s and torch GB/s are these bytes over each one's median time (torch moves more:
its temporaries, so its figure is an effective rate); copy GB/s is the copy's; groupmm /
copy = copy ms / groupmm ms for the same bytes (the fraction of the copy bandwidth; rows
below 0.85 are flagged); groupmm speed / torch = torch ms / groupmm ms. Rows whose bytes fit
in the L2 cache (marked) run from L2 after the first call, op and copy alike.

Routing (:func:`routing_indices`): each token picks k distinct experts out of E =
max(k, 128) uniformly (a seeded generator, on the CPU); ``groupmm._glue.routes`` sorts the
copies stably by expert (as ``groupmm.moe`` does): ``src`` [R] the token of each sorted
copy, ``inverse`` [T, k] the sorted position of copy (t, j); both converted to int32 once,
outside the timing. Data: ``torch.randn`` rows, weights ``torch.rand`` normalised per token.

Shapes (:func:`plan_rows`): bf16 over D in {768, 2048, 4096, 7168}, k in {1, 2, 4, 8, 16},
T in {256, 4096, 16384, 65536}; fp16 and fp32 over D in {2048, 7168}, k in {1, 8}, T in
{4096, 65536} (an explicit --dims, --topk or --tokens applies to every dtype); skipped: a
shape whose largest tensor, the [R, D] rows, exceeds --max-gib, and at run time a row whose
allocation (inputs, both outputs, torch's temporaries, the copy buffers) would not fit the
free GPU memory (``torch.cuda.mem_get_info``). --quick: a handful of representative shapes.

Timing (benches/timing.py, ``round_robin``; these GPUs' clocks drift by up to ~10 % within
seconds): per row groupmm, torch and the copy run round-robin over --rounds rounds, the
start rotating each round; a sample is CUDA events around N back-to-back calls (N chosen
per implementation so a sample lasts about --sample-ms), each after the same GPU spin so
the host has enqueued the sample. Reported: medians, the min-max spread over the rounds,
and the two ratios also round by round (min-max).

Check: once per row, before timing, groupmm's output against torch's: relative Frobenius
error below 1e-2 (bf16; fp16 1e-3, fp32 1e-5) for combine and sum, exact equality for
gather and scatter; ``ok`` per row, a mismatch printed loudly.

Outputs: a line per row as it finishes, then the markdown table and a summary line per op
(min and geomean of groupmm / copy, rows below 0.85); --json and --md rewritten after
every row (a run cut short keeps what ran). Each names the device, the torch and CUDA
versions, groupmm's ``build_info()``, the command and when it started. --from-json renders
result files without a GPU; several, comma-separated, are merged into one table (a row
measured twice: the later file's).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from typing import NamedTuple

import groupmm
import torch
from groupmm._glue import routes
from groupmm._rows import gather_sum, scatter_rows
from report import (  # benches/report.py, same folder
    gmean,
    line_buffered_stdout,
    load_docs,
    no_figure_lines,
)
from report import spread_pct as _spread_pct
from report import write_outputs as timing_write
from timing import (  # benches/timing.py, same folder
    calls_for,
    lead_for,
    paired,
    round_robin,
    rr_settings,
)

# ----------------------------------------------------------------------------------------
# the plan

OPS = ("combine", "sum", "gather", "scatter")
#: the columns of a row's round-robin; copy is the reference of the fraction
IMPLS = ("groupmm", "torch", "copy")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
#: relative Frobenius error allowed between groupmm's and torch's combine / sum
TOL = {"bf16": 1e-2, "fp16": 1e-3, "fp32": 1e-5}
#: ops whose groupmm output must equal torch's exactly
EXACT = ("gather", "scatter")

DIMS = (768, 2048, 4096, 7168)
TOPK = (1, 2, 4, 8, 16)
TOKENS = (256, 4096, 16384, 65536)
#: fp16 and fp32 run this subset unless --dims / --topk / --tokens are given
SUBSET = {"dims": (2048, 7168), "topk": (1, 8), "tokens": (4096, 65536)}
#: --quick: (dtype, T, D, k): Qwen3-30B-A3B-like (D 2048, k 8) from a decode batch (T 256)
#: to T 65536, Qwen3-235B (4096, 8), DeepSeek-V3 (7168, 8), Mixtral (4096, 2), k = 16 at
#: D 768, k = 1 (a permutation gather), and fp16, fp32 at one shape
QUICK = (
    ("bf16", 256, 2048, 8),
    ("bf16", 4096, 2048, 8),
    ("bf16", 16384, 2048, 8),
    ("bf16", 65536, 2048, 8),
    ("bf16", 16384, 4096, 8),
    ("bf16", 4096, 7168, 8),
    ("bf16", 16384, 4096, 2),
    ("bf16", 16384, 768, 16),
    ("bf16", 65536, 4096, 1),
    ("fp16", 16384, 2048, 8),
    ("fp32", 16384, 2048, 8),
)
#: groupmm / copy below this is flagged
FLAG = 0.85
IDX_BYTES = 4  # int32 indices
W_BYTES = 4  # float32 weights

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"

#: --dry-run's model (an H100; a budget check, not a measurement): copy bandwidth
#: (read + write), the floor of one kernel, groupmm's fraction of the copy, torch's time
#: over the copy's per op, host ms per call, Python and allocation per row
EST_BW, EST_FLOOR_MS, EST_FRAC = 2.8e12, 0.004, 0.8
EST_TORCH = {"combine": 5.0, "sum": 2.5, "gather": 1.1, "scatter": 3.0}
EST_HOST_MS = {"groupmm": 0.015, "torch": 0.06, "copy": 0.01}
EST_ROW_S = 0.25


def num_experts(k: int) -> int:
    """E of the routing: 128, or k when k exceeds it."""
    return max(k, 128)


def op_bytes(op: str, T: int, D: int, k: int, es: int) -> int:
    """The bytes ``op`` must move for T tokens, D columns, top-k k, element size es (the
    module docstring's definition): rows read once, output rows written once, the int32
    index and the float32 weights read once; scatter also its int32 [R] scratch, zeroed
    and written (2*R*4)."""
    R = T * k
    if op == "combine":
        return (R + T) * D * es + R * IDX_BYTES + R * W_BYTES
    if op == "sum":
        return (R + T) * D * es + R * IDX_BYTES
    if op == "gather":
        return 2 * R * D * es + R * IDX_BYTES
    if op == "scatter":
        return 2 * R * D * es + R * IDX_BYTES + 2 * R * IDX_BYTES
    raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")


def largest_bytes(T: int, D: int, k: int, es: int) -> int:
    """The largest tensor of a shape: the [R, D] routed rows (every op reads or writes
    them; [T, D] is never larger)."""
    return max(T * k, T) * D * es


def alloc_bytes(op: str, T: int, D: int, k: int, es: int) -> int:
    """What a row allocates at most, an upper bound for the free-memory check: the op's
    inputs and int32 indices, groupmm's and torch's outputs, torch's temporaries (float32
    where it computes in float32) and the two copy buffers."""
    R = T * k
    rows, toks = R * D * es, T * D * es
    idx = 2 * R * IDX_BYTES  # src and inverse
    copy = 2 * (op_bytes(op, T, D, k, es) // 2)
    if op == "combine":  # y, w; out; index_select, .float(), the product, the f32 sum, out
        need = rows + R * W_BYTES + toks + rows + 2 * R * D * 4 + T * D * 4 + toks
    elif op == "sum":  # y; out; index_select, the f32 sum, out
        need = rows + toks + rows + T * D * 4 + toks
    elif op == "gather":  # x; out; torch's out
        need = toks + rows + rows
    elif op == "scatter":  # grad; out and scratch; repeat_interleave, torch's out
        need = toks + rows + R * IDX_BYTES + rows + rows
    else:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    return need + idx + copy


def plan_rows(
    ops=OPS,
    dtypes=("bf16", "fp16", "fp32"),
    dims=None,
    topk=None,
    tokens=None,
    max_gib: float = 3.0,
    quick: bool = False,
) -> tuple:
    """``(rows, skipped)``: the rows of a run in the order they run (per dtype, T, k, D,
    op) and the shapes left out, ``{"row", "why"}``, because their largest tensor exceeds
    ``max_gib`` GiB. ``dims``, ``topk``, ``tokens`` None: the defaults (bf16 all of DIMS,
    TOPK, TOKENS, fp16 and fp32 SUBSET); given, they apply to every dtype. ``quick``: the
    QUICK shapes of ``dtypes`` instead."""
    shapes = []
    for dt in dtypes:
        if quick:
            shapes += [(d, T, D, k) for d, T, D, k in QUICK if d == dt]
            continue
        sub = dt != "bf16"
        ds = dims or (SUBSET["dims"] if sub else DIMS)
        ks = topk or (SUBSET["topk"] if sub else TOPK)
        ts = tokens or (SUBSET["tokens"] if sub else TOKENS)
        shapes += [(dt, T, D, k) for T in ts for k in ks for D in ds]
    rows, skipped = [], []
    limit = max_gib * 2**30
    for dt, T, D, k in shapes:
        es = ELEMENT_SIZE[dt]
        big = largest_bytes(T, D, k, es)
        if big > limit:
            skipped.append(
                {
                    "row": f"{dt} T={T} D={D} k={k}",
                    "why": f"[R, D] is {big / 2**30:.2f} GiB > --max-gib {max_gib:g}",
                }
            )
            continue
        for op in ops:
            rows.append(
                {
                    "op": op,
                    "dtype": dt,
                    "T": T,
                    "D": D,
                    "k": k,
                    "R": T * k,
                    "E": num_experts(k),
                    "bytes": op_bytes(op, T, D, k, es),
                    "largest_bytes": big,
                    "alloc_bytes": alloc_bytes(op, T, D, k, es),
                }
            )
    return rows, skipped


def label(row: dict) -> str:
    return f"{row['op']} {row['dtype']} T={row['T']} D={row['D']} k={row['k']}"


def key(row: dict) -> tuple:
    return (row["op"], row["dtype"], row["T"], row["D"], row["k"])


# ----------------------------------------------------------------------------------------
# routing and the implementations


class Indices(NamedTuple):
    """The index side of one (T, k): int32 ``src`` [R] and ``inverse`` [T, k], the
    ``expert_ids`` [T, k] they come from, and E."""

    src: torch.Tensor
    inverse: torch.Tensor
    expert_ids: torch.Tensor
    num_experts: int


def routing_indices(T: int, k: int, seed: int = 0, device="cpu") -> Indices:
    """Uniform routing: each token's k distinct experts out of E = max(k, 128) (the k
    largest of E uniform draws: a uniformly random k-subset, from a generator seeded with
    ``seed``), then ``groupmm._glue.routes`` (a stable sort by expert) on ``device``; src
    and inverse as int32."""
    E = num_experts(k)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices.to(device)
    r = routes(ids, E)
    return Indices(r.src.to(torch.int32), r.inverse.to(torch.int32), ids, E)


def torch_combine(y, inverse, w):
    T, k = inverse.shape
    rows = y.index_select(0, inverse.reshape(-1)).view(T, k, y.shape[1])
    return (rows.float() * w.unsqueeze(-1)).sum(1).to(y.dtype)


def torch_sum(y, inverse):
    T, k = inverse.shape
    rows = y.index_select(0, inverse.reshape(-1)).view(T, k, y.shape[1])
    return rows.sum(1, dtype=torch.float32).to(y.dtype)


def torch_gather(x, src):
    return x.index_select(0, src)


def torch_scatter(grad, inverse, rows: int):
    out = torch.zeros(rows, grad.shape[1], device=grad.device, dtype=grad.dtype)
    return out.index_add_(0, inverse.reshape(-1), grad.repeat_interleave(inverse.shape[1], 0))


def build_op(op: str, T: int, D: int, k: int, dtype, idx: Indices, dev, seed: int = 0):
    """``(groupmm_fn, torch_fn)`` of one row on fresh random inputs (``torch.randn`` rows,
    ``torch.rand`` weights normalised per token), every index and view made here, outside
    the timed calls."""
    torch.manual_seed(seed + 7 * T + 131 * D + k)
    R, inv = T * k, idx.inverse
    if op in ("combine", "sum"):
        y = torch.randn(R, D, device=dev, dtype=dtype)
        if op == "sum":
            return (lambda: gather_sum(y, inv, None)), (lambda: torch_sum(y, inv))
        w = torch.rand(T, k, device=dev, dtype=torch.float32) + 0.05
        w = w / w.sum(-1, keepdim=True)
        return (lambda: gather_sum(y, inv, w)), (lambda: torch_combine(y, inv, w))
    x = torch.randn(T, D, device=dev, dtype=dtype)
    if op == "gather":
        src, src_col = idx.src, idx.src.view(-1, 1)
        return (lambda: gather_sum(x, src_col, None)), (lambda: torch_gather(x, src))
    if op == "scatter":
        return (lambda: scatter_rows(x, inv, None, R)), (lambda: torch_scatter(x, inv, R))
    raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")


#: elements of one slice of rel_diff (float32 copies of at most this many)
_CHUNK = 1 << 24


def rel_diff(a, b) -> float:
    """Relative Frobenius difference ``|a - b| / |b|`` in float32, a slice of dim 0 at a
    time."""
    num = den = 0.0
    step = max(1, _CHUNK // max(1, b[0].numel())) if b.dim() > 1 else b.numel()
    for i in range(0, b.shape[0], step):
        sa, sb = a[i : i + step].float(), b[i : i + step].float()
        num += float((sa - sb).square().sum())
        den += float(sb.square().sum())
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def check(op: str, dtype: str, got, want) -> dict:
    """``{"ok", "err", "how"}``: groupmm's output ``got`` against torch's ``want``."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return {
            "ok": False,
            "err": None,
            "how": f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} "
            f"{want.dtype}",
        }
    if op in EXACT:
        same = torch.equal(got, want)
        return {"ok": same, "err": 0.0 if same else rel_diff(got, want), "how": "exact"}
    err = rel_diff(got, want)
    return {"ok": err < TOL[dtype], "err": err, "how": f"rel err < {TOL[dtype]:g}"}


# ----------------------------------------------------------------------------------------
# rows, summaries and rendering: pure functions of numbers (CPU-tested)


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def make_row(base: dict, timed: dict, chk=None, errors=None) -> dict:
    """One result row: ``base`` (a plan row), ``timed`` (implementation -> round_robin
    result; any may be missing or failed), ``chk`` (:func:`check`'s result, None when not
    checked), ``errors`` (implementation -> why it has no figure)."""
    row = dict(base)
    ms = {k: (timed.get(k) or {}).get("ms") for k in IMPLS}
    ok_impls = [k for k in IMPLS if ms[k]]
    row["ms"] = ms
    row["spread_ms"] = {k: {q: timed[k][q] for q in ("min", "q1", "q3", "max")} for k in ok_impls}
    row["samples_ms"] = {k: timed[k]["samples"] for k in ok_impls}
    row["calls"] = {k: timed[k]["calls"] for k in ok_impls}
    row["host_ms"] = {k: timed[k]["host_ms"] for k in ok_impls}
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
    errs = {k: v for k, v in (errors or {}).items() if v}
    for k in IMPLS:
        if timed.get(k) and timed[k].get("error"):
            errs.setdefault(k, timed[k]["error"])
    row["errors"] = errs
    return row


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
        lo = min(vals, key=lambda p: p[0])
        sp = [r["speed_torch"] for r in rows if r["op"] == op and r.get("speed_torch")]
        out["ops"][op] = {
            "n": len(vals),
            "min": lo[0],
            "min_row": label(lo[1]),
            "geomean": gmean([v for v, _ in vals]),
            "max": max(v for v, _ in vals),
            "below": [label(r) for v, r in vals if v < FLAG],
            "speed_torch_geomean": gmean(sp),
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
        sp = _spread_pct(row, k)
        return fmt(row["gbps"].get(k), ".0f") + (f"±{sp / 2:.1f}%" if sp is not None else "")

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
    gm = doc.get("groupmm") or {}
    gm_s = ", ".join(f"{k} {v}" for k, v in gm.items()) if isinstance(gm, dict) else str(gm)
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
        per = f"{tm['calls']} calls" if tm.get("calls") else f"~{tm['sample_ms']:g} ms"
        lines.append(
            f"timer: groupmm, torch and the copy (dst.copy_(src), bytes/2 uint8 each way) "
            f"round-robin over {tm['rounds']} rounds per row, {per} per sample, medians, "
            "spread min-max"
        )
    if doc.get("started"):
        lines.append(f"started {doc['started']}")
    return lines


def commands(doc: dict) -> list:
    """The command line of each run a document holds."""
    runs = doc.get("runs") or ([doc["argv"]] if doc.get("argv") is not None else [])
    return [" ".join(["python3 benches/bench_rows.py", *argv]) for argv in runs]


def ordered(rows) -> list:
    """Rows for the table: by op (OPS order), dtype, T, D, k."""
    dts = list(DTYPES)

    def sort_key(r):
        return (OPS.index(r["op"]), dts.index(r["dtype"]), r["T"], r["D"], r["k"])

    return sorted(rows, key=sort_key)


TABLE_HEAD = (
    "| op | dtype | T | D | k | bytes (MB) | groupmm GB/s | copy GB/s | groupmm / copy "
    "| torch GB/s | groupmm speed / torch |"
)


def table_lines(doc: dict) -> list:
    """The markdown table: one line per row (GB/s: of the median time, ± half the min-max
    range over the rounds; ratios: of medians, with the range of the round-by-round ratios;
    groupmm / copy in bold below FLAG; bytes marked † where they fit in L2)."""

    def gb(r, k):
        v, sp = (r.get("gbps") or {}).get(k), _spread_pct(r, k)
        if v is None:
            return "-"
        return f"{v:.0f}" + (f" ±{sp / 2:.1f}%" if sp is not None else "")

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
    env = describe_env(doc)
    out = ["**" + env[0] + "**", ""] + [ln + "  " for ln in env[1:]]
    if commands(doc):
        out += ["", "```bash", *commands(doc), "```"]
    if doc.get("merged_differ"):
        out += ["", f"*(merged runs differ in: {', '.join(doc['merged_differ'])})*"]
    if not doc.get("complete", True):
        out += ["", "*(incomplete run: the rows measured so far)*"]
    rows = doc.get("rows", [])
    out += [""] + [ln + "  " for ln in summary_lines(rows)]
    out += [""] + table_lines(doc)
    out += [
        "",
        f"bytes: what the op must move (bench_rows.py, op_bytes); groupmm / copy = copy ms / "
        f"groupmm ms for those bytes, bold below {FLAG:.2f}; † the bytes fit in L2.",
    ]
    bad = [r for r in ordered(rows) if r.get("ok") is False]
    if bad:
        out += ["", "MISMATCH (groupmm's output differs from torch's):"]
        out += [
            f"- {label(r)}: {r.get('check_how')}, error {fmt(r.get('check_err'), '.2e')}"
            for r in bad
        ]
    out += no_figure_lines(ordered(rows), label)
    if doc.get("skipped"):
        out += ["", "skipped: " + "; ".join(f"{s['row']} ({s['why']})" for s in doc["skipped"])]
    return "\n".join(out) + "\n"


#: what must agree between runs merged into one table
ENV_KEYS = ("device", "torch", "cuda", "groupmm", "timer")


def merge_docs(docs: list) -> dict:
    """Several result documents as one: rows in order of first appearance, a row measured
    in several (same op, dtype, T, D, k) taken from the last; the command of each run;
    skipped rows that no run measured; the keys of ENV_KEYS that differ (``merged_differ``)."""
    if len(docs) == 1:
        return docs[0]
    out = dict(docs[0])
    out["runs"] = [argv for d in docs for argv in (d.get("runs") or [d.get("argv") or []])]
    out.pop("argv", None)
    by_key = {}
    for d in docs:
        for r in d.get("rows", []):
            by_key[key(r)] = r  # insertion order kept, value replaced by a later run
    out["rows"] = list(by_key.values())
    shapes = {f"{r['dtype']} T={r['T']} D={r['D']} k={r['k']}" for r in out["rows"]}
    done = {label(r) for r in out["rows"]} | shapes
    skipped, seen = [], set()
    for d in docs:
        for s in d.get("skipped", []):
            if s["row"] not in done and s["row"] not in seen:
                seen.add(s["row"])
                skipped.append(s)
    out["skipped"] = skipped
    out["complete"] = all(d.get("complete", True) for d in docs)
    out["merged_differ"] = [k for k in ENV_KEYS if any(d.get(k) != out.get(k) for d in docs)]
    out["summary"] = summarize(out["rows"])
    return out


# ----------------------------------------------------------------------------------------
# the plan's estimate (--dry-run; no GPU)


def estimate_row(row: dict, args) -> dict:
    """Modelled ms per call of each implementation and the wall seconds of the row: each
    implementation's warm-up, round_robin's 4 estimate calls and its samples, the spin
    before each sample, the check, and EST_ROW_S of Python and allocation."""
    copy_ms = max(EST_FLOOR_MS, row["bytes"] / EST_BW * 1e3)
    ms = {
        "groupmm": max(EST_FLOOR_MS, copy_ms / EST_FRAC),
        "torch": max(3 * EST_FLOOR_MS, copy_ms * EST_TORCH[row["op"]]),
        "copy": copy_ms,
    }
    calls = {
        k: args.calls or calls_for(v, args.sample_ms, args.min_calls, args.max_calls)
        for k, v in ms.items()
    }
    lead = min(50.0, max(lead_for(EST_HOST_MS[k], v, calls[k]) for k, v in ms.items()))
    gpu = sum((args.warmup + 4) * v + args.rounds * (calls[k] * v + lead) for k, v in ms.items())
    gpu += ms["groupmm"] + ms["torch"]  # the check
    return {"ms": ms, "s": gpu / 1e3 + EST_ROW_S}


def estimate_s(plan, args) -> float:
    return sum(estimate_row(r, args)["s"] for r in plan)


# ----------------------------------------------------------------------------------------
# GPU


def run_row(row: dict, idx: Indices, args, dev) -> dict:
    """Measure one row: build the op on fresh inputs, check groupmm against torch, then
    groupmm, torch and the copy of the same bytes round-robin."""
    dtype = DTYPES[row["dtype"]]
    gm, tc = build_op(row["op"], row["T"], row["D"], row["k"], dtype, idx, dev, args.seed)
    errors, chk = {}, None
    try:
        got = gm()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - reported in the row; torch and copy go on
        errors["groupmm"] = f"{type(e).__name__}: {str(e).strip()[:160]}"
        got, gm = None, None
    try:
        want = tc()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001
        errors["torch"] = f"{type(e).__name__}: {str(e).strip()[:160]}"
        want, tc = None, None
    if got is not None and want is not None:
        chk = check(row["op"], row["dtype"], got, want)
    elif got is None:
        chk = {"ok": False, "err": None, "how": f"groupmm raised: {errors['groupmm']}"}
    del got, want
    n = row["bytes"] // 2
    src = torch.empty(n, device=dev, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    timed, meta = round_robin(
        {"groupmm": gm, "torch": tc, "copy": lambda: dst.copy_(src)}, **rr_settings(args)
    )
    return make_row(dict(row, lead_ms=meta["lead_ms"]), timed, chk, errors)


def _l2_bytes():
    try:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
    except Exception:  # noqa: BLE001 - an older torch without the field
        return None


def _ints(s):
    return [int(v) for v in s.split(",") if v.strip()] if s else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    p.add_argument(
        "--dims", help="comma list of D (default 768,2048,4096,7168; fp16/fp32 a subset)"
    )
    p.add_argument("--topk", help="comma list of k (default 1,2,4,8,16; fp16/fp32 a subset)")
    p.add_argument(
        "--tokens", help="comma list of T (default 256,4096,16384,65536; fp16/fp32 a subset)"
    )
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma list of bf16, fp16, fp32")
    p.add_argument("--quick", action="store_true", help="a handful of representative shapes")
    p.add_argument("--max-gib", type=float, default=3.0, help="skip shapes whose [R, D] is larger")
    p.add_argument("--rounds", type=int, default=5, help="round-robin rounds per row")
    p.add_argument("--sample-ms", type=float, default=5.0, help="target GPU ms of a sample")
    p.add_argument("--calls", type=int, help="fixed back-to-back calls per sample")
    p.add_argument("--min-calls", type=int, default=3)
    p.add_argument("--max-calls", type=int, default=100)
    p.add_argument("--warmup", type=int, default=2, help="calls before timing, per row")
    p.add_argument("--graph", action="store_true", help="each sample one CUDA graph replay")
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and the data")
    p.add_argument(
        "--budget-s", type=float, default=0, help="start no new row after this many seconds"
    )
    p.add_argument("--json", help="results, rewritten after every row")
    p.add_argument("--md", help="the table in markdown, rewritten after every row")
    p.add_argument("--dry-run", action="store_true", help="print the rows and an estimate")
    p.add_argument(
        "--from-json",
        help="render result files (comma list: merged into one table; --md, and --json for "
        "the merged file); no GPU",
    )
    args = p.parse_args(argv)
    if min(args.rounds, args.min_calls, args.max_calls, args.warmup) < 1:
        p.error("rounds, calls and warmup must be at least 1")
    args.ops = [v.strip() for v in args.ops.split(",") if v.strip()]
    args.dtypes = [v.strip() for v in args.dtypes.split(",") if v.strip()]
    for lst, ok in ((args.ops, OPS), (args.dtypes, DTYPES)):
        bad = [v for v in lst if v not in ok]
        if bad or not lst:
            p.error(f"unknown or none {bad}; choose from {', '.join(ok)}")
    try:
        args.dims, args.topk, args.tokens = map(_ints, (args.dims, args.topk, args.tokens))
    except ValueError as e:
        p.error(f"--dims, --topk, --tokens: comma lists of integers ({e})")
    if any(v < 1 for lst in (args.dims, args.topk, args.tokens) if lst for v in lst):
        p.error("--dims, --topk, --tokens must be positive")
    return args


def write_outputs(doc: dict, args) -> None:
    """JSON and markdown of the result document (timing.write_outputs)."""
    timing_write(doc, args.json, args.md, render_md)


def print_table(doc) -> None:
    print()
    for ln in describe_env(doc):
        print(ln)
    print()
    for ln in table_lines(doc):
        print(ln)
    print()
    for ln in summary_lines(doc.get("rows", [])):
        print(ln)


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        docs = load_docs(args.from_json)
        doc = merge_docs(docs)
        print_table(doc)
        if args.json and len(docs) > 1:
            timing_write(doc, args.json, None, render_md)
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(render_md(doc))
        return 0

    plan, skipped = plan_rows(
        args.ops, args.dtypes, args.dims, args.topk, args.tokens, args.max_gib, args.quick
    )
    if args.dry_run:
        for r in plan:
            est = estimate_row(r, args)
            print(
                f"{r['op']:7} {r['dtype']:4} T={r['T']:<5} D={r['D']:<4} k={r['k']:<2} "
                f"R={r['R']:<7} E={r['E']:<3} {r['bytes'] / 1e6:9.1f} MB  "
                f"[R, D] {r['largest_bytes'] / 2**30:5.2f} GiB  "
                f"allocates <= {r['alloc_bytes'] / 2**30:5.2f} GiB  ~{est['s']:.2f} s"
            )
        for s in skipped:
            print(f"skip {s['row']}: {s['why']}")
        print(
            f"{len(plan)} rows ({len(skipped)} shapes skipped by --max-gib); estimated wall "
            f"on an H100 ~{estimate_s(plan, args):.0f} s (a rough model, not a measurement; "
            "rows that do not fit the free GPU memory are skipped at run time)"
        )
        return 0

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--dry-run or --from-json work on the CPU)")
        return 2
    t_start = time.perf_counter()
    dev = torch.device(DEV)
    doc = {
        "schema": "rows-1",
        "complete": False,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "l2_bytes": _l2_bytes(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "groupmm": groupmm.build_info(),
        "max_gib": args.max_gib,
        "seed": args.seed,
        "timer": rr_settings(args),
        "rows": [],
        "skipped": list(skipped),
    }
    for ln in describe_env(doc):
        print(ln)
    for s in skipped:
        print(f"skip {s['row']}: {s['why']}")
    idx_key, idx = None, None
    for i, r in enumerate(plan):
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            doc["skipped"].append({"row": label(r), "why": f"--budget-s {args.budget_s:g} spent"})
            print(f"skip {label(r)}: budget spent")
            continue
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        try:
            if idx_key != (r["T"], r["k"]):  # one routing per (T, k), reused over D and ops
                idx_key, idx = None, None
                idx = routing_indices(r["T"], r["k"], args.seed, dev)
                idx_key = (r["T"], r["k"])
            free, _total = torch.cuda.mem_get_info()
            need = int(r["alloc_bytes"] * 1.05) + (256 << 20)
            if need > free:
                why = f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
                doc["skipped"].append({"row": label(r), "why": why})
                print(f"skip {label(r)}: {why}")
                continue
            row = run_row(r, idx, args, dev)
        except torch.cuda.OutOfMemoryError as e:
            doc["skipped"].append({"row": label(r), "why": f"out of memory: {str(e)[:80]}"})
            print(f"skip {label(r)}: out of memory")
            continue
        doc["rows"].append(row)
        doc["elapsed_s"] = time.perf_counter() - t_start
        doc["summary"] = summarize(doc["rows"])
        write_outputs(doc, args)  # after every row: a run cut short keeps what ran
        print(f"[{i + 1:3}/{len(plan)} {doc['elapsed_s']:5.0f}s] " + format_row(row, doc))
        if row["ok"] is False:
            msg = (
                f"!!! MISMATCH {label(row)}: groupmm's output differs from torch's "
                f"({row['check_how']}, error {fmt(row['check_err'], '.2e')})"
            )
            print(msg)
            print(msg, file=sys.stderr)
        for who, err in row["errors"].items():
            print(f"      {who}: {err}")
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - t_start
    doc["summary"] = summarize(doc["rows"])
    write_outputs(doc, args)
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
