"""Expert parallelism (EP) over W GPUs: groupmm's EP MoE layer against torchtitan's, forward
and backward at a fixed number of tokens per GPU, each step split into dispatch, experts
and combine.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W benches/bench_ep.py \\
        [--configs qwen3-30b-a3b,olmoe,mixtral] [--routing uniform,skewed] \\
        [--tokens-per-gpu 16384] [--check] [--json OUT.json] [--md OUT.md] \\
        [--device cuda|cpu] [--dtype bf16|fp32|fp64] \\
        [--impls fused,unfused,torchtitan,tt_groupmm,tt_seam,single]
    torchrun --standalone --nproc-per-node 2 benches/bench_ep.py --device cpu --configs tiny \\
        --check                                  # a smoke run on gloo (CPU)
    python3 benches/bench_ep.py --from-json w1.json,w2.json,w4.json [--md all.md]
                                                 # one table of several runs; no GPU

W = 1 runs the same code (an EP group of one rank: the exchanges move nothing off the GPU).
Rank r owns experts r*E/W ... (r+1)*E/W - 1 (E divisible by W); every rank has its own
tokens. One EP step on each rank: route locally, exchange the per-expert counts, one host
sync for the split sizes, all_to_all of the token copies, the local experts on the
received rows, the reverse all_to_all, the weighted combine; the backward runs the
exchanges in reverse.

Implementations (``--impls``), all on the same EP process group (a one-dimensional
``DeviceMesh`` named "ep" over the world):

- ``fused``: ``groupmm.moe.MoELayer(d, f, E, k, aux_loss_coef=0, ep_group=group)``, the
  default fused path (``groupmm.parallel.expert_parallel_block``: local experts as
  ``groupmm.fused``'s block on the received rows read through a routed index);
- ``unfused``: ``MoELayer(..., fused=False, ep_group=group)`` sharing the same expert
  weights (the old examples/expert_parallel.py design: permute the received rows,
  ``GroupedExperts``, back to received order);
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
- ``single``: the single-GPU reference for "EP expert time within 10 % of the single-GPU
  fused layer on the same local rows": ``routes`` + ``groupmm.fused.expert_block``
  forward and backward on this rank's received rows (their number and their local experts
  from the routing of every rank, k = 1), no exchange. Its whole step is its experts time.

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
ahead), and a ``torch.cuda.synchronize`` + barrier before each sample so all ranks start
it together. The step time of an implementation is the median over the rounds of the
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
path (``expert_parallel_block``) and the local-experts callable that
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
w_out layout) against a plain-torch reference (every expert gathered on every rank, a loop
over experts in float32, float64 for fp64; the expert gradients summed over ranks) and
against ``fused``, as relative Frobenius differences (largest over ranks). Tolerances:
1e-10 (fp64), 1e-4 (fp32), 3e-2 (bf16, and torchtitan always: it computes in bf16).
A failed check is reported (and the exit code is 1) but the timing goes on.

Outputs: a line per measurement on rank 0 as it goes, the markdown table at the end
(``--md`` too), and ``--json`` rewritten after every (config, routing): the device, GPU
count, torch/CUDA/torchtitan versions, groupmm's build_info, the command line, the date
and every raw number (per rank, per round).

Failures: an implementation that raises in its first or warm-up steps (on any rank) is
left out of the row on every rank and the row says why; a rank that fails inside a
collective later leaves the others waiting, and the process group's timeout
(``--timeout-s``, 120 s) ends the run (the JSON keeps the rows measured before).

Overlap (chunked dispatch) is not offered: overlapping one chunk's exchange with another's
experts needs asynchronous exchanges in both passes (its own autograd), i.e. a change in
the library, not in this bench.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import socket
import statistics
import sys
import time
from typing import Any

import groupmm
import groupmm.integrations.torchtitan as groupmm_torchtitan
import groupmm.moe as gmoe
import groupmm.parallel as gpar
import torch
import torch.distributed as dist
import torch.nn.functional as F
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer, RouterOutput
from moe_configs import CONFIGS, MODELS  # benches/moe_configs.py, same folder
from report import (  # benches/report.py, same folder
    line_buffered_stdout,
    load_docs,
    no_figure_lines,
    rel_diff,  # benches/report.py, same folder
    write_outputs,
)
from timing import (  # benches/timing.py, same folder
    paired,
    rr_orders,
)

#: the default configs (--configs), in the order they run (the heaviest last)
DEFAULT_CONFIGS = ("qwen3-30b-a3b", "olmoe", "mixtral")
TINY = {"tiny": (16, 32, 8, 2)}
ROUTINGS = ("uniform", "skewed")
#: Zipf exponent of the skewed routing's expert popularity (by global expert id)
ZIPF_S = 1.0
#: the implementations, in table order
IMPLS = ("fused", "unfused", "torchtitan", "tt_groupmm", "tt_seam", "single")
#: torchtitan's own classes: its experts on torch._grouped_mm, or switched to groupmm's
#: fused block by groupmm.integrations.torchtitan.enable
TT_IMPLS = ("torchtitan", "tt_groupmm", "tt_seam")
LABELS = {
    "fused": "groupmm fused",
    "unfused": "groupmm unfused",
    "torchtitan": "torchtitan",
    "tt_groupmm": "torchtitan + groupmm experts",
    "tt_seam": "torchtitan + groupmm products",
    "single": "single-GPU fused (ref)",
}
PHASES = ("dispatch", "experts", "combine")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
#: --check's tolerances on relative differences, by dtype (torchtitan: always bf16's)
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2}
TOL_BF16 = TOL["bfloat16"]
GRADS = ("out", "x", "weights", "w_in", "w_out")


# ----------------------------------------------------------------------------------------
# routing (pure)


def make_routing(T: int, E: int, k: int, kind: str, gen: torch.Generator) -> tuple:
    """``(ids [T, k] int64, weights [T, k] float64)``: each token's k experts distinct,
    ``uniform`` or ``skewed`` (Zipf popularity 1/(e+1)^ZIPF_S over the expert id e, drawn
    without replacement); weights the softmax of random logits."""
    if kind == "uniform":
        ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    elif kind == "skewed":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** ZIPF_S
        ids = torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
    else:
        raise ValueError(f"routing: expected one of {ROUTINGS}, found {kind!r}")
    weights = torch.randn(T, k, generator=gen, dtype=torch.float64).softmax(-1)
    return ids.long(), weights


# ----------------------------------------------------------------------------------------
# clock and split (the phase boundaries)


class Clock:
    """Timestamps on the GPU timeline (CUDA events) or the host's (``perf_counter``: CPU
    ops run on the calling thread)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def stamp(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _ready(t):
    """A functional collective's result waited on (its wait is enqueued before a stamp)."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


class _Mark(torch.autograd.Function):
    """Identity that stamps ``fwd`` when the forward passes it and ``bwd`` when the
    gradient does."""

    @staticmethod
    def forward(ctx: Any, t, split, fwd: str, bwd: str):
        ctx.split, ctx.bwd = split, bwd
        r = _ready(t)
        out = r.view(r.shape)
        split.stamp(fwd)
        return out

    @staticmethod
    def backward(ctx: Any, grad):
        grad = _ready(grad)
        ctx.split.stamp(ctx.bwd)
        return grad, None, None, None


class Split:
    """The stamps of the step being timed: ``t0`` (start), ``f1``/``b1`` (received rows,
    forward/backward), ``f2``/``b2`` (expert output), ``f3`` (end of the forward), ``t1``
    (end of the backward). Outside ``begin() ... end()`` marks are plain identities."""

    def __init__(self, clock: Clock, enabled: bool = True):
        self.clock, self.enabled, self.cur = clock, enabled, None

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
        return _Mark.apply(t, self, fwd, bwd)


def phases_of(ms, st: dict, ep: bool = True) -> dict:
    """One step's ``{"step", "dispatch", "experts", "combine"}`` ms from its stamps
    (``ms(a, b)``: ms between two stamps); an EP step missing a boundary has only
    ``step``; a non-EP step (``ep=False``) is all experts (no dispatch, no combine)."""
    out = {"step": ms(st["t0"], st["t1"])}
    if not ep:
        out["experts"] = out["step"]
        return out
    if not all(k in st for k in ("f1", "f2", "f3", "b2", "b1")):
        return out
    out["dispatch"] = ms(st["t0"], st["f1"]) + ms(st["b1"], st["t1"])
    out["experts"] = ms(st["f1"], st["f2"]) + ms(st["b2"], st["b1"])
    out["combine"] = ms(st["f2"], st["f3"]) + ms(st["f3"], st["b2"])
    return out


def install_split(split: Split) -> None:
    """Put the local experts of both groupmm EP paths between the two marks: the
    local-experts callable of ``groupmm.parallel.dispatch_combine`` (MoELayer's unfused EP
    path) and ``groupmm.parallel._block`` (the fused one, ``expert_parallel_block``)."""
    real = gpar.dispatch_combine

    def dispatch_combine(x, expert_ids, weights, num_local, experts, group=None):
        def local(received, p):
            y = experts(split.mark(received, "f1", "b1"), p)
            return split.mark(y, "f2", "b2")

        return real(x, expert_ids, weights, num_local, local, group)

    gmoe.dispatch_combine = dispatch_combine  # MoELayer's unfused EP path, imported name

    # the fused path (expert_parallel_block: one row per token and rank) runs its local
    # experts as parallel._block, between its exchanges
    real_block = gpar._block

    def block(x, w_in, w_out, offs, src, inverse, weights):
        y = real_block(split.mark(x, "f1", "b1"), w_in, w_out, offs, src, inverse, weights)
        return split.mark(y, "f2", "b2")

    gpar._block = block  # expert_parallel_block looks it up here


# ----------------------------------------------------------------------------------------
# torchtitan


class _GlooDist:
    """``torch.distributed`` for spmd_types on gloo: gloo's list-form ``all_to_all`` takes
    equal sizes only, so the uneven one of torchtitan's token exchange goes through
    ``all_to_all_single`` (the same data movement); everything else is torch's."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
        send = torch.cat([t.reshape(-1) for t in input_tensor_list])
        sizes_out = [t.numel() for t in output_tensor_list]
        recv = send.new_empty(sum(sizes_out))
        sizes_in = [t.numel() for t in input_tensor_list]
        dist.all_to_all_single(recv, send, sizes_out, sizes_in, group=group)
        for t, piece in zip(output_tensor_list, recv.split(sizes_out)):
            t.copy_(piece.view_as(t))
        return None


def load_torchtitan(backend: str, mesh, gloo: bool):
    """``(module namespace, None)`` or ``(None, why)``; sets torchtitan's SPMD backend and
    registers ``mesh`` as its sparse (EP) mesh as its trainer does."""
    try:
        from torchtitan.distributed import utils as tt_utils
        from torchtitan.distributed.spmd_types import set_spmd_meshes
        from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        lines = str(e).strip().splitlines() or [""]
        return None, f"import torchtitan failed: {type(e).__name__}: {lines[0][:160]}"
    tt_utils.set_spmd_backend(backend)
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        # torchtitan 0.3.0's dispatcher asks this of torch releases after 2.11; in an eager
        # run nothing traces, which is this answer
        torch.compiler._is_non_strict_tracing = lambda: False  # type: ignore[attr-defined]
    if backend == "spmd_types":
        set_spmd_meshes(dense_mesh=mesh, sparse_mesh=mesh)
        if gloo:
            import spmd_types._dist as spmd_dist

            spmd_dist.set_dist(_GlooDist())
    ns = argparse.Namespace(
        GroupedExperts=GroupedExperts,
        RoutedExperts=RoutedExperts,
        AllToAllTokenDispatcher=AllToAllTokenDispatcher,
    )
    return ns, None


def torchtitan_version():
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:  # noqa: BLE001 - a source copy on PYTHONPATH has no metadata
        try:
            import torchtitan

            return getattr(torchtitan, "__version__", "unknown")
        except Exception:  # noqa: BLE001
            return None


def build_torchtitan(TT, mesh, split: Split, experts, E: int, k: int, dev, dtype):
    """torchtitan's ``RoutedExperts`` (dispatcher + grouped experts) with copies of
    groupmm's local experts (w1 = gate^T, w3 = up^T, w2 = w_out^T), the EP mesh wired."""
    e, d, f2 = experts.w_in.shape
    f = f2 // 2
    cfg = TT.RoutedExperts.Config(
        inner_experts=TT.GroupedExperts.Config(dim=d, hidden_dim=f, num_experts=e),
        token_dispatcher=TT.AllToAllTokenDispatcher.Config(num_experts=E, top_k=k),
    )
    with torch.device(dev):
        routed = cfg.build()
    routed = routed.to(dtype=dtype)
    with torch.no_grad():
        w_in, w_out = experts.w_in.detach(), experts.w_out.detach()
        routed.inner_experts.w1_EFD.copy_(w_in[:, :, :f].transpose(1, 2))
        routed.inner_experts.w3_EFD.copy_(w_in[:, :, f:].transpose(1, 2))
        routed.inner_experts.w2_EDF.copy_(w_out.transpose(1, 2))
    routed.token_dispatcher.wire_meshes(ep_mesh=mesh)
    inner = routed.inner_experts
    inner.register_forward_pre_hook(lambda m, a: (split.mark(a[0], "f1", "b1"), *a[1:]))
    inner.register_forward_hook(lambda m, a, out: split.mark(out, "f2", "b2"))
    return routed


def torchtitan_grads(routed) -> tuple:
    """torchtitan's expert gradients in groupmm's layout: ``(w_in [e, d, 2F], w_out)``."""
    ex = routed.inner_experts
    g1, g3, g2 = ex.w1_EFD.grad, ex.w3_EFD.grad, ex.w2_EDF.grad
    if g1 is None or g2 is None or g3 is None:
        return None, None
    return torch.cat([g1.transpose(1, 2), g3.transpose(1, 2)], dim=2), g2.transpose(1, 2)


# ----------------------------------------------------------------------------------------
# groupmm


class FixedRouter(torch.nn.Module):
    """A router stub: the same expert ids and weights (cast to ``dtype``, as TopKRouter
    returns them) whatever the input."""

    def __init__(self, ids, weights, dtype, num_experts: int):
        super().__init__()
        self.ids, self.weights, self.dtype = ids, weights, dtype
        self.num_experts, self.top_k = num_experts, ids.shape[1]
        self.aux = weights.new_zeros(())

    def forward(self, x):
        w = self.weights.to(self.dtype)
        return RouterOutput(w, self.ids, w, self.aux)


def dense_reference(x, ids, weights, w_in_all, w_out_all, gy, ct):
    """The whole layer in plain torch (a loop over every expert) in ``ct``: ``(out, dx,
    dweights, dw_in_all, dw_out_all)`` (the expert gradients of this rank's tokens)."""
    xr = x.detach().to(ct).requires_grad_()
    wr = weights.detach().to(ct).requires_grad_()
    wi = w_in_all.detach().to(ct).requires_grad_()
    wo = w_out_all.detach().to(ct).requires_grad_()
    f = wi.shape[2] // 2
    out = xr.new_zeros(xr.shape)
    for e in range(wi.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xr[tok] @ wi[e]
        y = (F.silu(h[:, :f]) * h[:, f:]) @ wo[e]
        out = out.index_add(0, tok, y * wr[tok, slot].unsqueeze(1))
    out.backward(gy.to(ct))
    return out.detach(), xr.grad, wr.grad, wi.grad, wo.grad


# ----------------------------------------------------------------------------------------
# collectives helpers


def agree(ok: bool, dev) -> bool:
    """True on every rank when ``ok`` holds on every rank."""
    t = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _err(e: BaseException) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: {lines[0][:160]}"


# ----------------------------------------------------------------------------------------
# one row: a config and a routing


def run_row(spec: dict, args, ctx: dict) -> dict:
    """Measure every implementation on one (config, routing); returns the row (on every
    rank: the per-rank numbers are gathered)."""
    dev, dtype, group, mesh = ctx["dev"], ctx["dtype"], ctx["group"], ctx["mesh"]
    rank, W, clock, split = ctx["rank"], ctx["W"], ctx["clock"], ctx["split"]
    d, f, E, k, T = spec["d_model"], spec["d_ff"], spec["experts"], spec["top_k"], spec["T"]
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    # inputs of this rank, the same for every implementation and step
    seed = 1_000_003 * (1 + ROUTINGS.index(spec["routing"])) + 7919 * E + d
    gen = torch.Generator().manual_seed(seed + 1009 * rank)
    ids_cpu, w64 = make_routing(T, E, k, spec["routing"], gen)
    ids = ids_cpu.to(dev)
    weights = w64.to(device=dev, dtype=wdtype).requires_grad_()
    x = torch.randn(T, d, generator=gen, dtype=torch.float32).to(dev, dtype).requires_grad_()
    gy = torch.randn(T, d, generator=gen, dtype=torch.float32).to(dev, dtype)

    torch.manual_seed(seed + 31 * rank)  # each rank's experts its own
    fused = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype, ep_group=group)
    fused.router = FixedRouter(ids, weights, dtype, E)
    ex = fused.experts
    unfused = MoELayer(
        d, f, E, k, aux_loss_coef=0.0, fused=False, device="meta", dtype=dtype, ep_group=group
    )
    unfused.experts = ex  # the same weights
    unfused.router = FixedRouter(ids, weights, dtype, E)
    # the rows this rank receives (one plan: the counts exchange and its host sync)
    plan = gpar.plan(ids, ex.num_experts, group)
    local_ids = plan.local_ids
    R = int(sum(plan.out_splits))
    del plan
    recv = gather(R)
    lead = rank == 0

    fwd, leaves, errors = {}, {}, {}
    want = set(args.impls.split(","))
    if "fused" in want:
        fwd["fused"] = lambda: fused(x)
        leaves["fused"] = [x, weights, ex.w_in, ex.w_out]
    if "unfused" in want:
        fwd["unfused"] = lambda: unfused(x)
        leaves["unfused"] = [x, weights, ex.w_in, ex.w_out]
    routed: dict = {}
    for name in TT_IMPLS:
        if name not in want:
            continue
        TT = ctx["tt"]
        if TT is None:
            errors[name] = ctx["tt_why"]
            continue
        why = None
        try:
            module = build_torchtitan(TT, mesh, split, ex, E, k, dev, dtype)
            if name == "tt_groupmm":
                groupmm_torchtitan.enable(module, fused=True)  # the fused block
            elif name == "tt_seam":
                groupmm_torchtitan.enable(module, fused=False)  # _grouped_mm only
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            why = _err(e)
        if agree(why is None, dev):

            def tt_forward(module=module):
                x3, ids3, s3 = x.view(1, T, d), ids.view(1, T, k), weights.view(1, T, k)
                # MoE.forward's tokens per expert: the one-hot routing map, summed
                rmap = torch.zeros(1, T, E, dtype=torch.bool, device=x.device)
                counts = rmap.scatter_(-1, ids3, True).sum(dim=(0, 1))
                return module(x3, s3, ids3, counts).view(T, d)

            fwd[name] = tt_forward
            leaves[name] = [x, weights, *module.parameters()]
            routed[name] = module
        else:
            errors[name] = why or "failed to build on another rank"
    rows = grows = None
    if "single" in want:
        g2 = torch.Generator().manual_seed(seed + 17 + rank)
        rows = torch.randn(R, d, generator=g2).to(dev, dtype).requires_grad_()
        grows = torch.randn(R, d, generator=g2).to(dev, dtype)

        def single():
            r = routes(local_ids, ex.num_experts)
            return expert_block(rows, ex.w_in, ex.w_out, r.offs, r.src, r.inverse, None)

        fwd["single"] = single
        leaves["single"] = [rows, ex.w_in, ex.w_out]

    def make_step(name):
        fn, ls = fwd[name], leaves[name]
        g = grows if name == "single" else gy

        def step():
            for t in ls:
                t.grad = None
            out = fn()
            split.stamp("f3")
            out.backward(g)

        return step

    steps = {name: make_step(name) for name in fwd}

    # first step of each (its first failure agreed over ranks) and, with --check, the
    # comparison of its output and gradients
    check = None
    got = {}
    if lead:
        imb = max(recv) * W / max(sum(recv), 1)
        print(f"   received rows per rank {recv} (max/mean {imb:.2f})")
    for name in list(steps):
        why = None
        try:
            for t in leaves[name]:
                t.grad = None
            out = fwd[name]()
            out.backward(grows if name == "single" else gy)
            clock.sync()
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            why = _err(e)
            out = None
        if not agree(why is None, dev):
            errors[name] = why or "failed on another rank"
            del steps[name]
            continue
        if args.check and name != "single":
            if name in TT_IMPLS:
                gw_in, gw_out = torchtitan_grads(routed[name])
            else:
                gw_in, gw_out = ex.w_in.grad, ex.w_out.grad
            got[name] = {
                "out": out.detach(),
                "x": x.grad.detach().clone(),
                "weights": weights.grad.detach().clone(),
                "w_in": None if gw_in is None else gw_in.detach().clone(),
                "w_out": None if gw_out is None else gw_out.detach().clone(),
            }
        del out
        for t in leaves[name]:
            t.grad = None
    if args.check:
        check = run_check(got, x, ids, weights, ex, gy, ctx)
        got.clear()
        if lead:
            for ln in check_lines([dict(spec, world=W, check=check)]):
                print("   " + ln)

    # warm-up, then the rounds
    for name in list(steps):
        why = None
        try:
            for _ in range(args.warmup):
                steps[name]()
            clock.sync()
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            why = _err(e)
        if not agree(why is None, dev):
            errors[name] = why or "failed on another rank"
            del steps[name]
    names = list(steps)
    samples = {n: [None] * args.rounds for n in names}
    stamps: dict = {n: [] for n in names}
    if lead:
        print(f"   timing {', '.join(names)}: {args.rounds} rounds x {args.calls} steps ...")
    for r, order in enumerate(rr_orders(len(names), args.rounds)):
        pending = []
        for i in order:
            n = names[i]
            clock.sync()
            dist.barrier(group)
            s = clock.stamp()
            recs = []
            for _ in range(args.calls):
                split.begin()
                steps[n]()
                recs.append(split.end())
            e = clock.stamp()
            pending.append((n, s, e, recs))
        clock.sync()
        for n, s, e, recs in pending:
            samples[n][r] = clock.ms(s, e) / args.calls
            stamps[n] += [phases_of(clock.ms, st, ep=n != "single") for st in recs]
    mine = {
        "rank": rank,
        "recv_rows": R,
        "samples": samples,
        "phases": {
            n: {
                p: statistics.median(v[p] for v in stamps[n])
                for p in ("step", *PHASES)
                if stamps[n] and all(p in v for v in stamps[n])
            }
            for n in names
        },
    }
    everyone = gather(mine)
    row = make_row(spec, W, everyone, names, errors, check, str(dtype).replace("torch.", ""))
    return row


def run_check(got: dict, x, ids, weights, ex, gy, ctx) -> dict:
    """Relative differences of every implementation's first step to the plain-torch
    reference and to fused's, the largest over ranks."""
    group, W, rank = ctx["group"], ctx["W"], ctx["rank"]
    dtype = ctx["dtype"]
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    parts_in = [torch.empty_like(ex.w_in) for _ in range(W)]
    parts_out = [torch.empty_like(ex.w_out) for _ in range(W)]
    dist.all_gather(parts_in, ex.w_in.detach().contiguous(), group=group)
    dist.all_gather(parts_out, ex.w_out.detach().contiguous(), group=group)
    w_in_all, w_out_all = torch.cat(parts_in), torch.cat(parts_out)
    del parts_in, parts_out
    ref = dense_reference(x, ids, weights, w_in_all, w_out_all, gy, ct)
    del w_in_all, w_out_all
    out, dx, dw, dwi, dwo = ref
    dist.all_reduce(dwi, group=group)
    dist.all_reduce(dwo, group=group)
    e = ex.num_experts
    ref_d = {
        "out": out,
        "x": dx,
        "weights": dw,
        "w_in": dwi[rank * e : (rank + 1) * e],
        "w_out": dwo[rank * e : (rank + 1) * e],
    }
    local: dict = {"vs_reference": {}, "vs_fused": {}}
    for name, g in got.items():
        local["vs_reference"][name] = {q: rel_diff(g[q], ref_d[q]) for q in GRADS}
        if name != "fused" and "fused" in got:
            local["vs_fused"][name] = {q: rel_diff(g[q], got["fused"][q]) for q in GRADS}
    del ref, ref_d
    everyone = gather(local)
    dname = str(dtype).replace("torch.", "")
    res: dict = {"tolerance": {}, "vs_reference": {}, "vs_fused": {}, "failed": []}
    for name in got:
        tol = TOL_BF16 if name in TT_IMPLS else TOL[dname]
        res["tolerance"][name] = tol
        for key in ("vs_reference", "vs_fused"):
            per = [o[key].get(name) for o in everyone if o[key].get(name)]
            if not per:
                continue
            worst = {q: max(math.inf if p[q] is None else p[q] for p in per) for q in GRADS}
            res[key][name] = worst
            bad = [q for q, v in worst.items() if not (v <= tol)]  # NaN fails too
            if bad:
                res["failed"].append(f"{name} {key}: {', '.join(bad)}")
    res["ok"] = not res["failed"]
    return res


def make_row(spec: dict, W: int, everyone: list, names: list, errors, check, dtype) -> dict:
    """The row from every rank's numbers: per implementation the step time (median over
    the rounds of the slowest rank's sample), tokens/s per GPU, the phase medians (largest
    over ranks), the speed against torchtitan and the experts time against single's."""
    recv = [o["recv_rows"] for o in everyone]
    mean = sum(recv) / len(recv)
    row = dict(spec, world=W, dtype=dtype, recv_rows=recv)
    row["recv_imbalance"] = max(recv) / mean if mean else None
    impls = {}
    for n in names:
        per_round = []
        for r in range(len(everyone[0]["samples"][n])):
            vals = [o["samples"][n][r] for o in everyone]
            per_round.append(max(vals) if all(v is not None for v in vals) else None)
        got = [v for v in per_round if v is not None]
        step = statistics.median(got) if got else None
        per_rank_ph = [o["phases"].get(n, {}) for o in everyone]
        ph = {
            p: max(q[p] for q in per_rank_ph) if all(p in q for q in per_rank_ph) else None
            for p in PHASES
        }
        impls[n] = {
            "step_ms": step,
            "samples_ms": per_round,
            "spread_ms": {"min": min(got), "max": max(got)} if got else None,
            "tokens_per_s_per_gpu": spec["T"] / (step / 1e3) if step else None,
            "phases_ms": ph,
            "per_rank": [
                {"samples_ms": o["samples"][n], "phases_ms": o["phases"].get(n, {})}
                for o in everyone
            ],
        }
    tt = impls.get("torchtitan")
    for n, v in impls.items():
        ep = n != "single"  # the single-GPU reference is no EP step: no speed against it
        v["vs_torchtitan"] = (
            tt["step_ms"] / v["step_ms"] if ep and tt and tt["step_ms"] and v["step_ms"] else None
        )
        v["vs_torchtitan_rounds"] = (
            paired(v["samples_ms"], tt["samples_ms"]) if ep and tt and n != "torchtitan" else None
        )
        ratios = []
        for o in everyone:
            mine, ref = o["phases"].get(n, {}), o["phases"].get("single", {})
            if mine.get("experts") and ref.get("experts"):
                ratios.append(mine["experts"] / ref["experts"])
        v["experts_vs_single_per_rank"] = ratios if len(ratios) == len(everyone) else None
        v["experts_vs_single"] = max(ratios) if len(ratios) == len(everyone) else None
    row["impls"] = impls
    row["errors"] = errors
    row["check"] = check
    return row


# ----------------------------------------------------------------------------------------
# rendering (pure)


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def fmt_rate(v):
    if v is None:
        return "-"
    return f"{v / 1e6:.2f}M" if v >= 1e6 else f"{v / 1e3:.1f}k"


def label(row: dict) -> str:
    return f"{row['config']} {row['routing']} W={row['world']}"


def format_line(row: dict, name: str) -> str:
    """One progress line: an implementation's numbers on a row."""
    v = row["impls"][name]
    ph = v["phases_ms"]
    return (
        f"{label(row):28} {name:10} step {fmt(v['step_ms'], '8.3f')} ms  "
        f"{fmt_rate(v['tokens_per_s_per_gpu']):>7} tok/s/GPU  "
        + " ".join(f"{p} {fmt(ph.get(p), '.3f')}" for p in PHASES)
        + f"  vs torchtitan {fmt(v['vs_torchtitan'])}x  experts/single "
        f"{fmt(v['experts_vs_single'])}"
    )


def describe(doc: dict) -> list:
    tt = doc.get("torchtitan") or {}
    tt_s = (
        f"torchtitan {tt.get('version')} ({tt.get('backend')} backend)"
        if tt.get("used")
        else f"torchtitan not measured: {tt.get('why') or 'not in this run'}"
    )
    t = doc.get("timer") or {}
    return [
        f"device {doc.get('device')} x {doc.get('world')} ({doc.get('backend')}); torch "
        f"{doc.get('torch')}, CUDA {doc.get('cuda') or '-'}; {doc.get('dtype')}; "
        f"{doc.get('tokens_per_gpu')} tokens per GPU",
        tt_s,
        f"timer: {t.get('clock')}; {t.get('warmup')} warm-up steps, {t.get('rounds')} "
        f"round-robin rounds of {t.get('calls')} steps per implementation; step = median over "
        "rounds of the slowest rank's sample; split: "
        + ("per step, at the phase boundaries, in the timed steps" if t.get("split") else "off"),
    ]


def commands(doc: dict) -> list:
    runs = doc.get("runs") or ([doc["argv"]] if doc.get("argv") is not None else [])
    return [" ".join(a) for a in runs]


def render_md(doc: dict) -> str:
    """The result document as markdown: environment, commands, the table, errors, check."""
    env = describe(doc)
    out = ["**" + env[0] + "**", ""] + [ln + "  " for ln in env[1:]]
    if commands(doc):
        out += ["", "```bash", *commands(doc), "```"]
    if not doc.get("complete", True):
        out += ["", "*(incomplete run: the rows measured so far)*"]
    out += [
        "",
        "| config (d, d_ff, E, k) | routing | W | impl | step ms (max over ranks) "
        "| tokens/s/GPU | dispatch ms | experts ms | combine ms | speed vs torchtitan "
        "| experts / single-GPU | recv rows max/mean |",
        "| --- | --- | ---: | --- |" + " ---: |" * 8,
    ]
    for r in doc.get("rows", []):
        cfg = f"{r['config']} ({r['d_model']}, {r['d_ff']}, {r['experts']}, {r['top_k']})"
        for n in IMPLS:
            v = r["impls"].get(n)
            if v is None:
                continue
            ph = v["phases_ms"]
            p = v.get("vs_torchtitan_rounds")
            vs = fmt(v["vs_torchtitan"])
            if p:
                vs += f" ({p['min']:.2f}–{p['max']:.2f})"
            cells = [
                cfg,
                r["routing"],
                str(r["world"]),
                LABELS[n],
                fmt(v["step_ms"]),
                fmt_rate(v["tokens_per_s_per_gpu"]),
                *(fmt(ph.get(q)) for q in PHASES),
                vs,
                fmt(v["experts_vs_single"]),
                fmt(r.get("recv_imbalance")),
            ]
            out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "step ms: median over the rounds of the slowest rank's time per step (forward + "
        "backward); tokens/s/GPU: tokens per GPU / step; dispatch / experts / combine: "
        "medians per rank, the largest over ranks (a rank waiting for a slower one waits in "
        "its exchanges); speed vs torchtitan: torchtitan's step / this one's (min–max of the "
        "round-by-round ratios); experts / single-GPU: the experts time over the single-GPU "
        "fused block's on the same rank's received rows, the largest over ranks.",
    ]
    out += no_figure_lines(doc.get("rows", []), label, lambda n: LABELS.get(n, n))
    checks = check_lines(doc.get("rows", []))
    if checks:
        out += [""] + [ln + "  " for ln in checks]
    return "\n".join(out) + "\n"


