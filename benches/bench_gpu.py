"""GPU benchmark: groupmm vs torch.nn.functional.grouped_mm vs quack (the grouped GEMM of
SonicMoE, when installed) vs a loop of torch.mm vs a dense torch.mm of the same FLOPs, and
each row's roofline bound, in one run, on MoE shapes.

    python benches/bench_gpu.py [--dtype bf16|fp16] [--reps 25] [--json out.json]
                                [--png out.png] [--shapes name,...] [--quick] [--no-quack]

Timing: CUDA events around each call, calls issued back to back (see bench()); the host
cost per call is reported separately. --isolated syncs after every call instead.

Passes: fwd (x @ w), dX (dy @ wᵀ), dW (xᵀ @ dy grouped along T) and fwd+bwd through
autograd. Routing: uniform, skewed (Zipf 1.1, E/16 experts empty) and zipf12 (Zipf 1.2,
E/8 experts empty). Times are CUDA event medians after warm-up on random (non-zero)
inputs. Also measures the host cost of one small packed call (forward, and
forward+backward).

quack (`quack-kernels`, optional import): the best of its default configuration (128x192
ping-pong, cluster 2x1) and three forced ones (128x128 ping-pong, 128x192 ping-pong,
128x256 cooperative, all cluster 1x1), per row; fwd, dX and dW only (it has no grouped
autograd op). Its host cost per call is high (Python planning): only GPU time is compared.

Roofline: a row's time can be no lower than max(FLOPs / R, bytes / B), where R is the
dense bf16/fp16 matmul rate and B the device-to-device copy bandwidth, both measured at the
start of the run (an 8192³ torch.mm; a 2 GiB copy counting bytes read plus written), and
bytes are each operand read once and the output written once (x, the E·K·N weights and
the output for fwd; dy, the weights and dX for dX; x, dy and the E·K·N gradient for dW;
the sum of the three for fwd+bwd). "of roofline" is bound time over measured time.
"""

import argparse
import json
import math
import sys

import groupmm
import torch
from host_cost import per_call_us  # benches/host_cost.py, same folder
from timing import median_ms  # benches/timing.py, same folder

try:  # quack-kernels (the grouped GEMM of SonicMoE): optional peer
    from quack.gemm_config import GemmConfig as _QuackConfig
    from quack.gemm_interface import gemm as _quack_gemm
    from quack.gemm_interface import gemm_tuned as _quack_tuned

    QUACK = True
    QUACK_WHY = ""
