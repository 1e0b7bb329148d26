"""GPU benchmark: groupmm against torch.nn.functional.grouped_mm, quack (the grouped GEMM of
SonicMoE, when installed), a loop of torch.mm and a dense torch.mm of the same FLOPs, with
each row's roofline bound: every column measured in one process, row by row interleaved.

    python3 benches/bench_gpu.py [--shapes all|fine|decode|larger|legacy|NAME,...]
        [--routing uniform,zipf12] [--passes fwd,dX,dW] [--rounds 7] [--select-rounds 3]
        [--quick] [--no-quack] [--no-loop] [--graph] [--budget-s SECONDS]
        [--json out.json] [--md out.md] [--png out.png]
    python3 benches/bench_gpu.py --dry-run [...]     # the rows and a time estimate; no GPU
    python3 benches/bench_gpu.py --from-json out.json [--md out.md] [--png out.png]

Timing (benches/timing.py, ``round_robin``; the clocks of these GPUs drift by up to ~10 %
within seconds): per row, the implementations run round-robin over --rounds rounds, the
start rotating each round; a sample is CUDA events around N back-to-back calls (N chosen per
implementation so a sample lasts ~--sample-ms, or fixed with --calls; --graph: one CUDA
graph replay of the N calls where capture works), each sample preceded by the same GPU spin,
long enough for the host to enqueue the sample, so every figure is GPU time (quack's
Python planning included only if the GPU waited for it, which the spin prevents). Reported:
the median per implementation and its spread (min-max over the rounds), and each ratio both
as a ratio of medians and round by round (min-max of the per-round ratios). quack's
configuration is chosen per row in a separate pass first (its default, 128x192 ping-pong in
2x1 clusters, and the three forced ones of ../shared/PEERS.md: 128x128 ping-pong, 128x192
ping-pong, 128x256 cooperative, all 1x1; the same round-robin, --select-rounds rounds), then
only the chosen one is timed with the others: a max over four noisy configurations would
favour quack by the noise. quack JIT-compiles each configuration once per compile key
(dtype, operand majors, varlen mode; not the sizes), during the first shape.

Passes: fwd (x @ w: [T, K] x [E, K, N]), dX (dy @ wᵀ), dW (xᵀ @ dy grouped along T, [E, K, N])
and, with --passes, fwd+bwd through autograd (no quack or loop column). Up projections are
x @ W_up with N = 2·d_ff (gate and up in one weight) unless the shape says otherwise; down
projections K = d_ff, N = d. T is the number of routed rows (tokens x top-k).

Routing: uniform; zipf12 (Zipf 1.2 over a fixed permutation, E/8 experts empty); skewed
(Zipf 1.1, E/16 empty).

Classes (the summary is per class): "decode" (serving batches: T = tokens x
top-k of a few hundred rows, a handful per expert; bound by reading the weights), "fine"
(fine-grained experts, at most 256 routed rows per expert on average), "larger" (more).

Roofline: a row's time can be no lower than max(FLOPs / R, bytes / B), R the dense matmul
rate and B the device-to-device copy bandwidth (bytes read plus written), both measured at
the start of the same run (an 8192³ torch.mm; a 1 GiB copy); bytes are each operand read
once and the output written once (x, the E·K·N weights and the output for fwd; dy, the
weights and dX for dX; x, dy and the E·K·N gradient for dW). "of roofline" is bound time
over measured time.

Outputs: a line per row as it finishes (unbuffered), then the table and a summary per class
(geomean and min of each ratio); --json (rewritten after every shape, so a run cut short keeps
what ran), --md (the same table in markdown, also rewritten after every shape), --png
(matplotlib, optional). Every output names the device, torch and CUDA versions, the quack
version and groupmm's build_info. --from-json renders a JSON file's table, markdown and
chart without a GPU.

Code: shapes, routings and the plan in benches/gpu_shapes.py, the measurements in
benches/gpu_run.py, rows, summaries and rendering in benches/gpu_report.py, quack's
adapter in benches/peer_quack.py, F.grouped_mm's in benches/peer_torch.py.
"""

