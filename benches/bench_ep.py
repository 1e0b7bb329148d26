"""Expert parallelism (EP) over W GPUs: groupmm's EP MoE layer against torchtitan's, forward
and backward at a fixed number of tokens per GPU, each step split into dispatch, experts
and combine, its EP efficiency against the whole layer on one GPU, and the all-to-all
bandwidth of the same exchanges.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W benches/bench_ep.py \\
        [--configs qwen3-30b-a3b,olmoe,mixtral] [--routing uniform,skewed] \\
        [--tokens-per-gpu 16384] [--check] [--json OUT.json] [--md OUT.md] \\
        [--device cuda|cpu] [--dtype bf16|fp32|fp64] \\
        [--impls fused,fixed,unfused,torchtitan,tt_groupmm,tt_seam,whole,single] \\
        [--a2a-samples 10]
    torchrun --standalone --nproc-per-node 2 benches/bench_ep.py --device cpu --configs tiny \\
        --check                                  # a smoke run on gloo (CPU)
    python3 benches/bench_ep.py --from-json w1.json,w2.json,w4.json [--md all.md]
                                                 # one table of several runs; no GPU

W = 1 runs the same code (an EP group of one rank: the exchanges move nothing off the GPU).
Rank r owns experts r*E/W ... (r+1)*E/W - 1 (E divisible by W); every rank has its own
tokens. One EP step on each rank: route locally, exchange the per-expert counts, one host
sync for the split sizes, all_to_all of the token copies, the local experts on the
received rows, the reverse all_to_all, the weighted combine; the backward runs the
exchanges in reverse. With fixed sizes (``fixed``) no counts and no host sync: every rank
sends T rows to every rank (padding where a token has no expert there).

Implementations (``--impls``), all on the same EP process group (a one-dimensional
``DeviceMesh`` named "ep" over the world):

- ``fused``: ``groupmm.moe.MoELayer(d, f, E, k, aux_loss_coef=0, ep_group=group)``, the
  default fused path (``groupmm.parallel.expert_parallel_block``: local experts as
  ``groupmm.fused``'s block on the received rows read through a routed index);
- ``unfused``: ``MoELayer(..., fused=False, ep_group=group)`` sharing the same expert
  weights (the old examples/expert_parallel.py design: permute the received rows,
  ``GroupedExperts``, back to received order);
- ``fixed``: ``fused`` with fixed-size exchanges, ``MoELayer(..., ep_group=group,
  ep_capacity=T)`` (every rank has the same T tokens here) sharing the same expert
  weights: equal-split all_to_all of T rows per pair of ranks, no host sync (the host
  runs ahead of the GPU), at the cost of ``groupmm.parallel.fixed_exchange_rows(E, W, k)``
  times the exact exchange's rows and larger expert intermediates;
- ``pipelined``: ``fixed`` in ``--pipeline-chunks`` slices (``ep_chunks``), each slice's
  exchanges on a second CUDA stream under another slice's experts, the expert kernels
  on ``--pipeline-sms`` SMs (``groupmm.sm_limit``; 0: all) so that NCCL gets the rest;
- ``torchtitan``: torchtitan's own classes (when ``import torchtitan`` works; else skipped
  and the output says why): ``RoutedExperts`` = ``AllToAllTokenDispatcher`` +
  ``GroupedExperts`` (``torch._grouped_mm``, w1/w3/w2 in bf16), called as its
  ``MoE.forward`` calls it (the per-expert token counts from its one-hot routing map
  included), with torchtitan's default SPMD backend ``spmd_types`` (``--tt-backend
  partial_dtensor`` for the functional-collectives path) and the EP mesh wired as its
  trainer does (``set_spmd_meshes`` + ``wire_meshes``). Its weights are copies of groupmm's
  (w1 = gate^T, w3 = up^T, w2 = w_out^T), in the bench's dtype. On gloo its uneven
  list-form ``all_to_all`` (which gloo lacks) goes through ``all_to_all_single``
  (``spmd_types._dist.set_dist``, the hook spmd_types provides for that); on NCCL nothing
  is replaced.
- ``tt_groupmm``: the same torchtitan classes with its ``GroupedExperts`` switched to
  groupmm's fused block by ``groupmm.integrations.torchtitan.enable`` (torchtitan's own
  dispatcher and combine, groupmm's experts: what a torchtitan user gets from one call);
  ``tt_seam``: the same with only its ``_grouped_mm`` products on ``groupmm.grouped_mm``
  (``enable(..., fused=False)``);
- ``whole``: the whole layer on this one GPU, no exchange: all E experts (the global
  weights every rank's shard is sliced from, gathered), this rank's own T tokens with
  their own routing (global expert ids, k copies each), ``routes`` +
  ``groupmm.fused.expert_block`` forward and backward (the router weights a leaf as for
  the others): the single-GPU fused layer at the same tokens per GPU, the reference of
  the EP efficiency. Its whole step is its experts time.
- ``single``: the single-GPU reference for "EP expert time within 10 % of the single-GPU
  fused layer on the same local rows": ``routes`` + ``groupmm.fused.expert_block``
  forward and backward on this rank's received rows (their number and their local experts
  from the routing of every rank, k = 1), no exchange. Its whole step is its experts time.

EP efficiency (the headline figure, the first table of the markdown): ``whole``'s step /
an EP implementation's step (both the median over the rounds of the slowest rank's
sample), for every EP implementation (groupmm's fused, fixed and unfused, torchtitan's):
1.0 when EP over W GPUs costs nothing over the same tokens per GPU on one GPU with every
expert; the goal is >= 0.90 on fine-grained configs. The min-max of the round-by-round
ratios is in the step table.

The same routing for all (like for like): per configuration and routing every rank draws
its tokens ``x [T, d]``, expert ids ``[T, k]`` and router weights ``[T, k]`` (softmax of
random logits: a leaf that gets its gradient through each implementation's combine) once,
and every implementation runs on exactly those, every step. groupmm's layers run their
real ``forward`` with the router swapped for a stub that returns these ids and weights
(``FixedRouter``: the weights cast to the layer's dtype as its router does); torchtitan
gets them as its router's float32 scores. The router's gate (a ``[T, d] x [d, E]`` GEMM,
softmax, top-k) is the same replicated work for every implementation and no part of EP:
it is left out.

Configs (d_model, d_ff, E, top-k): ``qwen3-30b-a3b`` (2048, 768, 128, 8), ``olmoe`` (2048,
1024, 64, 8), ``mixtral`` (4096, 14336, 8, 2, the larger-expert one: at 16384 tokens per
GPU and W = 1 its 8 experts, their gradients, torchtitan's copies and the activations of
the skewed routing fit an 80 GB GPU); any other name of benches/bench_moe.py's table;
``tiny`` (16, 32, 8, 2) for the CPU.

Routing (``--routing``): ``uniform``: each token's k experts distinct and uniformly random
(every rank receives about T*k rows); ``skewed``: k distinct experts drawn without
replacement with Zipf popularity p(e) ~ 1/(e+1) over the global expert id e, so rank 0
owns the most popular experts and receives the most rows (for qwen3 at W = 4 about 2.8x
the mean, the last rank about 0.3x; each row reports the received rows per rank).

Timing: the pattern of benches/timing.py's ``round_robin`` (warm-up, then rounds in which
the implementations take turns, the start rotating each round, ``timing.rr_orders``; a
sample is ``--calls`` back-to-back steps between two CUDA events), with what EP needs:
every rank runs the same fixed number of steps per sample (``round_robin`` picks it per
rank from its own estimate, which would pair different collectives across ranks), no GPU
spin before a sample (every EP step syncs with the host once, so the host cannot run
ahead; ``fixed``, ``whole`` and ``single`` have none, their host may run ahead within
a sample), and a ``torch.cuda.synchronize`` + barrier before each sample so all ranks
start it together. The step time of an implementation is the median over the rounds of the
slowest rank's sample (the slowest rank decides the step); tokens/s per GPU = tokens per
GPU / that time.

The split, in the same timed steps: CUDA events (``perf_counter`` on the CPU) recorded by
identity autograd functions at two boundaries, "received rows ready" (before the local
experts) and "expert output ready" (after them), in the forward and again in the backward
when the gradient passes them, plus the start, the end of the forward and the end of the
backward: dispatch = start -> received (fwd) + its gradient -> end (bwd); experts = the
local experts fwd + bwd; combine = expert output -> end of forward + start of backward ->
the gradient of the expert output. The three add up to the step. For groupmm the
boundaries are placed around the local experts: ``groupmm.parallel._block`` on the fused
paths (``expert_parallel_block``, exact and fixed sizes) and the local-experts callable that
``groupmm.parallel.dispatch_combine`` takes on the unfused one (the bench wraps both in
their modules); for torchtitan by hooks on its ``GroupedExperts``. Each implementation's
split follows its own code: groupmm's local expert order (sorting the received rows'
local ids) is in dispatch on the fused path and in experts on the unfused one;
torchtitan's permute
to expert-major order and back are in its dispatcher (dispatch, combine). Waiting for a
slower rank shows up in the exchanges of the faster ones, so the per-phase maxima over
ranks (the table's columns) need not add up to the step time; the JSON has every rank's.
The experts ratio: an implementation's experts time over ``single``'s on the same rank,
the largest over the ranks.

Check (``--check``): the first step of every implementation, before any timing: its
output and its gradients of x, the router weights and the local experts' weights (w_in,
w_out layout; ``whole``'s: its gradient of every expert summed over the ranks, this rank's
slice) against a plain-torch reference (every expert gathered on every rank, a loop over
experts in float32, float64 for fp64; the expert gradients summed over ranks) and against
``fused``, as relative Frobenius differences (largest over ranks; computed in float64 for
fp64, else float32). Tolerances: 1e-10 (fp64), 1e-4 (fp32), 3e-2 (bf16, and torchtitan
always: it computes in bf16). A failed check is reported (and the exit code is 1) but the
timing goes on.

Bandwidth, per row, after the rounds: ``dist.all_to_all_single`` (NCCL or gloo) of
contiguous ``[rows, d]`` buffers in the bench's dtype, equal splits (``rows / W`` to each
rank, its own included), at two sizes: the fixed-size exchange's (``W * T`` rows per rank)
and the exact dispatch's (the rows ``fused``'s plan sends, ``groupmm.parallel.
plan_tokens``' in_splits, the mean over ranks rounded to a multiple of W); three warm-up
calls, then ``--a2a-samples`` (10) samples, a synchronize and a barrier before each; the
time is the median over the samples of the slowest rank's. Reported: rows sent per rank,
the bytes that leave a rank (``rows * (W - 1) / W * d * element size``) and GB/s per rank
(those bytes / the time). For ``fused`` and ``fixed`` the rows of each exchange of a step
(from the plan, outside the timing): the forward dispatch sends each rank's planned rows
(``W * T`` with fixed sizes), the forward return sends back the rows it received; the
backward sends the same sizes the other way (the return's gradient in the combine phase,
the dispatch's gradient in the dispatch phase). Bytes count the ``[rows, d]`` rows only
(the ids and weights that ride along, k values a row, are left out). Their "achieved"
bandwidth is the dispatch phase's off-rank bytes (the forward dispatch and its gradient,
mean over ranks) over the dispatch phase's time (the table's, largest over ranks); the
phase includes the dispatch's work besides the exchanges (the plan, the row gathers, the
sums of the backward), so this is a lower bound of the exchanges' bandwidth.

Outputs: a line per measurement on rank 0 as it goes, the markdown tables at the end
(``--md`` too), and ``--json`` rewritten after every (config, routing): the device, GPU
count, torch/CUDA/torchtitan versions, groupmm's build_info, the command line, the date
and every raw number (per rank, per round).

Failures: an implementation that raises in its first or warm-up steps (on any rank) is
left out of the row on every rank and the row says why; a rank that fails inside a
collective later leaves the others waiting, and the process group's timeout
(``--timeout-s``, 120 s) ends the run (the JSON keeps the rows measured before).

Overlap (chunked dispatch) is not offered: benches/ep_overlap.py measured that an
exchange issued under an expert GEMM takes as long as the two in turn (the products are
persistent kernels), so the library does not chunk the dispatch (docs/expert_parallel.md).

Code: one row on every rank in benches/ep_run.py, the split in benches/ep_split.py, rows
and markdown in benches/ep_report.py, torchtitan's adapter in benches/peer_torchtitan.py,
the configs in benches/moe_configs.py.
"""

