"""Where a whole MoE layer's step goes, kernel by kernel: torch.profiler over forward+backward
steps of bench_moe.py's layers (fused ``MoELayer``, SonicMoE, and optionally the unfused,
torch-gmm and plain layers), each kernel in a category (gemm, rows, routing, elementwise,
other), per config and tokens: a kernel development tool (bench_moe.py times the layers).

    python3 dev/profile_moe.py [--configs qwen3|layer|NAME,...] [--tokens 4096,16384]
        [--routing router|uniform|skewed] [--impls fused,sonicmoe,groupmm,torch-gmm,plain]
        [--steps 5] [--warmup 3] [--top 22] [--json out.json] [--md out.md]
    python3 dev/profile_moe.py --dry-run [...]                  # the rows; no GPU
    python3 dev/profile_moe.py --from-json out.json [--md out.md]  # render; no GPU
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# bench_moe.py's layers and the benches' harness, as when run from benches/
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "benches"))

import groupmm  # noqa: E402
import peers.sonicmoe as sonic  # noqa: E402
import torch  # noqa: E402
from bench_moe import build_impls, row_inputs  # noqa: E402
from groupmm.moe import MoELayer  # noqa: E402
from harness.cli import comma_list, line_buffered_stdout, parser  # noqa: E402
from harness.configs import CONFIGS, MODELS, ROUTINGS, select_configs  # noqa: E402
from harness.report import error_text, from_json, one_file, started  # noqa: E402
from harness.report.moe import IMPLS  # noqa: E402
from profile_kernels import (  # noqa: E402
    KERNEL_PATTERNS,
    kernel_block,
    kernel_table,
    make_row,
    render_md,
    summary_line,
    summary_lines,
)

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"


def _write_json(path, doc: dict) -> None:
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")


def write_outputs(doc: dict, args) -> None:
    if args.json:
        _write_json(args.json, doc)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(render_md(doc))


def print_summary(doc: dict) -> None:
    for ln in summary_lines(doc):
        print(ln)


# ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument(
        "--configs",
        "--config",
        dest="configs",
        default="qwen3",
        help="comma list of bench_moe config names and groups (layer, layer-wide, fine, "
        "extra, legacy, all); default qwen3",
    )
    p.add_argument("--tokens", default="4096", help="comma list of T (tokens); default 4096")
    p.add_argument(
        "--routing",
        default="router",
        choices=ROUTINGS,
        help="router (default, SonicMoE included), uniform, skewed",
    )
    p.add_argument(
        "--impls",
        default="fused,sonicmoe",
        help=f"comma list of {', '.join(IMPLS)}; default fused,sonicmoe",
    )
    p.add_argument("--steps", type=int, default=5, help="profiled steps per row")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling, per row")
    p.add_argument("--top", type=int, default=22, help="kernels printed per row")
    p.add_argument("--json", help="every row and kernel, rewritten after every shape")
    p.add_argument("--md", help="the tables in markdown, rewritten after every shape")
    p.add_argument("--dry-run", action="store_true", help="print the rows; no GPU")
    p.add_argument("--from-json", help="render a result file (--md); no GPU")
    args = p.parse_args(argv)
    args.argv = argv
    args.config_names = select_configs(args.configs)
    if not args.config_names:
        p.error("no config selected")
    try:
        args.token_list = [int(t) for t in comma_list(args.tokens)]
    except ValueError:
        p.error(f"--tokens takes a comma list of integers, not {args.tokens!r}")
    if not args.token_list or min(args.token_list) < 1:
        p.error("--tokens: at least one T, each at least 1")
    impls = []
    for name in comma_list(args.impls):
        if name not in IMPLS:
            p.error(f"unknown implementation {name!r}; choose from {', '.join(IMPLS)}")
        if name not in impls:
            impls.append(name)
    if not impls:
        p.error("--impls: at least one implementation")
    args.impl_list = impls
    if min(args.steps, args.warmup, args.top) < 1:
        p.error("steps, warmup and top must be at least 1")
    return args


def profile_steps(step, steps: int) -> list:
    """``(kernel name, device µs over all steps, calls)`` of ``steps`` calls of ``step``
    under torch.profiler (CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA":
            events.append((e.key, float(t), int(e.count)))
    return events


def profile_shape(cname, T, layer, S, sonic_w, why_no_sonic, args, dev, dtype):
    """Profile every requested implementation at one (config, tokens): ``(rows, skipped)``."""
    d, _f_, E, k = CONFIGS[cname]
    ids, x, gy = row_inputs(T, d, E, k, args.routing, dev, dtype)  # bench_moe.py's
    fwd, leaves, errors = build_impls(layer, ids, k, S, sonic_w, why_no_sonic)
    rows, skipped = [], []

    def skip(name, why):
        skipped.append({"config": cname, "tokens": T, "impl": name, "why": why})
        print(f"   {name}: skipped: {why}")

    for name in args.impl_list:
        if name not in fwd:
            skip(name, errors.get(name, "not available"))
            continue
        fn, ls = fwd[name], [x, *leaves[name]]

        def step(fn=fn, ls=ls):
            for t in ls:
                t.grad = None
            fn(x).backward(gy)

        t0 = time.perf_counter()
        try:
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            skip(name, error_text(e, first_line=False))
            continue
        warm_s = time.perf_counter() - t0
        jit = " (JIT compile and autotune on first use)" if name == "sonicmoe" else ""
        print(f"   {name} warm-up: {args.warmup} steps took {warm_s:.1f} s wall{jit}")
        events = profile_steps(step, args.steps)
        row = make_row(
            cname,
            T,
            name,
            kernel_table(events, args.steps),
            routing=args.routing,
            steps=args.steps,
            warmup_s=warm_s,
        )
        for ln in kernel_block(row, args.top):
            print(ln)
        print(summary_line(row))
        rows.append(row)
    for t in [x, *(t for ls in leaves.values() for t in ls)]:
        t.grad = None
    return rows, skipped


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, one_file, print_summary, render_md)
        return 0
    plan = [(c, T) for c in args.config_names for T in args.token_list]
    if args.dry_run:
        for c, T in plan:
            d, f, E, k = CONFIGS[c]
            print(
                f"{c:15} T={T:<6} d={d:<5} d_ff={f:<5} E={E:<3} k={k} {args.routing}: "
                + ", ".join(args.impl_list)
            )
        print(
            f"{len(plan)} shapes x {len(args.impl_list)} implementations, {args.warmup} "
            f"warm-up + {args.steps} profiled steps each"
        )
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile (--dry-run or --from-json work on the CPU)")
        return 2
    dev = torch.device(DEV)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    S, why = None, None
    if "sonicmoe" in args.impl_list:
        S, why = sonic.load_sonic()
        if S is None:
            print(f"SonicMoE skipped: {why}")
    doc = {
        "schema": "moe-profile-1",
        "complete": False,
        "command": list(sys.argv[1:] if argv is None else argv),
        "started": started(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).replace("torch.", ""),
        "groupmm": groupmm.build_info(),
        "versions": sonic.peer_versions() if "sonicmoe" in args.impl_list else {},
        "sonicmoe_why": why,
        "routing": args.routing,
        "steps": args.steps,
        "warmup": args.warmup,
        "patterns": {c: list(p) for c, p in KERNEL_PATTERNS},
        "rows": [],
        "skipped": [],
    }
    print(f"{doc['device']}, torch {doc['torch']}, {doc['dtype']}, routing {args.routing}")
    for cname in args.config_names:
        d, f, E, k = CONFIGS[cname]
        print(f"== {cname}: d={d} d_ff={f} E={E} k={k} ({MODELS.get(cname, cname)})")
        torch.manual_seed(0)  # bench_moe.main's layer
        layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype)
        sonic_w = sonic.sonic_weights(layer) if S is not None else None
        for T in args.token_list:
            try:
                rows, skipped = profile_shape(cname, T, layer, S, sonic_w, why, args, dev, dtype)
            except torch.cuda.OutOfMemoryError as e:
                rows = []
                skipped = [
                    {"config": cname, "tokens": T, "impl": "*", "why": f"out of memory: {e}"[:120]}
                ]
                print(f"skip {cname} T={T}: out of memory")
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            doc["rows"] += rows
            doc["skipped"] += skipped
            write_outputs(doc, args)  # after every shape: a run cut short keeps what ran
        del layer, sonic_w
    doc["complete"] = True
    write_outputs(doc, args)
    print()
    print_summary(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
