"""GPU benchmark: groupmm vs torch.nn.functional.grouped_mm vs a loop of torch.mm vs a
dense torch.mm of the same FLOPs, in one run, on MoE shapes.

    python benches/bench_gpu.py [--dtype bf16|fp16] [--reps 25] [--json out.json]
                                [--png out.png] [--shapes name,...] [--quick]

Timing: CUDA events around each call, calls issued back to back (see bench()); the host
cost per call is reported separately. --isolated syncs after every call instead.

Passes: fwd (x @ w), dX (dy @ wᵀ), dW (xᵀ @ dy grouped along T) and fwd+bwd through
autograd. Routing: uniform and skewed (Zipf-like, some experts empty). Times are CUDA
event medians after warm-up on random (non-zero) inputs. Also measures the host cost of
one small packed call (forward, and forward+backward).
"""

import argparse
import json
import math
import statistics
import sys

import groupmm
import torch
from host_cost import per_call as host_per_call  # benches/host_cost.py, same folder

SHAPES = {
    # name: (E experts, K in, N out, T routed rows)
    "mixtral-up": (8, 4096, 14336, 32768),
    "mixtral-down": (8, 14336, 4096, 32768),
    "dsv3-up": (32, 7168, 2048, 65536),
    "dsv3-down": (32, 2048, 7168, 65536),
    "qwen3-up": (128, 2048, 768, 32768),
    "qwen3-down": (128, 768, 2048, 32768),
    "small64": (64, 1024, 1024, 8192),
}