except Exception as _e:  # noqa: BLE001 - any import failure means "not installed here"
    QUACK = False
    QUACK_WHY = f"{type(_e).__name__}: {str(_e)[:80]}"

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
    # Zipf-like over a fixed permutation: "skewed" exponent 1.1 with E//16 (≥1) experts
    # empty; "zipf12" exponent 1.2 with E//8 (≥1) empty (the routing of issue 11's table).
    expo, frac = (1.2, 8) if routing == "zipf12" else (1.1, 16)
    empty = max(1, E // frac)
    live = E - empty
    w = [1.0 / (r + 1) ** expo for r in range(live)]
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
    """Median milliseconds per call of fn() over reps calls (benches/timing.py): CUDA
    events around each call, calls issued back to back with no host sync between them,
    so the host's launch cost is hidden whenever it is shorter than the GPU work; the
    host cost is measured on its own in host_cost(). With --isolated, the host waits for
    each call to finish before issuing the next."""
    return median_ms(fn, reps, warmup, isolated=ISOLATED)


ISOLATED = False


def try_bench(fn, reps):
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # a peer that cannot run a case is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return bench(fn, reps), None


def quack_best(a, b, kind, cu, like, reps):
    """Median ms of quack's best configuration for one product, or (None, why)."""
    kw = {"cu_seqlens_m": cu} if kind == "m" else {"cu_seqlens_k": cu}
    cands = [lambda: _quack_gemm(a, b, tuned=False, **kw)]
    for tm, tn, pp in ((128, 128, True), (128, 192, True), (128, 256, False)):
        cfg = _QuackConfig(
            tile_m=tm,
            tile_n=tn,
            pingpong=pp,
            cluster_m=1,
            cluster_n=1,
            is_dynamic_persistent=False,
            device_capacity=9,
        )
        out = torch.empty_like(like)
        cands.append(lambda cfg=cfg, out=out: _quack_tuned.fn(a, b, out, config=cfg, **kw))
    best, why = None, None
    for fn in cands:
        t, err = try_bench(fn, reps)
        if t is not None and (best is None or t < best):
            best = t
        why = why or err
    return best, (None if best is not None else why)


def ceilings(dtype):
    """Measured dense matmul rate (FLOP/s) and copy bandwidth (bytes/s) of this GPU."""
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    t_mm = bench(lambda: torch.mm(a, b), 10)
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    t_cp = bench(lambda: dst.copy_(src), 10)
    return 2.0 * 8192**3 / (t_mm * 1e-3), 2.0 * (1 << 30) / (t_cp * 1e-3)


def run_case(name, E, K, N, T, routing, dtype, reps, torch_gmm, ceil):
    dev = "cuda"
    counts = counts_for(E, T, routing)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(T, K, device=dev, dtype=dtype)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) / math.sqrt(K)
    dy = torch.randn(T, N, device=dev, dtype=dtype)
    wd = torch.randn(K, N, device=dev, dtype=dtype)
    flops = 2.0 * T * K * N
    es = x.element_size()
    nbytes = {  # each operand read once, the output written once
        "fwd": es * (T * K + E * K * N + T * N),
        "dX": es * (T * N + E * K * N + T * K),
        "dW": es * (T * K + T * N + E * K * N),
    }
    nbytes["fwd+bwd"] = nbytes["fwd"] + nbytes["dX"] + nbytes["dW"]
    cu = torch.cat([offs.new_zeros(1), offs])  # quack's E+1 boundaries
    quack_args = {
        "fwd": (x, w, "m", torch.empty(T, N, device=dev, dtype=dtype)),
        "dX": (dy, w.transpose(-2, -1), "m", torch.empty(T, K, device=dev, dtype=dtype)),
        "dW": (x.t(), dy, "k", torch.empty(E, K, N, device=dev, dtype=dtype)),
    }
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
        if QUACK and pname in quack_args:
            qa, qb, kind, like = quack_args[pname]
            t_quack, err_quack = quack_best(qa, qb, kind, cu, like, reps)
        else:
            t_quack, err_quack = None, ("no autograd op" if QUACK else "not installed")
        rate, bw = ceil
        t_bound = max(mult * flops / rate, nbytes[pname] / bw) * 1e3  # ms

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
                "ms": {
                    "groupmm": t_ours,
                    "torch": t_torch,
                    "quack": t_quack,
                    "loop": t_loop,
                    "dense": t_dense,
                    "bound": t_bound,
                },
                "tflops": {
                    "groupmm": tf(t_ours),
                    "torch": tf(t_torch),
                    "quack": tf(t_quack),
                    "loop": tf(t_loop),
                    "dense": tf(t_dense),
                    "bound": tf(t_bound),
                },
                "roofline": None if t_ours is None else t_bound / t_ours,
                "errors": {"groupmm": err_ours, "torch": err_torch, "quack": err_quack},
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
        return per_call_us(fn, n)

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


# The fine-grained expert shapes (issue 11's quack rows; issue 4's "small" set).
SMALL_SHAPES = ("small64", "qwen3-up", "qwen3-down")


def gmean(v):
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else None