def check_lines(rows) -> list:
    """Per implementation, the largest relative difference to the reference over the
    checked rows, and the failures."""
    worst: dict = {}
    fails = []
    for r in rows:
        c = r.get("check")
        if not c:
            continue
        for n, qs in c["vs_reference"].items():
            for q, v in qs.items():
                if v is not None and (n not in worst or v > worst[n][0]):
                    worst[n] = (v, f"{label(r)}, {q}")
        fails += [f"{label(r)}: {f}" for f in c.get("failed", [])]
    lines = [
        f"check {LABELS.get(n, n)} vs plain-torch reference: at most {v:.1e} ({where})"
        for n, (v, where) in worst.items()
    ]
    if fails:
        lines.append("CHECK FAILED: " + "; ".join(fails))
    elif worst:
        lines.append("check: every implementation within tolerance")
    return lines


def merge_docs(docs: list) -> dict:
    """Several result documents (e.g. W = 1, 2, 4) as one: rows in order, every command."""
    if len(docs) == 1:
        return docs[0]
    out = dict(docs[0])
    out["runs"] = [argv for d in docs for argv in (d.get("runs") or [d.get("argv") or []])]
    out.pop("argv", None)
    out["rows"] = [r for d in docs for r in d.get("rows", [])]
    out["complete"] = all(d.get("complete", True) for d in docs)
    out["world"] = ",".join(str(d.get("world")) for d in docs)
    return out