from __future__ import annotations

import sys
import time

import gpu_shapes as shapes
import torch
from gpu_report import (
    class_summary,
    describe_env,
    format_row,
    print_table,
    render_md,
    render_png,
    upgrade,
)
from gpu_run import ceilings, host_cost, run_shape
from harness.cli import (
    add_output_args,
    add_rr_args,
    budget_spent,
    check_lists,
    line_buffered_stdout,
    no_cuda,
    parser,
)
from harness.report import (
    from_json,
    one_file,
    record,
    run_doc,
    write_png,
)
from harness.report import write_outputs as report_write
from peers.quack import load_quack, quack_host_cost
from peers.torch import grouped_mm

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument(
        "--shapes",
        default="all",
        help="comma list of shape names and groups: all, legacy (the seven of the README), "
        "fine, larger, decode (default all; --dry-run lists them)",
    )
    p.add_argument("--routing", default="uniform,zipf12", help="uniform, zipf12, skewed")
    p.add_argument("--passes", default="fwd,dX,dW", help="fwd, dX, dW, fwd+bwd")
    notes = {"rounds": "(default 7; quick 3)", "sample_ms": "(default 3; quick 2)"}
    add_rr_args(p, None, None, 3, None, reps=True, graph=True, notes=notes)
    p.add_argument(
        "--select-rounds", type=int, help="rounds of quack's selection pass (default 3; quick 1)"
    )
    p.add_argument("--no-lead", action="store_true", help="no GPU spin before each sample")
    p.add_argument(
        "--isolated",
        action="store_true",
        help="one call per sample, the host waiting for each (launch latency inside)",
    )
    p.add_argument("--no-quack", action="store_true", help="leave quack out even if installed")
    p.add_argument("--no-loop", action="store_true", help="leave the loop of torch.mm out")
    p.add_argument("--quick", action="store_true", help="T/8 (not decode), fewer rounds")
    add_output_args(p, budget="shape", png=True, merge=False)
    args = p.parse_args(argv)
    q = args.quick
    if args.rounds is None:
        args.rounds = 3 if q else 7
    if args.select_rounds is None:
        args.select_rounds = 1 if q else 3
    if args.sample_ms is None:
        args.sample_ms = 2.0 if q else 3.0
    if args.max_calls is None:
        args.max_calls = 20 if q else 50
    if args.calls is None:
        args.calls = args.reps
    if min(args.rounds, args.select_rounds, args.min_calls, args.max_calls) < 1:
        p.error("rounds and calls must be at least 1")
    check_lists(p, (args.routing, shapes.ROUTINGS), (args.passes, shapes.PASSES))
    return args


def write_outputs(doc: dict, args) -> None:
    """JSON and markdown of the result document (report.write_outputs)."""
    report_write(doc, args.json, args.md, render_md)


def dry_run(plan, names, args) -> int:
    """--dry-run: the rows and a rough estimate of the wall time; no GPU."""
    for name, s, T, routing, p in plan:
        print(
            f"{name:19} {shapes.row_class(s.E, T, s.decode):6} {routing:7} {p:7} E={s.E:<3} "
            f"K={s.K:<5} N={s.N:<5} T={T:<6} rows/expert {T / s.E:7.1f}  {s.model}, {s.proj}"
        )
    est = shapes.estimate_s(plan, args, quack=not args.no_quack)
    print(
        f"{est['rows']} rows over {len(names)} shapes; estimated wall on an H200 "
        f"~{est['total_s']:.0f} s (samples and warm-ups ~{est['gpu_s']:.0f} s, quack JIT "
        f"~{est['jit_s']:.0f} s at an assumed {shapes.EST_QUACK_JIT_S:.0f} s per "
        f"configuration and pass form; a rough model, not a measurement)"
    )
    return 0