def counts_for(E: int, T: int, routing: str) -> list:
    if routing == "uniform":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    # Zipf-like with exponent 1.1 over a fixed permutation; the last E//16 (≥1) experts
    # get no tokens.
    empty = max(1, E // 16)
    live = E - empty
    w = [1.0 / (r + 1) ** 1.1 for r in range(live)]
    s = sum(w)
    c = [int(T * x / s) for x in w]
    c[0] += T - sum(c)
    g = torch.Generator().manual_seed(E)
    perm = torch.randperm(E, generator=g).tolist()
    out = [0] * E
    for i, cnt in enumerate(c + [0] * empty):
        out[perm[i]] = cnt
    return out


def bench(fn, reps: int, warmup: int = 5) -> float:
    """Median milliseconds per call of fn() over reps calls, CUDA events around each call.

    Calls are issued back to back with no host sync between them (as in a training
    step, and as triton's do_bench does), so the host's launch cost is hidden whenever
    it is shorter than the GPU work; the host cost is measured on its own in
    host_cost(). With --isolated, the host waits for each call to finish before issuing
    the next, which puts the launch latency inside every timed call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
        if ISOLATED:
            ends[i].synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


ISOLATED = False


def try_bench(fn, reps):
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # a peer that cannot run a case is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return bench(fn, reps), None


def run_case(name, E, K, N, T, routing, dtype, reps, torch_gmm):
    dev = "cuda"
    counts = counts_for(E, T, routing)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(T, K, device=dev, dtype=dtype)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) / math.sqrt(K)
    dy = torch.randn(T, N, device=dev, dtype=dtype)
    wd = torch.randn(K, N, device=dev, dtype=dtype)
    flops = 2.0 * T * K * N
    bounds = [0] + offs.tolist()

    def loop_fwd():
        out = torch.empty(T, N, device=dev, dtype=dtype)
        for g in range(E):
            s, e = bounds[g], bounds[g + 1]
            if e > s:
                torch.mm(x[s:e], w[g], out=out[s:e])
        return out

    def loop_dx():
        out = torch.empty(T, K, device=dev, dtype=dtype)
        for g in range(E):
            s, e = bounds[g], bounds[g + 1]
            if e > s:
                torch.mm(dy[s:e], w[g].t(), out=out[s:e])
        return out

    def loop_dw():
        out = torch.empty(E, K, N, device=dev, dtype=dtype)
        for g in range(E):
            s, e = bounds[g], bounds[g + 1]
            torch.mm(x[s:e].t(), dy[s:e], out=out[g])
        return out

    def dense_fb():  # the three dense products of a forward+backward, same FLOPs
        torch.mm(x, wd)
        torch.mm(dy, wd.t())
        torch.mm(x.t(), dy)

    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()

    def fb(f):
        def run():
            xg.grad = None
            wg.grad = None
            f(xg, wg, offs=offs).backward(dy)

        return run

    passes = {
        "fwd": (
            lambda: groupmm.grouped_mm(x, w, offs=offs),
            (lambda: torch_gmm(x, w, offs=offs)) if torch_gmm else None,
            loop_fwd,
            lambda: torch.mm(x, wd),
            1.0,
        ),
        "dX": (
            lambda: groupmm.grouped_mm(dy, w.transpose(-2, -1), offs=offs),
            (lambda: torch_gmm(dy, w.transpose(-2, -1), offs=offs)) if torch_gmm else None,
            loop_dx,
            lambda: torch.mm(dy, wd.t()),
            1.0,
        ),
        "dW": (
            lambda: groupmm.grouped_mm(x.t(), dy, offs=offs),
            (lambda: torch_gmm(x.t(), dy, offs=offs)) if torch_gmm else None,
            loop_dw,
            lambda: torch.mm(x.t(), dy),
            1.0,
        ),
        "fwd+bwd": (
            fb(groupmm.grouped_mm),
            fb(torch_gmm) if torch_gmm else None,
            None,
            dense_fb,
            3.0,
        ),
    }
    rows = []
    for pname, (ours, theirs, loop, dense, mult) in passes.items():
        t_ours, err_ours = try_bench(ours, reps)
        t_torch, err_torch = try_bench(theirs, reps) if theirs else (None, "no F.grouped_mm")
        t_loop, _ = try_bench(loop, max(5, reps // 5)) if loop else (None, None)
        t_dense, _ = try_bench(dense, reps)

        def tf(t, mult=mult):
            return None if t is None else mult * flops / (t * 1e-3) / 1e12

        rows.append(
            {
                "shape": name,
                "E": E,
                "K": K,
                "N": N,
                "T": T,
                "routing": routing,
                "pass": pname,
                "dtype": str(dtype).replace("torch.", ""),
                "ms": {"groupmm": t_ours, "torch": t_torch, "loop": t_loop, "dense": t_dense},
                "tflops": {
                    "groupmm": tf(t_ours),
                    "torch": tf(t_torch),
                    "loop": tf(t_loop),
                    "dense": tf(t_dense),
                },
                "errors": {"groupmm": err_ours, "torch": err_torch},
            }
        )
    return rows


def host_cost(torch_gmm, n=2000):
    """Host (CPU) microseconds per call of a small packed forward and forward+backward."""
    dev = "cuda"
    E, K, N, T = 8, 128, 128, 256
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    offs = torch.tensor([T // E] * E, device=dev).cumsum(0).to(torch.int32)

    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    gy = torch.randn(T, N, device=dev, dtype=torch.bfloat16)

    def per_call(fn):
        return host_per_call(fn, n)

    res = {
        "groupmm fwd": per_call(lambda: groupmm.grouped_mm(x, w, offs=offs)),
        "torch.mm fwd": per_call(lambda: torch.mm(x, w[0])),
        "groupmm fwd+bwd": per_call(lambda: groupmm.grouped_mm(xg, wg, offs=offs).backward(gy)),
    }
    if torch_gmm:
        res["F.grouped_mm fwd"] = per_call(lambda: torch_gmm(x, w, offs=offs))
        res["F.grouped_mm fwd+bwd"] = per_call(lambda: torch_gmm(xg, wg, offs=offs).backward(gy))
    return res


def fmt(v, spec=".0f"):
    return "-" if v is None else format(v, spec)


# Shapes counted as "small" in issue 4's skewed+small geometric mean (with every skewed row).
SMALL_SHAPES = ("small64", "qwen3-up", "qwen3-down")


def summary(rows) -> str:
    """Min ratio and geometric means vs torch over result rows (bench rows or JSON)."""
    ratios, skew_small = [], []
    for r in rows:
        t = r["tflops"]
        if t["groupmm"] and t["torch"]:
            v = t["groupmm"] / t["torch"]
            ratios.append(v)
            if r["routing"] == "skewed" or r["shape"] in SMALL_SHAPES:
                skew_small.append(v)

    def gmean(v):
        return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None

    return (
        f"min ratio vs torch: {fmt(min(ratios) if ratios else None, '.2f')}; "
        f"geomean all: {fmt(gmean(ratios), '.2f')}; "
        f"geomean skewed+small: {fmt(gmean(skew_small), '.2f')}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--routing", default="uniform,skewed")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--quick", action="store_true", help="small T (÷8) and 10 reps")
    p.add_argument(
        "--isolated",
        action="store_true",
        help="sync after every timed call (launch latency inside the timing)",
    )
    args = p.parse_args(argv)
    global ISOLATED
    ISOLATED = args.isolated
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch_gmm = getattr(torch.nn.functional, "grouped_mm", None)
    dev_name = torch.cuda.get_device_name()
    print(f"device {dev_name}; torch {torch.__version__}; groupmm {groupmm.build_info()}")
    rows = []
    for name in args.shapes.split(","):
        E, K, N, T = SHAPES[name]
        if args.quick:
            T //= 8
        for routing in args.routing.split(","):
            rows += run_case(
                name, E, K, N, T, routing, dtype, 10 if args.quick else args.reps, torch_gmm
            )
            torch.cuda.empty_cache()
    host = host_cost(torch_gmm)

    hdr = (
        f"{'shape':13} {'routing':8} {'pass':8} {'groupmm':>8} {'torch':>8} {'loop':>8} "
        f"{'dense':>8} {'vs torch':>8} {'vs dense':>8}"
    )
    print(f"\nTFLOP/s, {args.dtype}, {dev_name}")
    print(hdr)
    for r in rows:
        t = r["tflops"]
        vt = t["groupmm"] / t["torch"] if t["groupmm"] and t["torch"] else None
        vd = t["groupmm"] / t["dense"] if t["groupmm"] and t["dense"] else None
        r["vs_torch"], r["vs_dense"] = vt, vd
        print(
            f"{r['shape']:13} {r['routing']:8} {r['pass']:8} {fmt(t['groupmm']):>8} "
            f"{fmt(t['torch']):>8} {fmt(t['loop']):>8} {fmt(t['dense']):>8} "
            f"{fmt(vt, '.2f'):>8} {fmt(vd, '.2f'):>8}"
        )
        for who, err in r["errors"].items():
            if err and who == "groupmm":
                print(f"   {who} failed: {err}")
    print("\n" + summary(rows))
    print("host µs per small call: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": dev_name,
                    "torch": torch.__version__,
                    "dtype": args.dtype,
                    "rows": rows,
                    "host_us": host,
                },
                f,
                indent=1,
            )
    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            labels = [f"{r['shape']}\n{r['routing'][:4]} {r['pass']}" for r in rows]
            xs = range(len(rows))
            fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.45), 5))
            for i, who in enumerate(["groupmm", "torch", "dense"]):
                ax.bar(
                    [x + (i - 1) * 0.27 for x in xs],
                    [r["tflops"][who] or 0 for r in rows],
                    width=0.27,
                    label=who,
                )
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, rotation=90, fontsize=6)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"groupmm vs F.grouped_mm vs dense torch.mm ({args.dtype}, {dev_name})")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.png, dpi=110)
        except ImportError:
            print("matplotlib missing: no chart")
    return 0


if __name__ == "__main__":
    sys.exit(main())