# ----------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of configs")
    p.add_argument("--routing", default="uniform,skewed", help="uniform, skewed (comma list)")
    p.add_argument(
        "--tokens-per-gpu", type=int, help="tokens per rank (default 16384 on cuda, 64 on cpu)"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of " + ", ".join(IMPLS))
    p.add_argument("--warmup", type=int, default=3, help="steps per implementation first")
    p.add_argument("--rounds", type=int, default=8, help="round-robin rounds")
    p.add_argument("--calls", type=int, default=2, help="back-to-back steps per sample")
    p.add_argument("--check", action="store_true", help="compare outputs and gradients first")
    p.add_argument("--no-split", action="store_true", help="no phase boundaries in the steps")
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
    if min(args.warmup + 1, args.rounds, args.calls) < 1:
        p.error("--rounds and --calls must be at least 1, --warmup at least 0")
    bad = [v for v in args.routing.split(",") if v not in ROUTINGS]
    bad += [v for v in args.impls.split(",") if v not in IMPLS]
    if bad:
        p.error(f"unknown {bad}")
    return args


def select_configs(arg: str) -> dict:
    table = {**CONFIGS, **TINY}
    out = {}
    for name in (t.strip() for t in arg.split(",")):
        if not name:
            continue
        if name not in table:
            raise SystemExit(f"unknown config {name!r}; known: {', '.join(table)}")
        out[name] = table[name]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        doc = merge_docs(load_docs(args.from_json))
        text = render_md(doc)
        print(text)
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(text)
        if args.json and "," in args.from_json:
            write_outputs(doc, args.json, None, render_md)
        return 0

    if "RANK" not in os.environ:  # a plain `python3 bench_ep.py`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    rank, W = dist.get_rank(), dist.get_world_size()
    code = 1
    try:
        code = run(args, argv, dev, rank, W)
    except SystemExit as e:  # a bad argument found after the start: every rank says so
        print(f"[rank {rank}] {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
    except Exception as e:  # noqa: BLE001 - print on every rank, then leave
        print(f"[rank {rank}] {_err(e)}", file=sys.stderr)
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
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
