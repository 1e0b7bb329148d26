"""The MoE row ops on their own: the bytes/s of groupmm's row kernels (``groupmm._rows``) and
of torch's equivalent, as a fraction of a device-to-device copy of the same bytes.

    python3 benches/bench_rows.py [--ops combine,sum,gather,scatter] [--dims 768,2048]
        [--topk 1,8] [--tokens 4096,65536] [--dtypes bf16,fp16,fp32] [--rounds 5]
        [--max-gib 3] [--quick] [--budget-s S] [--json F] [--md F]
    python3 benches/bench_rows.py --dry-run [...]    # the rows; no GPU
    python3 benches/bench_rows.py --from-json a.json[,b.json] [--json merged.json] [--md F]

Bytes: :func:`op_bytes`. groupmm's output is checked against torch's before timing.
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple

import groupmm
import torch
from groupmm._glue import routes
from groupmm._rows import gather_sum, scatter_rows
from harness.cli import (
    add_output_args,
    add_rr_args,
    check_rr_args,
    comma_list,
    line_buffered_stdout,
    no_cuda,
    parser,
)
from harness.report import error_text, fmt, from_json, rel_diff, run_doc, run_rows, skip
from harness.report import write_outputs as write_files
from harness.report.rows import (
    describe_env,
    format_row,
    make_row,
    merge_docs,
    print_table,
    render_md,
    summarize,
)
from harness.timing import round_robin, rr_settings

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"
OPS = ("combine", "sum", "gather", "scatter")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
#: relative error allowed between groupmm's and torch's combine / sum; gather and scatter
#: must be equal
TOL = {"bf16": 1e-2, "fp16": 1e-3, "fp32": 1e-5}
EXACT = ("gather", "scatter")
DIMS, TOPK, TOKENS = (768, 2048, 4096, 7168), (1, 2, 4, 8, 16), (256, 4096, 16384, 65536)
#: fp16 and fp32 run this subset unless --dims / --topk / --tokens are given
SUBSET = {"dims": (2048, 7168), "topk": (1, 8), "tokens": (4096, 65536)}
#: --quick: (dtype, T, D, k)
QUICK = (
    *(("bf16", T, 2048, 8) for T in (256, 4096, 16384, 65536)),
    ("bf16", 16384, 4096, 8),
    ("bf16", 4096, 7168, 8),
    ("bf16", 16384, 4096, 2),
    ("bf16", 16384, 768, 16),
    ("bf16", 65536, 4096, 1),
    ("fp16", 16384, 2048, 8),
    ("fp32", 16384, 2048, 8),
)
IDX_BYTES = W_BYTES = 4  # int32 indices, float32 weights


def num_experts(k: int) -> int:
    return max(k, 128)


def op_bytes(op: str, T: int, D: int, k: int, es: int) -> int:
    """The minimum bytes ``op`` moves: T rows and R rows (one read, the other written), the
    index [R], and for combine the weights [R]."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    R = T * k
    return (R + T) * D * es + R * IDX_BYTES + (R * W_BYTES if op == "combine" else 0)


def largest_bytes(T: int, D: int, k: int, es: int) -> int:
    """The largest tensor of a shape: the [R, D] routed rows."""
    return max(T * k, T) * D * es


