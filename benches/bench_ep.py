r"""Expert parallelism (EP) over W GPUs: groupmm's EP MoE layer against torchtitan's, forward
and backward at a fixed number of tokens per GPU, split into dispatch, experts and
combine, with the EP efficiency against the whole layer on one GPU and the all-to-all
bandwidth of the same exchanges.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W benches/bench_ep.py \
        [--configs qwen3-30b-a3b,olmoe,mixtral] [--routing uniform,skewed] \
        [--tokens-per-gpu 16384] [--check] [--json OUT.json] [--md OUT.md] \
        [--device cuda|cpu] [--dtype bf16|fp32|fp64] [--a2a-samples 10] \
        [--impls fused,fixed,pipelined,torchtitan,whole]
    torchrun --standalone --nproc-per-node 2 benches/bench_ep.py --device cpu --configs tiny \
        --check                                  # a smoke run on gloo (CPU)
    python3 benches/bench_ep.py --from-json w1.json,w2.json [--md all.md]   # no GPU

Implementations: ``fused`` (``MoELayer`` with ``ep_group``), ``fixed`` (``ep_capacity=T``),
``pipelined`` (``fixed`` in ``--pipeline-chunks`` slices on ``--pipeline-sms`` SMs),
``torchtitan`` (its ``RoutedExperts``) and ``whole`` (every expert on one GPU, no
exchange). A step's time: the median over ``--rounds`` of the slowest rank's sample.
``--check`` compares the first step with a plain-torch reference (exit code 1 on a failure).
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback

import groupmm
import groupmm._fixed as gfixed
import groupmm.parallel as gpar
import torch
import torch.distributed as dist
from ep_run import agree, run_row
from harness.cli import add_doc_args, init_ranks, leave, line_buffered_stdout, parser
from harness.configs import EP_ROUTINGS as ROUTINGS
from harness.configs import MODELS, ZIPF_S, ep_configs
from harness.report import error_text, from_json, started, write_outputs
from harness.report.ep import (
    IMPLS,
    bandwidth_lines,
    describe,
    format_line,
    merge_docs,
    render_md,
)
from harness.timing import Clock, Mark
from peers.torchtitan import load_torchtitan, torchtitan_version

#: the default configs (--configs), in the order they run (the heaviest last)
DEFAULT_CONFIGS = ("qwen3-30b-a3b", "olmoe", "mixtral")
TT_BACKEND = "spmd_types"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


# ------------------------------------------------------------------------------ the split


class Split:
    """The stamps of the step being timed: ``t0`` (start), ``f1``/``b1`` (received rows,
    forward/backward), ``f2``/``b2`` (expert output), ``f3`` (end of the forward), ``t1``
    (end of the backward). Outside ``begin() ... end()`` marks are plain identities."""

    def __init__(self, clock):
        self.clock, self.enabled, self.cur = clock, True, None

    def begin(self) -> None:
        self.cur = {"t0": self.clock.stamp()}

    def end(self) -> dict:
        assert self.cur is not None
        self.cur["t1"] = self.clock.stamp()
        out, self.cur = self.cur, None
        return out

    def stamp(self, name: str) -> None:
        if self.cur is not None:
            self.cur[name] = self.clock.stamp()

    def mark(self, t, fwd: str, bwd: str):
        if self.cur is None or not self.enabled or not torch.is_tensor(t):
            return t
        return Mark.apply(t, lambda: self.stamp(fwd), lambda: self.stamp(bwd), True)


def install_split(split: Split) -> None:
    """Put the local experts of groupmm's fused EP path (``expert_parallel_block``, exact
    and fixed sizes alike: both call ``groupmm.parallel._block`` between their exchanges)
    between the two marks."""
    real_block = gpar._block

    def block(x, w_in, w_out, offs, src, inverse, weights, up=None):
        x = split.mark(x, "f1", "b1")
        y = real_block(x, w_in, w_out, offs, src, inverse, weights, up)
        return split.mark(y, "f2", "b2")

    gpar._block = block  # expert_parallel_block looks it up here (exact sizes)
    gfixed._block = block  # and fixed_block here (fixed sizes)


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of configs")
    p.add_argument("--routing", default="uniform,skewed", help="uniform, skewed (comma list)")
    p.add_argument(
        "--tokens-per-gpu", type=int, help="tokens per rank (default 16384 on cuda, 64 on cpu)"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    p.add_argument("--pipeline-chunks", type=int, default=2, help="pipelined: token slices")
    p.add_argument(
        "--pipeline-sms", type=int, default=0, help="pipelined: SMs for the experts (0: all)"
    )
    p.add_argument("--warmup", type=int, default=3, help="steps per implementation first")
    p.add_argument("--rounds", type=int, default=8, help="round-robin rounds")
    p.add_argument("--calls", type=int, default=2, help="back-to-back steps per sample")
    p.add_argument("--check", action="store_true", help="compare outputs and gradients first")
    p.add_argument(
        "--a2a-samples",
        type=int,
        default=10,
        help="timed all_to_all_single calls per size and row (0: no bandwidth figures)",
    )
    add_doc_args(p)
    args = p.parse_args(argv)
    if min(args.warmup + 1, args.rounds, args.calls, args.a2a_samples + 1) < 1:
        p.error("--rounds and --calls must be at least 1, --warmup and --a2a-samples at least 0")
    bad = [v for v in args.routing.split(",") if v not in ROUTINGS]
    bad += [v for v in args.impls.split(",") if v not in IMPLS]
    if bad:
        p.error(f"unknown {bad}")
    return args


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, merge_docs, lambda doc: print(render_md(doc)), render_md)
        return 0

    dev = init_ranks(args.device, 120)  # a plain `python3 bench_ep.py`: one rank
    rank, W = dist.get_rank(), dist.get_world_size()
    code = 1
    try:
        code = run(args, argv, dev, rank, W)
    except SystemExit as e:  # a bad argument found after the start: every rank says so
        print(f"[rank {rank}] {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    except Exception as e:  # noqa: BLE001 - print on every rank, then leave
        print(f"[rank {rank}] {error_text(e)}", file=sys.stderr)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    leave(code)


def run(args, argv, dev, rank: int, W: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    cuda = dev.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    T = args.tokens_per_gpu or (16384 if cuda else 64)
    configs = ep_configs(args.configs)
    for name, (_d, _f, E, _k) in configs.items():
        if E % W:
            raise SystemExit(f"{name}: {E} experts do not divide over {W} ranks")
    mesh = init_device_mesh(dev.type, (W,), mesh_dim_names=("ep",))
    group = mesh.get_group()
    clock = Clock(cuda)
    split = Split(clock)
    install_split(split)
    tt, tt_why = None, None
    if "torchtitan" in args.impls.split(","):  # its SPMD backend: its default
        tt, tt_why = load_torchtitan(TT_BACKEND, mesh, gloo=not cuda)
    if not agree(tt is not None, dev):
        tt, tt_why = None, tt_why or "torchtitan failed to load on another rank"
    ctx = dict(
        dev=dev, dtype=dtype, group=group, mesh=mesh, rank=rank, W=W, clock=clock, split=split
    )
    ctx.update(tt=tt, tt_why=tt_why)
    lead = rank == 0
    doc = {
        "schema": "ep-1",
        "complete": False,
        "argv": [
            f"torchrun --standalone --nproc-per-node {W} benches/bench_ep.py",
            *(sys.argv[1:] if argv is None else argv),
        ],
        "started": started(),
        "env": {
            k: os.environ.get(k)
            for k in ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
        },
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "world": W,
        "gpus_visible": torch.cuda.device_count() if cuda else 0,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).replace("torch.", ""),
        "tokens_per_gpu": T,
        "groupmm": groupmm.build_info(),
        "torchtitan": {
            "used": tt is not None,
            "why": None if tt is not None else tt_why,
            "version": torchtitan_version() if tt is not None else None,
            "backend": TT_BACKEND,
        },
        "timer": {
            "clock": "CUDA events" if cuda else "perf_counter",
            "warmup": args.warmup,
            "rounds": args.rounds,
            "calls": args.calls,
            "split": True,
            "a2a_samples": args.a2a_samples,
        },
        "routing": {"uniform": "k distinct uniform experts", "skewed": f"Zipf s={ZIPF_S}"},
        "rows": [],
    }
    if lead:
        for ln in describe(doc):
            print(ln)
    t_start = time.perf_counter()
    failed_check = False
    for cname, (d, f, E, k) in configs.items():
        for routing in args.routing.split(","):
            spec = {
                "config": cname,
                "model": MODELS.get(cname, cname),
                "d_model": d,
                "d_ff": f,
                "experts": E,
                "top_k": k,
                "routing": routing,
                "T": T,
            }
            if lead:
                print(f"== {cname} (d={d} d_ff={f} E={E} k={k}) {routing}, W={W}, T={T}/GPU")
            row = run_row(spec, args, ctx)
            gc.collect()  # the row's closures hold its layers in reference cycles
            if cuda:
                torch.cuda.empty_cache()
            if row["check"] and not row["check"]["ok"]:
                failed_check = True
            if lead:
                for n in IMPLS:
                    if n in row["impls"]:
                        print(format_line(row, n))
                for ln in bandwidth_lines(row):
                    print("   " + ln)
                for n, why in row["errors"].items():
                    print(f"   {n}: {why}")
                doc["rows"].append(row)
                doc["elapsed_s"] = time.perf_counter() - t_start
                write_outputs(doc, args.json, args.md, render_md)
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - t_start
    if lead:
        write_outputs(doc, args.json, args.md, render_md)
        print()
        print(render_md(doc))
        print(f"wall {doc['elapsed_s']:.0f} s")
    return 1 if failed_check else 0


if __name__ == "__main__":
    sys.exit(main())