def summary(rows) -> str:
    """Min ratio and geometric means vs torch and vs quack, and the lowest fraction of the
    roofline, over result rows (bench rows or JSON)."""
    vs_torch, vs_quack, roof = [], [], []
    for r in rows:
        t = r["tflops"]
        if t.get("groupmm") and t.get("torch"):
            vs_torch.append(t["groupmm"] / t["torch"])
        if t.get("groupmm") and t.get("quack") and r["shape"] in SMALL_SHAPES:
            vs_quack.append(t["groupmm"] / t["quack"])
        if r.get("roofline"):
            roof.append(r["roofline"])
    out = (
        f"vs torch: min {fmt(min(vs_torch) if vs_torch else None, '.2f')}, "
        f"geomean {fmt(gmean(vs_torch), '.2f')} ({len(vs_torch)} rows)"
    )
    if vs_quack:
        out += (
            f"; vs quack (fine-grained fwd/dX/dW): min {min(vs_quack):.2f}, "
            f"geomean {gmean(vs_quack):.2f} ({len(vs_quack)} rows)"
        )
    if roof:
        out += f"; of roofline: min {min(roof):.2f}, geomean {gmean(roof):.2f}"
    return out


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--routing", default="uniform,skewed,zipf12")
    p.add_argument("--no-quack", action="store_true", help="leave quack out even if installed")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--quick", action="store_true", help="small T (÷8) and 10 reps")
    p.add_argument(
        "--isolated",
        action="store_true",
        help="sync after every timed call (launch latency inside the timing)",
    )
    args = p.parse_args(argv)
    global ISOLATED, QUACK
    ISOLATED = args.isolated
    QUACK = QUACK and not args.no_quack
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch_gmm = getattr(torch.nn.functional, "grouped_mm", None)
    dev_name = torch.cuda.get_device_name()
    print(f"device {dev_name}; torch {torch.__version__}; groupmm {groupmm.build_info()}")
    print("quack: " + ("installed" if QUACK else f"not measured ({QUACK_WHY or '--no-quack'})"))
    ceil = ceilings(dtype)
    torch.cuda.empty_cache()
    print(f"ceilings: dense mm {ceil[0] / 1e12:.0f} TFLOP/s, copy {ceil[1] / 1e12:.2f} TB/s")
    rows = []
    for name in args.shapes.split(","):
        E, K, N, T = SHAPES[name]
        if args.quick:
            T //= 8
        for routing in args.routing.split(","):
            rows += run_case(
                name, E, K, N, T, routing, dtype, 10 if args.quick else args.reps, torch_gmm, ceil
            )
            torch.cuda.empty_cache()
    host = host_cost(torch_gmm)

    hdr = (
        f"{'shape':13} {'routing':8} {'pass':8} {'groupmm':>8} {'torch':>8} {'quack':>8} "
        f"{'loop':>8} {'dense':>8} {'bound':>8} {'vs torch':>8} {'vs quack':>8} {'roofline':>8}"
    )
    print(f"\nTFLOP/s, {args.dtype}, {dev_name}")
    print(hdr)
    for r in rows:
        t = r["tflops"]
        vt = t["groupmm"] / t["torch"] if t["groupmm"] and t["torch"] else None
        vq = t["groupmm"] / t["quack"] if t["groupmm"] and t["quack"] else None
        vd = t["groupmm"] / t["dense"] if t["groupmm"] and t["dense"] else None
        r["vs_torch"], r["vs_quack"], r["vs_dense"] = vt, vq, vd
        print(
            f"{r['shape']:13} {r['routing']:8} {r['pass']:8} {fmt(t['groupmm']):>8} "
            f"{fmt(t['torch']):>8} {fmt(t['quack']):>8} {fmt(t['loop']):>8} "
            f"{fmt(t['dense']):>8} {fmt(t['bound']):>8} {fmt(vt, '.2f'):>8} "
            f"{fmt(vq, '.2f'):>8} {fmt(r['roofline'], '.2f'):>8}"
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
                    "ceilings": {"dense_flops": ceil[0], "copy_bytes_per_s": ceil[1]},
                    "quack": QUACK,
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
            peers = ["groupmm", "torch"] + (["quack"] if QUACK else []) + ["bound"]
            wbar = 0.8 / len(peers)
            for i, who in enumerate(peers):
                ax.bar(
                    [x + (i - (len(peers) - 1) / 2) * wbar for x in xs],
                    [r["tflops"][who] or 0 for r in rows],
                    width=wbar,
                    label="roofline bound" if who == "bound" else who,
                )
            ax.set_xticks(list(xs))
            ax.set_xticklabels(labels, rotation=90, fontsize=6)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(
                f"groupmm vs F.grouped_mm vs quack, and the bound ({args.dtype}, {dev_name})"
            )
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.png, dpi=110)
        except ImportError:
            print("matplotlib missing: no chart")
    return 0


if __name__ == "__main__":
    sys.exit(main())