def alloc_bytes(op: str, T: int, D: int, k: int, es: int) -> int:
    """An upper bound of what a row allocates: inputs, indices, both outputs, torch's
    temporaries (float32 where it computes in float32), the copy buffers."""
    R = T * k
    rows, toks, f32 = R * D * es, T * D * es, T * D * 4
    need = {  # inputs; groupmm's out; torch's temporaries and out
        "combine": rows + R * W_BYTES + toks + rows + 2 * R * D * 4 + f32 + toks,
        "sum": rows + toks + rows + f32 + toks,
        "gather": toks + rows + rows,
        "scatter": toks + rows + R * IDX_BYTES + rows + rows,
    }
    if op not in need:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    return need[op] + 2 * R * IDX_BYTES + 2 * (op_bytes(op, T, D, k, es) // 2)


def plan_rows(
    ops=OPS,
    dtypes=("bf16", "fp16", "fp32"),
    dims=None,
    topk=None,
    tokens=None,
    max_gib: float = 3.0,
    quick: bool = False,
) -> tuple:
    """``(rows, skipped)``: the rows in run order (per dtype, T, k, D, op) and the shapes
    whose [R, D] exceeds ``max_gib`` GiB. ``dims``, ``topk``, ``tokens`` None: the
    defaults (bf16 all, fp16 and fp32 SUBSET); ``quick``: the QUICK shapes."""
    shapes = []
    for dt in dtypes:
        if quick:
            shapes += [s for s in QUICK if s[0] == dt]
            continue
        sub = dt != "bf16"
        ds = dims or (SUBSET["dims"] if sub else DIMS)
        ks = topk or (SUBSET["topk"] if sub else TOPK)
        shapes += [
            (dt, T, D, k)
            for T in tokens or (SUBSET["tokens"] if sub else TOKENS)
            for k in ks
            for D in ds
        ]
    rows, skipped = [], []
    for dt, T, D, k in shapes:
        es, big = ELEMENT_SIZE[dt], largest_bytes(T, D, k, ELEMENT_SIZE[dt])
        if big > max_gib * 2**30:
            why = f"[R, D] is {big / 2**30:.2f} GiB > --max-gib {max_gib:g}"
            skipped.append({"row": f"{dt} T={T} D={D} k={k}", "why": why})
            continue
        for op in ops:
            r = {"op": op, "dtype": dt, "T": T, "D": D, "k": k, "R": T * k, "E": num_experts(k)}
            r.update(bytes=op_bytes(op, T, D, k, es), largest_bytes=big)
            rows.append(dict(r, alloc_bytes=alloc_bytes(op, T, D, k, es)))
    return rows, skipped


def label(row: dict) -> str:
    return f"{row['op']} {row['dtype']} T={row['T']} D={row['D']} k={row['k']}"


class Indices(NamedTuple):
    src: torch.Tensor  # int32 [R]: the token of each sorted copy
    inverse: torch.Tensor  # int32 [T, k]: the sorted position of copy (t, j)
    expert_ids: torch.Tensor
    num_experts: int


def routing_indices(T: int, k: int, seed: int = 0, device="cpu") -> Indices:
    """Each token's k distinct experts of E = max(k, 128) (a uniformly random k-subset),
    then ``routes`` (a stable sort by expert) on ``device``."""
    E = num_experts(k)
    ids = torch.rand(T, E, generator=torch.Generator().manual_seed(seed)).topk(k, dim=1).indices
    r = routes(ids.to(device), E)
    return Indices(r.src.to(torch.int32), r.inverse.to(torch.int32), ids.to(device), E)


def _picked(y, inverse):
    T, k = inverse.shape
    return y.index_select(0, inverse.reshape(-1)).view(T, k, y.shape[1])


def torch_combine(y, inverse, w):
    return (_picked(y, inverse).float() * w.unsqueeze(-1)).sum(1).to(y.dtype)


def torch_sum(y, inverse):
    return _picked(y, inverse).sum(1, dtype=torch.float32).to(y.dtype)


def torch_gather(x, src):
    return x.index_select(0, src)


def torch_scatter(grad, inverse, rows: int):
    out = torch.zeros(rows, grad.shape[1], device=grad.device, dtype=grad.dtype)
    return out.index_add_(0, inverse.reshape(-1), grad.repeat_interleave(inverse.shape[1], 0))


def build_op(op: str, T: int, D: int, k: int, dtype, idx: Indices, dev, seed: int = 0):
    """``(groupmm_fn, torch_fn)`` of one row on fresh random inputs."""
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
        src, col = idx.src, idx.src.view(-1, 1)
        return (lambda: gather_sum(x, col, None)), (lambda: torch_gather(x, src))
    if op == "scatter":
        return (lambda: scatter_rows(x, inv, None, R)), (lambda: torch_scatter(x, inv, R))
    raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")


def check(op: str, dtype: str, got, want) -> dict:
    """``{"ok", "err", "how"}``: groupmm's output against torch's."""
    if got.shape != want.shape or got.dtype != want.dtype:
        how = f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
        return {"ok": False, "err": None, "how": how}
    if op in EXACT:
        same = torch.equal(got, want)
        return {"ok": same, "err": 0.0 if same else rel_diff(got, want), "how": "exact"}
    err = rel_diff(got, want)
    return {"ok": err < TOL[dtype], "err": err, "how": f"rel err < {TOL[dtype]:g}"}


def run_row(row: dict, idx: Indices, args, dev) -> dict:
    """Build the op, check groupmm against torch, then time groupmm, torch and the copy."""
    gm, tc = build_op(
        row["op"], row["T"], row["D"], row["k"], DTYPES[row["dtype"]], idx, dev, args.seed
    )
    errors, outs = {}, {}
    for who, fn in (("groupmm", gm), ("torch", tc)):
        try:
            outs[who] = fn()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - reported in the row; the others go on
            errors[who] = error_text(e, first_line=False)
    gm, tc = ("groupmm" in outs and gm), ("torch" in outs and tc)
    chk = None
    if len(outs) == 2:
        chk = check(row["op"], row["dtype"], outs["groupmm"], outs["torch"])
    elif not gm:
        chk = {"ok": False, "err": None, "how": f"groupmm raised: {errors['groupmm']}"}
    outs.clear()
    src = torch.empty(row["bytes"] // 2, device=dev, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    timed, meta = round_robin(
        {"groupmm": gm or None, "torch": tc or None, "copy": lambda: dst.copy_(src)},
        **rr_settings(args),
    )
    return make_row(dict(row, lead_ms=meta["lead_ms"]), timed, chk, errors)


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--ops", default=",".join(OPS), help="comma list of " + ", ".join(OPS))
    for flag, what in (("--dims", "D"), ("--topk", "k"), ("--tokens", "T")):
        p.add_argument(flag, help=f"comma list of {what} (default: the full table)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma list of bf16, fp16, fp32")
    p.add_argument("--quick", action="store_true", help="a handful of representative shapes")
    p.add_argument("--max-gib", type=float, default=3.0, help="skip shapes whose [R, D] is larger")
    add_rr_args(p, rounds=5, sample_ms=5.0, min_calls=3, max_calls=100)
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
        ints = [
            [int(v) for v in comma_list(a)] if a else None
            for a in (args.dims, args.topk, args.tokens)
        ]
    except ValueError as e:
        p.error(f"--dims, --topk, --tokens: comma lists of integers ({e})")
    if any(v < 1 for lst in ints if lst for v in lst):
        p.error("--dims, --topk, --tokens must be positive")
    args.dims, args.topk, args.tokens = ints
    return args


def write_outputs(doc: dict, args) -> None:
    write_files(doc, args.json, args.md, render_md)


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
        for r in plan:
            print(
                f"{r['op']:7} {r['dtype']:4} T={r['T']:<5} D={r['D']:<4} k={r['k']:<2} "
                f"R={r['R']:<7} E={r['E']:<3} {r['bytes'] / 1e6:9.1f} MB  [R, D] "
                f"{r['largest_bytes'] / 2**30:5.2f} GiB  allocates <= "
                f"{r['alloc_bytes'] / 2**30:5.2f} GiB"
            )
        for s in skipped:
            print(f"skip {s['row']}: {s['why']}")
        print(
            f"{len(plan)} rows ({len(skipped)} shapes skipped by --max-gib; rows that do "
            "not fit the free GPU memory are skipped at run time)"
        )
        return 0
    if no_cuda():
        return 2
    t_start = time.perf_counter()
    dev = torch.device(DEV)
    doc = run_doc("rows-1", argv)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    doc.update(l2_bytes=getattr(props, "L2_cache_size", None), groupmm=groupmm.build_info())
    doc.update(max_gib=args.max_gib, seed=args.seed, timer=rr_settings(args), rows=[])
    doc["skipped"] = list(skipped)
    print("\n".join(describe_env(doc) + [f"skip {s['row']}: {s['why']}" for s in skipped]))
    held = {}  # one routing per (T, k), reused over D and ops

    def measure(r):
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if held.get("key") != (r["T"], r["k"]):
            held.update(key=(r["T"], r["k"]), idx=routing_indices(r["T"], r["k"], args.seed, dev))
        free, _total = torch.cuda.mem_get_info()
        need = int(r["alloc_bytes"] * 1.05) + (256 << 20)
        if need > free:
            skip(doc, label(r), f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            return None
        return run_row(r, held["idx"], args, dev)

    def show(row, head):
        print(head + format_row(row, doc))
        if row["ok"] is False:
            msg = (
                f"!!! MISMATCH {label(row)}: groupmm's output differs from torch's "
                f"({row['check_how']}, error {fmt(row['check_err'], '.2e')})"
            )
            print(msg)
            print(msg, file=sys.stderr)

    write = lambda d: write_outputs(d, args)  # noqa: E731
    run_rows(doc, plan, args, t_start, label, measure, summarize, write, show)
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