def main(argv=None):
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        doc = from_json(args, one_file, print_table, render_md, upgrade)
        write_png(render_png, doc, args.png)
        return 0

    names = shapes.select_shapes(args.shapes)
    routings = args.routing.split(",")
    passes = args.passes.split(",")
    plan = shapes.plan_rows(names, passes, routings, args.quick)
    if args.dry_run:
        return dry_run(plan, names, args)

    import groupmm

    if no_cuda():
        return 2
    t_start = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch_gmm = grouped_mm()
    Q, why = (None, "--no-quack") if args.no_quack else load_quack()
    doc = run_doc(2, argv)
    doc.update(
        quack=Q is not None,
        quack_version=Q["version"]["quack"] if Q else None,
        cutlass_dsl=Q["version"].get("cutlass") if Q else None,
        quack_why=why,
        groupmm=groupmm.build_info(),
        dtype=args.dtype,
        timer={
            "rounds": args.rounds,
            "select_rounds": args.select_rounds,
            "sample_ms": args.sample_ms,
            "calls": args.calls,
            "min_calls": args.min_calls,
            "max_calls": args.max_calls,
            "graph": args.graph,
            "lead": not args.no_lead,
            "isolated": args.isolated,
        },
        rows=[],
        skipped=[],
    )
    for ln in describe_env(doc)[:2]:
        print(ln)
    doc["ceilings"] = ceilings(dtype, args)
    torch.cuda.empty_cache()
    for ln in describe_env(doc)[2:]:
        print(ln)
    n_rows = len(plan)

    def on_row(row):
        doc["rows"].append(row)
        doc["elapsed_s"] = time.perf_counter() - t_start
        write_outputs(doc, args)  # after every row: a run cut short keeps what ran
        el = time.perf_counter() - t_start
        print(f"[{len(doc['rows']):3}/{n_rows} {el:5.0f}s] " + format_row(row))
        for who, err in row["errors"].items():
            if who in ("groupmm", "torch") or (who == "quack" and row.get("quack_select")):
                print(f"      {who}: {err}")

    for name in names:
        spent = budget_spent(args, t_start, ".0f")
        if spent:
            doc["skipped"].append({"shape": name, "why": spent})
            print(f"skip {name}: budget of {args.budget_s:.0f} s spent")
            continue
        s = shapes.SPECS[name]
        T = shapes.effective_T(s, args.quick)
        t0 = time.perf_counter()
        print(
            f"== {name}: E={s.E} K={s.K} N={s.N} T={T} ({T / s.E:.0f} rows per expert, "
            f"{shapes.row_class(s.E, T, s.decode)}; {s.model}, {s.proj})"
        )
        try:
            run_shape(
                name,
                s,
                T,
                routings,
                passes,
                dtype,
                args,
                doc["ceilings"],
                torch_gmm,
                Q,
                on_row,
                DEV,
            )
        except torch.cuda.OutOfMemoryError as e:
            doc["skipped"].append({"shape": name, "why": f"out of memory: {str(e)[:80]}"})
            print(f"skip {name}: out of memory")
        torch.cuda.empty_cache()
        doc["elapsed_s"] = time.perf_counter() - t_start
        print(f"-- {name}: {time.perf_counter() - t0:.1f} s")
        doc["summary"] = class_summary(doc["rows"])
        write_outputs(doc, args)

    doc["host_us"] = host_cost(torch_gmm)
    if Q:
        try:
            doc["host_us"]["quack fwd (default config)"] = quack_host_cost(Q)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"quack host cost: {type(e).__name__}: {str(e)[:80]}")
    record(doc, t_start, class_summary, lambda d: write_outputs(d, args))
    print_table(doc)
    print("host µs per small call: " + ", ".join(f"{k} {v:.1f}" for k, v in doc["host_us"].items()))
    print(f"wall {doc['elapsed_s']:.0f} s")
    write_png(render_png, doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
