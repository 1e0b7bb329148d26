r"""Where one expert-parallel step goes on the GPU: groupmm's fused EP block forward + backward
under torch.profiler, rank 0's kernels by category (gemm, nccl, rows, other) and the GPU's
idle time, with the GPU's and the host's clocks at the step's phase boundaries on every
rank; with exact sizes, fixed sizes (capacity = the tokens per GPU) or both.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W benches/profile_ep.py \
        [--config mixtral] [--tokens-per-gpu 16384] [--modes exact,fixed] \
        [--trace OUT.json.gz] [--md OUT.md] [--device cuda|cpu]
    python3 benches/profile_ep.py --from-json OUT.json [--md OUT.md]   # no GPU

``--md`` also writes the document as JSON beside it (unless ``--json``); with several
modes each mode's trace goes to ``--trace``'s name with ``-MODE`` before its extension.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time

from harness.cli import add_doc_args, init_ranks, line_buffered_stdout, parser
from harness.configs import ep_configs
from harness.report import from_json, one_file, write_outputs
from harness.timing import Clock

CATEGORIES = ("gemm", "nccl", "rows", "other")
MODES = ("exact", "fixed")
#: groupmm.parallel's names that expert_parallel_block looks up there, marked at entry and
#: exit: the plan (exact or fixed sizes), the local routes (either mode's), the experts
MARKED = ("plan_tokens", "plan_fixed", "_local_routes", "routes", "_block")


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--config", default="mixtral", help="a config of harness/configs.py")
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--modes", default="exact", help="comma list of exact, fixed")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--trace", help="rank 0's chrome trace (.json or .json.gz)")
    add_doc_args(p, every="run", merge=False)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad or len(set(args.modes)) != len(args.modes):
        p.error(f"--modes: expected distinct modes of {', '.join(MODES)}, found {args.modes}")
    return args


def trace_path(path: str, mode: str, several: bool) -> str:
    """Rank 0's trace of a mode: ``path`` itself, or with ``-MODE`` before its extension
    when several modes run."""
    if not several:
        return path
    gz = ".gz" if path.endswith(".gz") else ""
    stem, ext = os.path.splitext(path[: len(path) - len(gz)])
    return f"{stem}-{mode}{ext}{gz}"


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


def mode_text(m: dict) -> str:
    if m["mode"] == "exact":
        return "exact (capacity=None: one host sync per call)"
    return f"fixed (capacity={m['capacity']}: no host sync)"


def render_md(doc: dict) -> str:
    modes = doc["modes"]
    lines = [
        f"**{doc['device']} x {doc['world']} ({doc['backend']}); torch "
        f"{doc['torch']}; {doc['dtype']}; {doc['config']} (d, d_ff, E, k) = "
        f"{tuple(doc['dims'])}; {doc['tokens_per_gpu']} tokens per GPU; uniform routing; "
        f"modes: {', '.join(mode_text(m) for m in modes)}**",
        "",
        "```bash",
        doc["argv"],
        "```",
        "",
        "| mode | timed steps (ms, max over ranks per step) | rank 0's profiled step: span "
        "| gemm | nccl | rows | other | idle |",
        "| --- | --- |" + " ---: |" * 6,
    ]
    for m in modes:
        s = m["summary"]
        steps = ", ".join(f"{t:.2f}" for t in m.get("steps_ms") or [])
        lines.append(
            f"| {mode_text(m)} | {steps} | {s['span']:.2f} | {s['gemm']:.2f} | {s['nccl']:.2f} "
            f"| {s['rows']:.2f} | {s['other']:.2f} | {s['idle']:.2f} |"
        )
    for m in modes:
        marks = m["marks"]
        lines += [
            "",
            f"Phase marks of the last timed step, {mode_text(m)} (ms since the step's "
            "start, GPU / host):",
            "",
            "| rank | " + " | ".join(n for n, _, _ in marks[0]) + " |",
            "| --- |" + " ---: |" * len(marks[0]),
        ]
        for r, mk in enumerate(marks):
            lines.append(f"| {r} | " + " | ".join(f"{g:.2f} / {h:.2f}" for _, g, h in mk) + " |")
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
    import groupmm._fixed as gfixed
    import groupmm.parallel as gp
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    dev = init_ranks(args.device, 120)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    rank, W = dist.get_rank(), dist.get_world_size()
    d, f, E, k = ep_configs(args.config)[args.config]
    if E % W:
        raise SystemExit(f"{args.config}: {E} experts do not divide over {W} ranks")
    T, e = args.tokens_per_gpu, E // W
    gen = torch.Generator(device=dev).manual_seed(rank)
    w_in = (torch.randn(e, d, 2 * f, device=dev, generator=gen) * d**-0.5).to(dtype)
    w_out = (torch.randn(e, f, d, device=dev, generator=gen) * f**-0.5).to(dtype)
    x = torch.randn(T, d, device=dev, generator=gen).to(dtype)
    ids = torch.rand(T, E, device=dev, generator=gen).topk(k, dim=1).indices
    weights = torch.rand(T, k, device=dev, generator=gen).softmax(1).to(dtype)
    gy = torch.randn(T, d, device=dev, generator=gen).to(dtype)
    leaves = [t.requires_grad_() for t in (x, weights, w_in, w_out)]

    clock = Clock(cuda)
    marks: list = []

    def mark(name):
        marks.append((name, clock.stamp(), time.perf_counter()))

    def wrap(module, name):
        real = getattr(module, name)

        def marked(*a, **kw):
            mark(name + "<")
            out = real(*a, **kw)
            mark(name + ">")
            return out

        setattr(module, name, marked)

    # expert_parallel_block looks them up in groupmm.parallel (exact sizes), fixed_block
    # in groupmm._fixed (fixed sizes)
    for name in MARKED:
        for module in (gp, gfixed):
            if hasattr(module, name):
                wrap(module, name)

    several = len(args.modes) > 1
    path = args.trace or "/tmp/profile_ep_trace.json"
    results = []
    for mode in args.modes:
        capacity = None if mode == "exact" else T

        def step(capacity=capacity):
            marks.clear()
            mark("start")
            out = gp.expert_parallel_block(x, ids, weights, w_in, w_out, capacity=capacity)
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
            clock.sync()
            a = clock.stamp()
            step()
            b = clock.stamp()
            clock.sync()
            ms = torch.tensor([clock.ms(a, b)], device=dev)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            steps.append(float(ms))
        t0e, t0h = marks[0][1], marks[0][2]
        mine = [(n, clock.ms(t0e, ev), 1e3 * (h - t0h)) for n, ev, h in marks]
        every = [None] * W
        dist.all_gather_object(every, mine)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=1)) as prof:
            for _ in range(3):
                dist.barrier()
                clock.sync()
                step()
                clock.sync()
                prof.step()
        if capacity is not None:
            gp.check_routing()  # the fixed-size calls' routing flags not checked yet
        one = {"mode": mode, "capacity": capacity, "steps_ms": steps, "marks": every}
        if rank == 0:
            mpath = trace_path(path, mode, several)
            raw = mpath[:-3] if mpath.endswith(".gz") else mpath
            prof.export_chrome_trace(raw)
            if mpath.endswith(".gz"):
                with open(raw, "rb") as src, gzip.open(mpath, "wb") as dst:
                    dst.write(src.read())
                os.remove(raw)
            one.update(trace=mpath, summary=summarize(load_trace(mpath)))
        results.append(one)
    if rank == 0:
        doc = {
            "argv": " ".join(
                [f"torchrun --standalone --nproc-per-node {W} benches/profile_ep.py", *sys.argv[1:]]
            ),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "world": W,
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "dtype": str(dtype).replace("torch.", ""),
            "groupmm": groupmm.build_info().get("version"),
            "config": args.config,
            "dims": [d, f, E, k],
            "tokens_per_gpu": T,
            "modes": results,
        }
        print(render_md(doc))
        beside = os.path.splitext(args.md)[0] + ".json" if args.md else None
        write_outputs(doc, args.json or beside, args.md, render_md)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, one_file, lambda doc: print(render_md(doc)), render_md)
        return 0
    ep_configs(args.config)  # an unknown name stops here, before the process group
    return profile(args)


if __name__ == "__main__":
    sys.exit(main())
