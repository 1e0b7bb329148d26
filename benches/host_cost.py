"""Host cost per call of groupmm on a small packed problem, next to F.grouped_mm: the
forward, the forward on inputs that require grad and forward+backward, then where
groupmm's time goes (the Rust entry points alone, allocations, the Python layer).

    python3 benches/host_cost.py [--device cpu|cuda] [--dtype bf16|f16|f32]
                                 [--shape E,K,N,T] [--calls 2000] [--repeats 7]
"""

import argparse
import statistics
import time

import groupmm
import torch
from groupmm import _native

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def per_call_us(fn, calls, repeats=1, sync=torch.cuda.synchronize):
    """Median host µs per call of ``fn`` over ``repeats`` runs of ``calls`` calls issued
    without a sync (the GPU work is tiny: the host is the bottleneck)."""
    for _ in range(min(200, calls)):
        fn()
    runs = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        sync()
        runs.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(runs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--shape", default="8,128,128,256", help="E,K,N,T")
    args = p.parse_args()
    dev, dt = args.device, DTYPES[args.dtype]
    E, K, N, T = (int(v) for v in args.shape.split(","))
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)

    def per_call(fn):
        return per_call_us(fn, args.calls, args.repeats, sync)

    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(T, K, generator=g).to(dev, dt)
    w = torch.randn(E, K, N, generator=g).to(dev, dt)
    offs = torch.full((E,), T // E, dtype=torch.int32).cumsum(0).to(dev, torch.int32)
    gy = torch.randn(T, N, generator=g).to(dev, dt)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()

    native_mm, native_bwd = _native.grouped_mm, _native.grouped_mm_backward
    peer, peer_name = getattr(torch.nn.functional, "grouped_mm", None), "F.grouped_mm"
    if peer is not None:
        try:
            peer(x, w, offs=offs)
        except (RuntimeError, NotImplementedError) as e:  # no kernel for device/dtype
            print(f"F.grouped_mm unavailable here: {str(e).splitlines()[0]}")
            peer = None

    print(
        f"host µs per call: {dev} ({_device_name(dev)}), torch {torch.__version__}, "
        f"groupmm {groupmm.__version__}, {args.dtype}, E={E} K={K} N={N} T={T}, "
        f"median of {args.repeats} x {args.calls} calls"
    )
    side = {
        "forward (no grad)": (
            lambda: groupmm.grouped_mm(x, w, offs=offs),
            peer and (lambda: peer(x, w, offs=offs)),
        ),
        "forward (inputs require grad)": (
            lambda: groupmm.grouped_mm(xg, wg, offs=offs),
            peer and (lambda: peer(xg, wg, offs=offs)),
        ),
        "forward+backward (autograd)": (
            lambda: groupmm.grouped_mm(xg, wg, offs=offs).backward(gy),
            peer and (lambda: peer(xg, wg, offs=offs).backward(gy)),
        ),
    }
    print(f"{'':32s}{'groupmm':>10s}{peer_name:>14s}{'ratio':>8s}")
    ours = {}
    for name, (mine, theirs) in side.items():
        ours[name] = per_call(mine)
        other = per_call(theirs) if theirs else float("nan")
        print(f"{name:32s}{ours[name]:10.1f}{other:14.1f}{ours[name] / other:8.2f}")

    print("breakdown:")
    nf = per_call(lambda: native_mm(x, w, offs))
    nb = per_call(lambda: native_bwd(gy, x, w, offs))
    rows = [
        (per_call(lambda: torch.empty(T, N, device=dev, dtype=dt)), "torch.empty([T,N])"),
        (per_call(lambda: x.new_empty((T, N))), "x.new_empty([T,N])"),
        (per_call(lambda: torch.mm(x, w[0])), "torch.mm (one group's product)"),
        (nf, "_native.grouped_mm (Rust entry, no Python glue)"),
        (nb, "_native.grouped_mm_backward (both products)"),
        (ours["forward (no grad)"] - nf, "Python layer, forward (no grad)"),
        (ours["forward (inputs require grad)"] - nf, "Python layer + autograd node, forward"),
        (
            ours["forward+backward (autograd)"] - nf - nb,
            "Python layer + autograd engine, forward+backward",
        ),
    ]
    for us, name in rows:
        print(f"{us:10.1f}  {name}")


def _device_name(dev):
    if dev.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"{torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
