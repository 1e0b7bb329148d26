"""Where the time of one grouped call goes: GPU kernels (name, count, µs) and CUDA
runtime calls on the host, for groupmm and F.grouped_mm side by side (torch.profiler /
CUPTI; no ncu needed).

    python3 benches/profile_gpu.py [--shapes small64,qwen3-up] [--iters 20] [--json out.json]

Per case and peer it prints, per call: the GPU span (first kernel start to last kernel
end over `iters` back-to-back calls, divided by iters), the summed kernel time, each
kernel's mean duration, and the host time spent in each CUDA runtime function.
"""

import argparse
import json
import math

import groupmm
import torch
from harness.configs import SHAPES, counts_for
from torch.profiler import ProfilerActivity, profile


def short(name: str) -> str:
    """A readable label for a (mangled) kernel name."""
    for key in ("build_packed_args", "zero_fill", "prepare_grouped_gemm_data"):
        if key in name:
            return key
    if "GemmUniversal" in name:
        kind = "pingpong" if "Pingpong" in name else "cooperative" if "Cooperative" in name else ""
        return f"cutlass GEMM {kind}"
    return name[:90]


def dev_time(e) -> float:
    return getattr(e, "device_time", None) or getattr(e, "cuda_time", 0.0)


def profile_calls(fn, iters: int):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels, runtime = {}, {}
    first, last = math.inf, -math.inf
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(short(e.name), [0, 0.0])
            k[0] += 1
            k[1] += dev_time(e)
            first = min(first, e.time_range.start)
            last = max(last, e.time_range.end)
        elif e.name.startswith("cu"):
            r = runtime.setdefault(e.name, [0, 0.0])
            r[0] += 1
            r[1] += e.cpu_time_total
    return {
        "span_us": (last - first) / iters if kernels else None,
        "kernel_us": sum(v[1] for v in kernels.values()) / iters,
        "kernels": {n: (c / iters, t / c) for n, (c, t) in kernels.items()},
        "runtime": {n: (c / iters, t / iters) for n, (c, t) in runtime.items()},
    }


def cases(shapes):
    dt = torch.bfloat16
    for name in shapes:
        E, K, N, T = SHAPES[name]
        for routing in ("uniform", "skewed"):
            offs = torch.tensor(counts_for(E, T, routing), device="cuda").cumsum(0)
            offs = offs.to(torch.int32)
            x = torch.randn(T, K, device="cuda", dtype=dt)
            w = torch.randn(E, K, N, device="cuda", dtype=dt) / math.sqrt(K)
            dy = torch.randn(T, N, device="cuda", dtype=dt)
            yield f"{name} {routing} fwd", (x, w, offs)
            yield f"{name} {routing} dX", (dy, w.transpose(-2, -1), offs)
            yield f"{name} {routing} dW", (x.t(), dy, offs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="small64,qwen3-up,qwen3-down")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    args = p.parse_args()
    torch_gmm = torch.nn.functional.grouped_mm
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    out = {}
    for label, (a, b, offs) in cases(args.shapes.split(",")):
        for peer, f in (("groupmm", groupmm.grouped_mm), ("torch", torch_gmm)):
            r = profile_calls(lambda f=f, a=a, b=b, o=offs: f(a, b, offs=o), args.iters)
            out[f"{label} {peer}"] = r
            print(
                f"\n== {label} [{peer}] span {r['span_us']:.1f} µs/call, "
                f"kernels {r['kernel_us']:.1f} µs/call"
            )
            for n, (c, t) in sorted(r["kernels"].items(), key=lambda kv: -kv[1][1]):
                print(f"   gpu {t:8.1f} µs x{c:.0f}  {n}")
            for n, (c, t) in sorted(r["runtime"].items(), key=lambda kv: -kv[1][1]):
                print(f"   host {t:7.1f} µs x{c:.0f}  {n}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
