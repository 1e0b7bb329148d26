r"""Can the exchanges of expert parallelism overlap the expert GEMMs? Per config, one expert
product of a rank's received rows and the all_to_all of those rows, timed alone, one after
the other (``serial``) and at once (``overlap``: the exchange on NCCL's stream under the
product), for groupmm's product (also under ``groupmm.sm_limit``) and torch's: an
expert-parallel design experiment (the SM cap beside the exchanges) on the benches' harness.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W dev/ep_overlap.py \
        [--configs mixtral,qwen3-30b-a3b] [--tokens-per-gpu 16384] [--samples 15] \
        [--sm-limits 120,108] [--json OUT.json] [--md OUT.md]
    python3 dev/ep_overlap.py --from-json OUT.json [--md OUT.md]   # render; no GPU
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

# the benches' harness, as when run from benches/
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "benches"))

import groupmm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from harness.cli import comma_list, init_ranks, line_buffered_stdout, parser  # noqa: E402
from harness.configs import ep_configs  # noqa: E402
from harness.report import from_json, one_file, started, write_outputs  # noqa: E402

VARIANTS = ("gemm", "a2a", "serial", "overlap")


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--configs", default="mixtral,qwen3-30b-a3b", help="comma list")
    p.add_argument("--tokens-per-gpu", type=int, default=16384)
    p.add_argument("--samples", type=int, default=15, help="round-robin rounds")
    p.add_argument(
        "--sm-limits",
        default="",
        help="comma list of SM counts: groupmm's product also measured under "
        "groupmm.sm_limit(n) for each (its persistent grid leaves the other SMs to NCCL)",
    )
    p.add_argument("--json", help="results (rank 0)")
    p.add_argument("--md", help="the table in markdown (rank 0)")
    p.add_argument("--from-json", help="render a result file; no GPU, no torchrun")
    return p.parse_args(argv)


def received_rows(T: int, E: int, k: int, W: int, gen: torch.Generator) -> int:
    """Rows one rank sends (and, on average, receives) with one copy per (token, rank)
    under uniform top-k routing (k distinct experts), rounded to a multiple of W."""
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    ranks = ids // (E // W)
    needed = torch.zeros(T, W, dtype=torch.bool).scatter_(1, ranks, True)
    return int(needed.sum()) // W * W


def timed(fn, dev) -> float:
    torch.cuda.synchronize(dev)
    dist.barrier()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize(dev)
    return a.elapsed_time(b)


def run_config(name: str, T: int, samples: int, dev, W: int, limits=()) -> dict:
    d, f, E, k = ep_configs(name)[name]
    rows = received_rows(T, E, k, W, torch.Generator().manual_seed(0))
    groups = E // W
    x = torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, d, 2 * f, device=dev, dtype=torch.bfloat16) * d**-0.5
    offs = (torch.arange(1, groups + 1, device=dev) * rows // groups).to(torch.int32)
    send = torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
    recv = torch.empty_like(send)

    def a2a(async_op=False):
        return dist.all_to_all_single(recv, send, async_op=async_op)

    out = {"config": name, "d_model": d, "d_ff": f, "experts": E, "top_k": k, "rows": rows}
    out["a2a_mb_per_rank"] = send.numel() * send.element_size() / 1e6

    def limited(n):
        def gemm():
            with groupmm.sm_limit(n):
                return groupmm.grouped_mm(x, w, offs=offs)

        return gemm

    impls = [
        ("groupmm", lambda: groupmm.grouped_mm(x, w, offs=offs)),
        ("torch", lambda: F.grouped_mm(x, w, offs=offs)),
    ]
    impls += [(f"groupmm-sm{n}", limited(n)) for n in limits]
    out["impls"] = [name for name, _ in impls]
    for impl, gemm in impls:

        def overlap(gemm=gemm):
            work = a2a(True)
            gemm()
            work.wait()

        fns = {"gemm": gemm, "a2a": a2a, "serial": lambda gemm=gemm: (a2a(), gemm())}
        fns["overlap"] = overlap
        got = {v: [] for v in VARIANTS}
        for r in range(3 + samples):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                ms = timed(fns[v], dev)
                slowest = torch.tensor([ms], device=dev)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                if r >= 3:
                    got[v].append(float(slowest))
        med = {v: statistics.median(s) for v, s in got.items()}
        med["ideal"] = max(med["gemm"], med["a2a"])
        out[impl] = {"median_ms": med, "samples_ms": got}
    return out


def render_md(doc: dict) -> str:
    lines = [
        f"**device {doc['device']} x {doc['world']} (nccl); torch {doc['torch']}; bfloat16; "
        f"{doc['tokens_per_gpu']} tokens per GPU**",
        "",
        "```bash",
        doc["argv"],
        "```",
        "",
        "| config (d, d_ff, E, k) | rows per rank | a2a MB per rank | product | gemm ms | "
        "a2a ms | serial ms | overlap ms | ideal ms | overlap / serial |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in doc["rows"]:
        cfg = f"{row['config']} ({row['d_model']}, {row['d_ff']}, {row['experts']}, {row['top_k']})"
        for impl in row.get("impls", ("groupmm", "torch")):
            m = row[impl]["median_ms"]
            lines.append(
                f"| {cfg} | {row['rows']} | {row['a2a_mb_per_rank']:.0f} | {impl} | "
                f"{m['gemm']:.3f} | {m['a2a']:.3f} | {m['serial']:.3f} | {m['overlap']:.3f} | "
                f"{m['ideal']:.3f} | {m['overlap'] / m['serial']:.3f} |"
            )
    lines += [
        "",
        "median over rounds of the slowest rank's time; serial: the exchange then the product; "
        "overlap: the exchange on NCCL's stream (async_op=True) under the product; ideal: "
        "max(gemm, a2a).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, one_file, lambda doc: print(render_md(doc)), render_md)
        return 0
    dev = init_ranks("cuda", 120)
    rank, W = dist.get_rank(), dist.get_world_size()
    doc = {
        "schema": "ep-overlap-1",
        "argv": " ".join(
            [f"torchrun --standalone --nproc-per-node {W} dev/ep_overlap.py", *sys.argv[1:]]
        ),
        "started": started(),
        "device": torch.cuda.get_device_name(dev),
        "world": W,
        "torch": torch.__version__,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "tokens_per_gpu": args.tokens_per_gpu,
        "groupmm": groupmm.build_info(),
        "rows": [],
    }
    for name in ep_configs(args.configs):
        limits = [int(v) for v in comma_list(args.sm_limits)] if args.sm_limits else []
        row = run_config(name, args.tokens_per_gpu, args.samples, dev, W, limits)
        doc["rows"].append(row)
        if rank == 0:
            for impl in row["impls"]:
                m = row[impl]["median_ms"]
                print(
                    f"{name} W={W} {impl}: gemm {m['gemm']:.3f} a2a {m['a2a']:.3f} "
                    f"serial {m['serial']:.3f} overlap {m['overlap']:.3f} ideal {m['ideal']:.3f}"
                )
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump(doc, fh, indent=1)
    if rank == 0:
        print(render_md(doc))
        write_outputs(doc, None, args.md, render_md)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
