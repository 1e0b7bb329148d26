"""Where one expert-parallel step goes on the GPU: groupmm's fused EP block
(``groupmm.parallel.expert_parallel_block``) forward + backward under torch.profiler, rank
0's kernels put in categories and the time the GPU sat idle, with the host's and the GPU's
clocks at the step's phase boundaries on every rank.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W benches/profile_ep.py \\
        [--config mixtral] [--tokens-per-gpu 16384] [--trace OUT.json.gz] [--md OUT.md]
    python3 benches/profile_ep.py --from-trace OUT.json.gz [--md OUT.md]   # no GPU

Every rank: its own tokens ``x [T, d]`` (bf16), uniform top-k routing (k distinct experts),
router weights, its ``E / W`` experts; gradients set to None after every step (as
bench_ep.py). Four warm-up steps, then five timed steps (CUDA events; a barrier and a
``torch.cuda.synchronize`` before each), the phase marks of the last one (plan, local
routes, experts, end of forward, end of backward; GPU and host ms since the step's start:
where the two agree the GPU was waiting for the host), then one step under the profiler
(``schedule(wait=1, warmup=1, active=1)``, a barrier before each step so that no rank's
profiler start delays the others).

Summary of rank 0's profiled step (``summarize``): kernel time by category (``gemm``:
groupmm's varlen kernels; ``nccl``: the exchanges, including the time a rank waits in
them for a slower one; ``rows``: groupmm's row kernels; ``other``: torch's kernels and
copies) and ``idle``: the GPU's gaps between the first and the last kernel of the step
(the host not keeping up, mostly before the first product: the plan's host sync and the
ops after it).
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import sys
import time

from cli import line_buffered_stdout, parser  # benches/cli.py, same folder
from moe_configs import CONFIGS  # benches/moe_configs.py, same folder

CATEGORIES = ("gemm", "nccl", "rows", "other")


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--config", default="mixtral", help="a name of benches/moe_configs.py")
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--trace", help="rank 0's chrome trace (.json or .json.gz)")
    p.add_argument("--md", help="the summary in markdown (rank 0)")
    p.add_argument("--from-trace", help="summarize a saved trace; no GPU, no torchrun")
    return p.parse_args(argv)


def category(name: str) -> str:
    if name.startswith("ncclDevKernel") or "nccl" in name.lower():
        return "nccl"
    if "gmm::varlen" in name or "cutlass" in name:
        return "gemm"
    if "gmm::rows_kernels" in name:
        return "rows"
    return "other"


def summarize(events: list) -> dict:
    """Kernel ms by category, the GPU's idle ms and the span, from a chrome trace's
    events (one step)."""
    gpu = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    gpu.sort(key=lambda e: e["ts"])
    out = {c: 0.0 for c in CATEGORIES}
    out["idle"] = 0.0
    if not gpu:
        out["span"] = 0.0
        return out
    end = gpu[0]["ts"]
    for e in gpu:
        out[category(e["name"])] += e["dur"] / 1e3
        out["idle"] += max(0.0, e["ts"] - end) / 1e3
        end = max(end, e["ts"] + e["dur"])
    out["span"] = (end - gpu[0]["ts"]) / 1e3
    return out


def render_md(doc: dict) -> str:
    s = doc["summary"]
    lines = [
        f"**{doc['device']} x {doc['world']} (nccl); torch {doc['torch']}; bfloat16; "
        f"{doc['config']} (d, d_ff, E, k) = {tuple(doc['dims'])}; {doc['tokens_per_gpu']} "
        "tokens per GPU; uniform routing**",
        "",
        "```bash",
        doc["argv"],
        "```",
        "",
        "timed steps (ms, max over ranks per step): "
        + ", ".join(f"{t:.2f}" for t in doc.get("steps_ms", [])),
        "",
        "| rank 0's profiled step | span | gemm | nccl | rows | other | idle |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| ms | {s['span']:.2f} | {s['gemm']:.2f} | {s['nccl']:.2f} | {s['rows']:.2f} | "
        f"{s['other']:.2f} | {s['idle']:.2f} |",
        "",
        "Phase marks of the last timed step (ms since the step's start, GPU / host):",
        "",
        "| rank | " + " | ".join(n for n, _, _ in doc["marks"][0]) + " |",
        "| --- |" + " ---: |" * len(doc["marks"][0]),
    ]
    for r, marks in enumerate(doc["marks"]):
        lines.append(f"| {r} | " + " | ".join(f"{g:.2f} / {h:.2f}" for _, g, h in marks) + " |")
    lines += [
        "",
        "gemm: groupmm's varlen kernels; nccl: the exchanges (a rank's wait for a slower one "
        "included); rows: groupmm's row kernels; other: torch's kernels and copies; idle: the "
        "GPU's gaps between the step's first and last kernel.",
    ]
    return "\n".join(lines) + "\n"


def load_trace(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


def profile(args) -> int:
    import groupmm
    import groupmm.parallel as gp
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=dev)
    rank, W = dist.get_rank(), dist.get_world_size()
    d, f, E, k = CONFIGS[args.config]
    if E % W:
        raise SystemExit(f"{args.config}: {E} experts do not divide over {W} ranks")
    T, e = args.tokens_per_gpu, E // W
    gen = torch.Generator(device=dev).manual_seed(rank)
    w_in = (torch.randn(e, d, 2 * f, device=dev, generator=gen) * d**-0.5).bfloat16()
    w_out = (torch.randn(e, f, d, device=dev, generator=gen) * f**-0.5).bfloat16()
    x = torch.randn(T, d, device=dev, generator=gen).bfloat16()
    ids = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices
    weights = torch.rand(T, k, device=dev, generator=gen).softmax(1).bfloat16()
    gy = torch.randn(T, d, device=dev, generator=gen).bfloat16()
    leaves = [t.requires_grad_() for t in (x, weights, w_in, w_out)]

    marks: list = []

    def mark(name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, ev, time.perf_counter()))

    def wrap(name):
        real = getattr(gp, name)

        def marked(*a, **kw):
            mark(name + "<")
            out = real(*a, **kw)
            mark(name + ">")
            return out

        setattr(gp, name, marked)

    for name in ("plan_tokens", "_local_routes", "_block"):
        wrap(name)  # expert_parallel_block looks them up in groupmm.parallel

    def step():
        marks.clear()
        mark("start")
        out = gp.expert_parallel_block(x, ids, weights, w_in, w_out)
        mark("forward")
        out.backward(gy)
        mark("backward")
        for t in leaves:
            t.grad = None

    for _ in range(4):
        step()
    steps = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        ms = torch.tensor([a.elapsed_time(b)], device=dev)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        steps.append(float(ms))
    t0e, t0h = marks[0][1], marks[0][2]
    mine = [(n, t0e.elapsed_time(ev), 1e3 * (h - t0h)) for n, ev, h in marks]
    every = [None] * W
    dist.all_gather_object(every, mine)
    with profile(
        activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
        schedule=schedule(wait=1, warmup=1, active=1),
    ) as prof:
        for _ in range(3):
            dist.barrier()
            torch.cuda.synchronize()
            step()
            torch.cuda.synchronize()
            prof.step()
    if rank == 0:
        path = args.trace or "/tmp/profile_ep_trace.json"
        raw = path[:-3] if path.endswith(".gz") else path
        prof.export_chrome_trace(raw)
        if path.endswith(".gz"):
            with open(raw, "rb") as src, gzip.open(path, "wb") as dst:
                dst.write(src.read())
            os.remove(raw)
        doc = {
            "argv": " ".join(
                [f"torchrun --standalone --nproc-per-node {W} benches/profile_ep.py", *sys.argv[1:]]
            ),
            "device": torch.cuda.get_device_name(dev),
            "world": W,
            "torch": torch.__version__,
            "groupmm": groupmm.build_info().get("version"),
            "config": args.config,
            "dims": [d, f, E, k],
            "tokens_per_gpu": T,
            "steps_ms": steps,
            "marks": every,
            "summary": summarize(load_trace(path)),
        }
        md = render_md(doc)
        print(md)
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(md)
            with open(os.path.splitext(args.md)[0] + ".json", "w") as fh:
                json.dump(doc, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_trace:
        s = summarize(load_trace(args.from_trace))
        print("  ".join(f"{k} {v:.2f} ms" for k, v in s.items()))
        return 0
    if args.config not in CONFIGS:
        raise SystemExit(f"unknown config {args.config!r}; known: {', '.join(CONFIGS)}")
    return profile(args)


if __name__ == "__main__":
    sys.exit(main())
