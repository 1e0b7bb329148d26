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
  inverse.reshape(-1), grad.repeat_interleave(k, 0))`` (every row receives one add onto
  zero, so the result is exact);
- ``copy``: the reference of every row, ``dst.copy_(src)`` of two contiguous uint8 buffers
  of bytes/2 bytes each: it moves the op's bytes (read + write).

Bytes (:func:`op_bytes`, the one definition): the minimum the op must move, for every op:
each distinct input row read once, each output row written once, the int32 index and the
float32 weights read once (es = element size); nothing an implementation adds (scratch,
re-reads, temporaries) counts, so GB/s is an effective rate against that minimum:

- combine = (R + T)*D*es + R*4 (index) + R*4 (weights): R rows in, T rows out;
- sum = (R + T)*D*es + R*4;
- gather = (T + R)*D*es + R*4: the T source rows read once (each is routed k times), R
  rows written;
- scatter = (T + R)*D*es + R*4: T gradient rows read once, R rows written.

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

Code: ops, bytes, shapes and the check in benches/rows_ops.py, rows, summaries and
rendering in benches/rows_report.py, the timer and the result files in benches/timing.py
and benches/report.py.
"""

from __future__ import annotations

import sys
import time

import groupmm
import torch
from harness.cli import (
    add_output_args,
    add_rr_args,
    budget_spent,
    check_rr_args,
    comma_list,
    line_buffered_stdout,
    no_cuda,
    parser,
)
from harness.report import (
    error_text,
    fmt,
    from_json,
    record,
    run_doc,
)
from harness.report import write_outputs as report_write
from harness.timing import calls_for, lead_for, round_robin, rr_settings
from rows_ops import (
    DTYPES,
    OPS,
    Indices,
    build_op,
    check,
    label,
    plan_rows,
    routing_indices,
)
from rows_report import (
    describe_env,
    format_row,
    make_row,
    merge_docs,
    print_table,
    render_md,
    summarize,
)

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"

#: --dry-run's model (an H100; a budget check, not a measurement): copy bandwidth
#: (read + write), the floor of one kernel, groupmm's fraction of the copy, torch's time
#: over the copy's per op, host ms per call, Python and allocation per row
EST_BW, EST_FLOOR_MS, EST_FRAC = 2.8e12, 0.004, 0.8
EST_TORCH = {"combine": 5.0, "sum": 2.5, "gather": 1.1, "scatter": 3.0}
EST_HOST_MS = {"groupmm": 0.015, "torch": 0.06, "copy": 0.01}
EST_ROW_S = 0.25


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
        errors["groupmm"] = error_text(e, first_line=False)
        got, gm = None, None
    try:
        want = tc()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001
        errors["torch"] = error_text(e, first_line=False)
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
    return [int(v) for v in comma_list(s)] if s else None


def parse_args(argv=None):
    p = parser(__doc__)
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
    add_rr_args(p, rounds=5, sample_ms=5.0, min_calls=3, max_calls=100, graph=True)
    p.add_argument("--seed", type=int, default=0, help="seed of the routing and the data")
    add_output_args(p)
    args = p.parse_args(argv)
    check_rr_args(p, args)
    args.ops, args.dtypes = comma_list(args.ops), comma_list(args.dtypes)
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
    """JSON and markdown of the result document (report.write_outputs)."""
    report_write(doc, args.json, args.md, render_md)


def dry_run(plan, skipped, args) -> int:
    """--dry-run: the rows, the shapes left out and a rough estimate; no GPU."""
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


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, merge_docs, print_table, render_md)
        return 0

    plan, skipped = plan_rows(
        args.ops, args.dtypes, args.dims, args.topk, args.tokens, args.max_gib, args.quick
    )
    if args.dry_run:
        return dry_run(plan, skipped, args)
    if no_cuda():
        return 2
    t_start = time.perf_counter()
    dev = torch.device(DEV)
    doc = run_doc("rows-1", argv)
    doc.update(
        l2_bytes=_l2_bytes(),
        groupmm=groupmm.build_info(),
        max_gib=args.max_gib,
        seed=args.seed,
        timer=rr_settings(args),
        rows=[],
        skipped=list(skipped),
    )
    for ln in describe_env(doc):
        print(ln)
    for s in skipped:
        print(f"skip {s['row']}: {s['why']}")
    idx_key, idx = None, None
    for i, r in enumerate(plan):
        spent = budget_spent(args, t_start)
        if spent:
            doc["skipped"].append({"row": label(r), "why": spent})
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
        record(doc, t_start, summarize, lambda d: write_outputs(d, args), row)
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
    record(doc, t_start, summarize, lambda d: write_outputs(d, args))
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