from __future__ import annotations

import gc
import os
import sys
import time

import groupmm
import torch
import torch.distributed as dist
from ep_report import (
    IMPLS,
    bandwidth_lines,
    describe,
    format_line,
    merge_docs,
    render_md,
)
from ep_run import ROUTINGS, TT_IMPLS, ZIPF_S, agree, run_row
from ep_split import Clock, Split, install_split
from harness.cli import (
    comma_list,
    init_ranks,
    line_buffered_stdout,
    parser,
)
from harness.configs import CONFIGS, MODELS
from harness.report import (
    error_text,
    from_json,
    started,
    write_outputs,
)
from peers.torchtitan import load_torchtitan, torchtitan_version

#: the default configs (--configs), in the order they run (the heaviest last)
DEFAULT_CONFIGS = ("qwen3-30b-a3b", "olmoe", "mixtral")
TINY = {"tiny": (16, 32, 8, 2)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


# ----------------------------------------------------------------------------------------
# main


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
    p.add_argument("--no-split", action="store_true", help="no phase boundaries in the steps")
    p.add_argument(
        "--a2a-samples",
        type=int,
        default=10,
        help="timed all_to_all_single calls per size and row (0: no bandwidth figures)",
    )
    p.add_argument(
        "--tt-backend",
        default="spmd_types",
        choices=("spmd_types", "partial_dtensor"),
        help="torchtitan's SPMD backend (its default: spmd_types)",
    )
    p.add_argument("--no-torchtitan", action="store_true", help="leave torchtitan out")
    p.add_argument(
        "--timeout-s", type=float, default=120, help="process group timeout (a hung rank aborts)"
    )
    p.add_argument("--json", help="results, rewritten after every row (rank 0)")
    p.add_argument("--md", help="the table in markdown, rewritten after every row (rank 0)")
    p.add_argument("--from-json", help="render (and merge) result files; no GPU, no torchrun")
    args = p.parse_args(argv)
    if min(args.warmup + 1, args.rounds, args.calls, args.a2a_samples + 1) < 1:
        p.error("--rounds and --calls must be at least 1, --warmup and --a2a-samples at least 0")
    bad = [v for v in args.routing.split(",") if v not in ROUTINGS]
    bad += [v for v in args.impls.split(",") if v not in IMPLS]
    if bad:
        p.error(f"unknown {bad}")
    return args


def select_configs(arg: str) -> dict:
    table = {**CONFIGS, **TINY}
    out = {}
    for name in comma_list(arg):
        if name not in table:
            raise SystemExit(f"unknown config {name!r}; known: {', '.join(table)}")
        out[name] = table[name]
    return out


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, merge_docs, lambda doc: print(render_md(doc)), render_md)
        return 0

    dev = init_ranks(args.device, args.timeout_s)  # a plain `python3 bench_ep.py`: one rank
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
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # gloo's teardown after collectives sometimes aborts: end every rank together, then
    # leave without destroying the process group
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(args, argv, dev, rank: int, W: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    cuda = dev.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    T = args.tokens_per_gpu or (16384 if cuda else 64)
    configs = select_configs(args.configs)
    for name, (_d, _f, E, _k) in configs.items():
        if E % W:
            raise SystemExit(f"{name}: {E} experts do not divide over {W} ranks")
    mesh = init_device_mesh(dev.type, (W,), mesh_dim_names=("ep",))
    group = mesh.get_group()
    clock = Clock(cuda)
    split = Split(clock, enabled=not args.no_split)
    if not args.no_split:
        install_split(split)
    tt, tt_why = None, "--no-torchtitan"
    if not args.no_torchtitan and set(TT_IMPLS) & set(args.impls.split(",")):
        tt, tt_why = load_torchtitan(args.tt_backend, mesh, gloo=not cuda)
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
            "backend": args.tt_backend,
        },
        "timer": {
            "clock": "CUDA events" if cuda else "perf_counter",
            "warmup": args.warmup,
            "rounds": args.rounds,
            "calls": args.calls,
            "split": not args.no_split,
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
