#!/usr/bin/env python
"""Expert parallelism (``groupmm.parallel``) against one process, run with one process per
rank (tests/python/test_parallel.py launches it)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        tests/programs/ep_check.py --backend gloo --dtype float64
    NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/programs/ep_check.py --backend nccl --dtype bfloat16

Every rank builds the same whole layer (or the same expert weights) and every rank's
tokens from the same seeds, runs its share expert-parallel (its own tokens, its slice of
the experts) and computes the reference itself: the whole ``MoELayer`` (or
``groupmm.fused.expert_block``) in one process on all the ranks' tokens concatenated, in
float64 for float64 runs and in float32 (from the same rounded weights and tokens) for
bfloat16 runs. It compares its output rows, its tokens' gradient, its experts' weight
gradients, the router weights' gradient (functional form) and the router gate's gradient
summed over the ranks (what DDP does for a replicated parameter).

The routing is built so that no rounding can change it: gate row ``e`` reads input
column ``e`` (gain 4, tiny weights elsewhere) and each token's first ``E`` columns rank
the experts with logits one apart, so the bf16 layer and its float32 reference pick the
same experts. "random" ranks all experts at random per token; "skewed" ranks expert 0
and all experts of the last rank of the group last, so that they (a whole rank) get no
tokens.

Output (rank 0), one line per check, then the verdict::

    ROUTE world=4 case=<case> rows=[<rows the experts of each rank receive>]
    CHECK world=4 case=<case> what=<tensor> err=<max relative error over ranks> tol=<tol> ok|FAIL
    RAISED world=4 case=<case> rank=<rank> type=<exception type> msg=<message>
    RESULT world=4 checks=<n> failed=<m> PASS|FAIL

Exit status 0 when every check holds, 1 otherwise (every rank), 2 on a usage error. The
process ends with ``os._exit`` after a barrier (gloo's teardown in
``destroy_process_group`` sometimes aborts the process; nothing here needs it).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer
from groupmm.parallel import check_routing, expert_parallel_block

E = 8  # experts: divisible by 1, 2 and 4 ranks
GAIN = 4.0  # the gate's weight on each expert's own input column
F64 = torch.float64
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: bf16 bias gradients: the unfused layer sums them in bf16 (index_put), ~1.9e-2 measured
BIAS_TOL = {torch.bfloat16: 5e-2}


@dataclass
class Case:
    name: str
    tokens: List[int]  # per global rank (the first W used)
    top_k: int
    form: str = "layer"  # "layer" (MoELayer.sharded), "direct" (MoELayer(ep_group=)),
    # "block" (expert_parallel_block), "bad" (an id out of range on one rank)
    routing: str = "random"
    fused: Optional[bool] = None
    activation: str = "swiglu"
    bias: bool = False
    pad_to: Optional[int] = None
    weighted: bool = True  # block: router weights, or None (a plain sum)
    groups: bool = False  # EP over two groups of W / 2 ranks each, not the world
    # the sharded layer under torch.compile: "breaks" (graph breaks at the exchanges' host
    # sync only) or "fullgraph" (with capture_scalar_outputs, as torchtitan compiles)
    compiled: str = ""
    bad: Tuple[str, int] = ("last", E)  # bad: which rank ("first"/"last") and the bad id
    # fixed-size exchanges (the layer's ep_capacity, the block's capacity): "" exact sizes,
    # "max" the group's most tokens per rank, "more" that plus 3
    capacity: str = ""
    chunks: int = 1  # fixed sizes: the pipeline's slices (block form)


CASES = [
    Case("random-k2-fused", [24, 17, 31, 20], 2),
    Case("random-k1-fused-uneven", [7, 13, 0, 5], 1),
    Case("skewed-k2-fused", [9, 6, 11, 4], 2, routing="skewed"),
    Case("zero-rank-k3-fused", [0, 11, 6, 9], 3),
    Case("all-empty-k2-fused", [0, 0, 0, 0], 2),
    Case("random-k2-direct", [10, 3, 8, 0], 2, form="direct"),
    Case("compiled-k2-fused", [24, 17, 31, 20], 2, compiled="breaks"),
    Case("compiled-k1-unfused", [7, 13, 0, 5], 1, fused=False, compiled="breaks"),
    Case("fullgraph-k2-fused", [24, 17, 31, 20], 2, routing="skewed", compiled="fullgraph"),
    Case("fullgraph-k2-unfused", [7, 13, 0, 5], 2, fused=False, compiled="fullgraph"),
    Case("subgroups-k2-fused", [7, 13, 0, 5], 2, groups=True),
    Case("random-k2-unfused", [7, 13, 0, 5], 2, fused=False),
    Case("skewed-k1-unfused", [12, 5, 9, 3], 1, routing="skewed", fused=False),
    Case(
        "skewed-k2-unfused-gelu-bias-pad4",
        [9, 6, 11, 4],
        2,
        routing="skewed",
        fused=False,
        activation="gelu",
        bias=True,
        pad_to=4,
    ),
    Case("random-k3-unfused-relu-pad3", [7, 13, 0, 5], 3, fused=False, activation="relu", pad_to=3),
    Case("subgroups-k1-unfused-swiglu-pad8", [7, 13, 0, 5], 1, fused=False, pad_to=8, groups=True),
    Case("bad-id-high-last-rank", [5, 3, 4, 6], 2, form="bad", bad=("last", E)),
    Case("block-random-k2", [7, 13, 0, 5], 2, form="block"),
    Case("bad-id-negative-first-rank", [5, 3, 4, 6], 1, form="bad", bad=("first", -1)),
    Case("block-skewed-k1", [9, 6, 11, 4], 1, form="block", routing="skewed"),
    Case("block-random-k3-unweighted", [7, 13, 0, 5], 3, form="block", weighted=False),
    Case("block-zero-rank-k2", [0, 11, 6, 9], 2, form="block"),
    Case("fixed-random-k2-fused", [24, 17, 31, 20], 2, capacity="max"),
    Case("fixed-skewed-k2-fused", [9, 6, 11, 4], 2, routing="skewed", capacity="more"),
    Case("fixed-zero-rank-k3-fused", [0, 11, 6, 9], 3, capacity="max"),
    Case("fixed-all-empty-k2-fused", [0, 0, 0, 0], 2, capacity="more"),
    Case("fixed-random-k2-direct", [10, 3, 8, 0], 2, form="direct", capacity="max"),
    Case("fixed-subgroups-k2-fused", [7, 13, 0, 5], 2, groups=True, capacity="max"),
    Case(
        "fixed-fullgraph-k2-fused",
        [24, 17, 31, 20],
        2,
        routing="skewed",
        compiled="fixed",
        capacity="max",
    ),
    Case(
        "fixed-block-random-k3-unweighted",
        [7, 13, 0, 5],
        3,
        form="block",
        weighted=False,
        capacity="max",
    ),
    Case(
        "fixed-block-skewed-k1", [9, 6, 11, 4], 1, form="block", routing="skewed", capacity="more"
    ),
    Case("fixed-block-chunks3-k2", [24, 17, 31, 0], 2, form="block", capacity="max", chunks=3),
    Case(
        "fixed-block-chunks2-skewed-k3",
        [9, 6, 11, 4],
        3,
        form="block",
        routing="skewed",
        capacity="more",
        chunks=2,
    ),
    Case(
        "fixed-bad-id-high-last-rank", [5, 3, 4, 6], 2, form="bad", bad=("last", E), capacity="max"
    ),
    Case(
        "fixed-bad-id-negative-first-rank",
        [5, 3, 4, 6],
        1,
        form="bad",
        bad=("first", -1),
        capacity="more",
    ),
    # CUDA only (NCCL): a whole fixed-size forward + backward captured in a CUDA graph and
    # replayed with new routing; and the same step with torch's sync debug mode erroring
    Case("fixed-graph-k2-fused", [24, 17, 31, 20], 2, form="graph", capacity="max"),
    Case("fixed-no-sync-k2-fused", [24, 17, 31, 20], 2, form="nosync", capacity="max"),
]


def capacity_of(case: Case, ranks: List[int], scale: int) -> Optional[int]:
    """The case's fixed-size capacity for the group of global ``ranks`` (None: exact)."""
    if not case.capacity:
        return None
    most = max(case.tokens[r] * scale for r in ranks)
    return most if case.capacity == "max" else most + 3


# --------------------------------------------------------------------------- data


def seed_of(case: Case, *parts: int) -> int:
    """A seed for ``case`` and ``parts`` (the same on every rank and in every run)."""
    key = 0
    for c in case.name:
        key = (key * 131 + ord(c)) % (2**31)
    for p in parts:
        key = (key * 1_000_003 + p + 1) % (2**31)
    return key


def seeded(case: Case, *parts: int) -> torch.Generator:
    """A CPU generator seeded with :func:`seed_of`."""
    return torch.Generator().manual_seed(seed_of(case, *parts))


def starved(group_size: int) -> List[int]:
    """Skewed routing's experts with no tokens: expert 0 and all of the last rank's."""
    local = E // group_size
    return sorted({0, *range((group_size - 1) * local, E)})


def expert_ranks(case: Case, gen: torch.Generator, tokens: int, group_size: int) -> torch.Tensor:
    """float64 ``[tokens, E]``: logits ``E, E-1, ..., 1`` in each token's expert order (a
    random order; starved experts last for skewed routing)."""
    keys = torch.rand(tokens, E, generator=gen, dtype=F64)
    if case.routing == "skewed":
        keys[:, starved(group_size)] -= 2.0
    order = keys.argsort(dim=1, descending=True)
    levels = torch.arange(E, 0, -1, dtype=F64).expand(tokens, E)
    return torch.empty(tokens, E, dtype=F64).scatter_(1, order, levels)


def tokens_of(case: Case, rank: int, scale: int, d_model: int, group_size: int):
    """``(x, grad_out, expert_ids, router_weights)`` of global rank ``rank``, float64 CPU."""
    t = case.tokens[rank] * scale
    gen = seeded(case, 1, rank)
    levels = expert_ranks(case, gen, t, group_size)
    x = torch.randn(t, d_model, generator=gen, dtype=F64)
    x[:, :E] = levels / GAIN  # exact in bf16 (multiples of 1/4 up to 2)
    go = torch.randn(t, d_model, generator=gen, dtype=F64)
    ids = levels.topk(case.top_k, dim=1).indices
    weights = torch.rand(t, case.top_k, generator=gen, dtype=F64) + 0.1
    return x, go, ids, weights


def whole_layer(case: Case, d_model: int, d_ff: int) -> MoELayer:
    """The whole layer (float64 CPU), the same on every rank."""
    torch.manual_seed(seed_of(case, 2))
    layer = MoELayer(
        d_model,
        d_ff,
        E,
        case.top_k,
        activation=case.activation,
        bias=case.bias,
        aux_loss_coef=0.0,
        pad_to=case.pad_to,
        fused=case.fused,
        dtype=F64,
    )
    with torch.no_grad():
        gate = layer.router.gate.weight  # [E, D]
        gate.normal_(0.0, 0.005, generator=seeded(case, 3))
        gate[:, :E] = GAIN * torch.eye(E, dtype=F64)
    return layer


def rel_err(x: Optional[torch.Tensor], ref: torch.Tensor) -> float:
    """Relative Frobenius error (absolute where the reference is ~0); None is zeros."""
    ref = ref.detach().to(F64).cpu()
    x = torch.zeros_like(ref) if x is None else x.detach().to(F64).cpu()
    if x.shape != ref.shape:
        return float("inf")
    num = torch.linalg.vector_norm(x - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 1e-30 else num


# --------------------------------------------------------------------------- the cases


class Ctx:
    """This rank's side of a run."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args = args
        self.device = device
        self.dtype = getattr(torch, args.dtype)
        self.ref_dtype = torch.float32 if self.dtype == torch.bfloat16 else F64
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # two groups of W / 2 ranks (every rank creates every group, in the same order)
        half = max(self.world // 2, 1)
        self.halves = [list(range(s, s + half)) for s in range(0, self.world, half)]
        self.half_groups = [dist.new_group(r) for r in self.halves]

    def members(self, case: Case) -> Tuple[List[int], Any]:
        """The global ranks of this rank's EP group and the group (None: the world)."""
        if not case.groups:
            return list(range(self.world)), None
        for ranks, group in zip(self.halves, self.half_groups):
            if self.rank in ranks:
                return ranks, group
        raise AssertionError("rank in no group")

    def low(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype)

    def ref(self, t: torch.Tensor) -> torch.Tensor:
        """The reference's copy of a low-precision tensor: the same rounded values."""
        return t.detach().to(self.ref_dtype).clone()


Result = Tuple[str, float, float]  # (what, err, tol)


def run_layer(ctx: Ctx, case: Case) -> Tuple[List[Result], List[int]]:
    args = ctx.args
    ranks, group = ctx.members(case)
    size, me = len(ranks), ranks.index(ctx.rank)
    local = E // size
    data = [tokens_of(case, r, args.token_scale, args.d_model, size) for r in ranks]
    whole = whole_layer(case, args.d_model, args.d_ff).to(ctx.device, ctx.dtype)
    if case.form == "direct":  # the constructor with ep_group, the slice loaded by hand
        ep = MoELayer(
            args.d_model,
            args.d_ff,
            E,
            case.top_k,
            case.activation,
            case.bias,
            aux_loss_coef=0.0,
            pad_to=case.pad_to,
            fused=case.fused,
            device=ctx.device,
            dtype=ctx.dtype,
            ep_group=dist.group.WORLD if group is None else group,
            ep_capacity=capacity_of(case, ranks, args.token_scale),
        )
        ep.router.load_state_dict(whole.router.state_dict())
        lo = me * local
        ep.experts.load_state_dict(
            {k: v[lo : lo + local] for k, v in whole.experts.state_dict().items()}
        )
    else:
        ep = whole.sharded(group, capacity_of(case, ranks, args.token_scale))
    assert ep.experts.num_experts == local and ep.num_experts == E
    if args.fault:  # the next rank's experts: the checks must fail
        nxt = (me + 1) % size * local
        mine = {k: v[nxt : nxt + local] for k, v in whole.experts.state_dict().items()}
        ep.experts.load_state_dict(mine)

    x = ctx.low(data[me][0]).requires_grad_()
    go = ctx.low(data[me][1])
    out = compiled(ep, case.compiled)(x) if case.compiled else ep(x)
    (out * go).sum().backward()
    router_grad = ep.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad, group=group)

    ref_layer = copy.deepcopy(whole).to(ctx.ref_dtype)
    xs = ctx.ref(torch.cat([ctx.low(d[0]) for d in data])).requires_grad_()
    gos = ctx.ref(torch.cat([ctx.low(d[1]) for d in data]))
    ref_out = ref_layer(xs)
    (ref_out * gos).sum().backward()
    starts = [0]
    for d in data:
        starts.append(starts[-1] + d[0].shape[0])
    rows = slice(starts[me], starts[me + 1])
    experts = slice(me * local, (me + 1) * local)
    tol = TOL[ctx.dtype]
    results = [
        ("out", rel_err(out, ref_out[rows]), tol),
        ("grad_x", rel_err(x.grad, xs.grad[rows]), tol),
        ("grad_router_gate", rel_err(router_grad, ref_layer.router.gate.weight.grad), tol),
    ]
    for name, p in ep.experts.named_parameters():
        ref_p = getattr(ref_layer.experts, name)
        t = BIAS_TOL.get(ctx.dtype, tol) if name.startswith("b_") else tol
        results.append((f"grad_{name}", rel_err(p.grad, ref_p.grad[experts]), t))
    # rows each rank of the group receives (from the reference's routing)
    ids = ref_layer.router(xs.detach()).expert_ids
    got = torch.bincount(ids.reshape(-1) // local, minlength=size).tolist()
    return results, got


def compiled(module: Any, how: str) -> Any:
    """``module`` under ``torch.compile``: ``breaks``, every graph break checked to be
    the documented one (the exchanges' split sizes read on the host,
    ``groupmm._exchange``: the call's one host sync); ``fullgraph``, one graph with the
    split sizes traced as data-dependent sizes (``capture_scalar_outputs``, as torchtitan
    compiles its blocks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.capture_scalar_outputs = how == "fullgraph"
    # AOTAutograd's eager backend: the trace (dynamo, the ops' fakes with data-dependent
    # sizes, the backward) without Inductor's code generation, which benches/
    # bench_torchtitan.py --compile runs on the same layer; "fixed": fixed-size
    # exchanges, one graph with static sizes and no host sync to trace
    fn = torch.compile(module, backend="aot_eager", fullgraph=how in ("fullgraph", "fixed"))

    def run(x: torch.Tensor) -> torch.Tensor:
        out = fn(x)
        for reason in counters["graph_break"]:
            # the split sizes read on the host (.tolist(): the call's one host sync)
            if "aten._local_scalar_dense" not in reason:
                raise AssertionError(f"a graph break outside the exchanges' host sync: {reason}")
        torch._dynamo.config.capture_scalar_outputs = False
        return out

    return run


def run_block(ctx: Ctx, case: Case) -> Tuple[List[Result], List[int]]:
    args = ctx.args
    ranks, group = ctx.members(case)
    size, me = len(ranks), ranks.index(ctx.rank)
    local = E // size
    data = [tokens_of(case, r, args.token_scale, args.d_model, size) for r in ranks]
    gen = seeded(case, 4)
    w_in = ctx.low(torch.randn(E, args.d_model, 2 * args.d_ff, generator=gen, dtype=F64))
    w_out = ctx.low(torch.randn(E, args.d_ff, args.d_model, generator=gen, dtype=F64))
    w_in = (w_in / args.d_model**0.5).detach()
    w_out = (w_out / args.d_ff**0.5).detach()
    experts = slice(me * local, (me + 1) * local)
    nxt = (me + 1) % size * local
    taken = slice(nxt, nxt + local) if args.fault else experts  # fault: the next rank's
    my_in = w_in[taken].clone().requires_grad_()
    my_out = w_out[taken].clone().requires_grad_()
    x = ctx.low(data[me][0]).requires_grad_()
    go = ctx.low(data[me][1])
    ids = data[me][2].to(ctx.device)
    weights = ctx.low(data[me][3]).requires_grad_() if case.weighted else None
    cap = capacity_of(case, ranks, args.token_scale)
    kw = {"capacity": cap, "chunks": case.chunks}
    out = expert_parallel_block(x, ids, weights, my_in, my_out, group, **kw)
    (out * go).sum().backward()

    xs = ctx.ref(torch.cat([ctx.low(d[0]) for d in data])).requires_grad_()
    gos = ctx.ref(torch.cat([ctx.low(d[1]) for d in data]))
    all_ids = torch.cat([d[2] for d in data]).to(ctx.device)
    ws = ctx.ref(torch.cat([ctx.low(d[3]) for d in data])).requires_grad_()
    ref_in = ctx.ref(w_in).requires_grad_()
    ref_out_w = ctx.ref(w_out).requires_grad_()
    r = routes(all_ids, E)
    ref = expert_block(
        xs, ref_in, ref_out_w, r.offs, r.src, r.inverse, ws if case.weighted else None
    )
    (ref * gos).sum().backward()
    starts = [0]
    for d in data:
        starts.append(starts[-1] + d[0].shape[0])
    rows = slice(starts[me], starts[me + 1])
    tol = TOL[ctx.dtype]
    results = [
        ("out", rel_err(out, ref[rows]), tol),
        ("grad_x", rel_err(x.grad, xs.grad[rows]), tol),
        ("grad_w_in", rel_err(my_in.grad, ref_in.grad[experts]), tol),
        ("grad_w_out", rel_err(my_out.grad, ref_out_w.grad[experts]), tol),
    ]
    if weights is not None:
        assert ws.grad is not None
        results.append(("grad_weights", rel_err(weights.grad, ws.grad[rows]), tol))
    got = torch.bincount(all_ids.reshape(-1).cpu() // local, minlength=size).tolist()
    return results, got


def run_bad(ctx: Ctx, case: Case) -> Tuple[Optional[str], str]:
    """One rank passes an id out of range: ``(exception type or None, message)``."""
    args = ctx.args
    bad_rank = 0 if case.bad[0] == "first" else ctx.world - 1
    x, _, ids, weights = tokens_of(case, ctx.rank, args.token_scale, args.d_model, ctx.world)
    if ctx.rank == bad_rank:
        ids[-1, 0] = case.bad[1]
    local = E // ctx.world
    gen = seeded(case, 5, ctx.rank)
    w_in = ctx.low(torch.randn(local, args.d_model, 2 * args.d_ff, generator=gen, dtype=F64))
    w_out = ctx.low(torch.randn(local, args.d_ff, args.d_model, generator=gen, dtype=F64))
    cap = capacity_of(case, list(range(ctx.world)), args.token_scale)
    try:
        args_ = (ctx.low(x), ids.to(ctx.device), ctx.low(weights), w_in, w_out)
        expert_parallel_block(*args_, capacity=cap)
        if cap is not None:  # fixed sizes: the routing is read a few calls later
            check_routing()
    except Exception as e:  # every rank must raise the same ValueError
        return type(e).__name__, str(e)
    return None, ""


def fixed_inputs(ctx: Ctx, case: Case, draw: int) -> Tuple[torch.Tensor, ...]:
    """``(x, grad_out, expert_ids, router_weights)`` of this rank for graph and no-sync
    cases, routing drawn anew per ``draw`` (distinct experts per token)."""
    args = ctx.args
    tokens = case.tokens[ctx.rank] * args.token_scale
    gen = seeded(case, 7, ctx.rank, draw)
    x = torch.randn(tokens, args.d_model, generator=gen, dtype=F64)
    go = torch.randn(tokens, args.d_model, generator=gen, dtype=F64)
    ids = torch.rand(tokens, E, generator=gen).argsort(1)[:, : case.top_k]
    w = torch.randn(tokens, case.top_k, generator=gen, dtype=F64).softmax(1)
    return ctx.low(x), ctx.low(go), ids.to(ctx.device), ctx.low(w)


def fixed_experts(ctx: Ctx, case: Case) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(w_in, w_out)`` leaves for graph and no-sync cases."""
    args = ctx.args
    local = E // ctx.world
    gen = seeded(case, 8, ctx.rank)
    w_in = torch.randn(local, args.d_model, 2 * args.d_ff, generator=gen, dtype=F64)
    w_out = torch.randn(local, args.d_ff, args.d_model, generator=gen, dtype=F64)
    w_in = ctx.low(w_in / args.d_model**0.5).requires_grad_()
    w_out = ctx.low(w_out / args.d_ff**0.5).requires_grad_()
    return w_in, w_out


def fixed_step(ex, inputs, cap: Optional[int]) -> List[torch.Tensor]:
    """One forward + backward of :func:`expert_parallel_block` on fresh leaves of
    ``inputs``: ``[out, grad_x, grad_weights, grad_w_in, grad_w_out]``."""
    w_in, w_out = ex
    w_in.grad = w_out.grad = None
    x, go, ids, w = (t.detach().clone() for t in inputs)
    x.requires_grad_()
    w.requires_grad_()
    out = expert_parallel_block(x, ids, w, w_in, w_out, capacity=cap)
    (out * go).sum().backward()
    return [out.detach(), x.grad, w.grad, w_in.grad, w_out.grad]


GRADS = ("out", "grad_x", "grad_weights", "grad_w_in", "grad_w_out")


def run_graph(ctx: Ctx, case: Case) -> List[Result]:
    """CUDA: one fixed-size forward + backward captured in a CUDA graph (every rank
    captures its exchanges), replayed twice with routing, tokens and weights drawn anew
    (copied into the captured inputs): each replay's output and gradients against an
    eager exact-size step on the same inputs."""
    cap = capacity_of(case, list(range(ctx.world)), ctx.args.token_scale)
    ex = fixed_experts(ctx, case)
    static = [t.clone() for t in fixed_inputs(ctx, case, 0)]
    sx, sgo, sids, sw = static
    sx.requires_grad_()
    sw.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocations, NCCL)
        for _ in range(3):
            fixed_step(ex, static, cap)
    torch.cuda.current_stream().wait_stream(side)
    for t in (sx, sw, *ex):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = expert_parallel_block(sx, sids, sw, ex[0], ex[1], capacity=cap)
        (out * sgo).sum().backward()
    captured = [out, sx.grad, sw.grad, ex[0].grad, ex[1].grad]
    results: List[Result] = []
    tol = TOL[ctx.dtype]
    for draw in (1, 2):
        fresh = fixed_inputs(ctx, case, draw)
        with torch.no_grad():
            for dst, src in zip(static, fresh):
                dst.copy_(src)
        graph.replay()
        got = [t.clone() for t in captured]
        want = fixed_step(ex, fresh, None)
        for name, g, w in zip(GRADS, got, want):
            results.append((f"replay{draw}_{name}", rel_err(g, w), tol))
    del captured, out
    graph.reset()  # before the communicator it captured
    torch.cuda.synchronize()
    return results


def run_nosync(ctx: Ctx, case: Case) -> List[Result]:
    """CUDA: a fixed-size forward + backward under ``torch.cuda.set_sync_debug_mode``
    ("error": any host sync raises) passes, and the exact-size step (its one host sync)
    raises there (so the check can fail)."""
    cap = capacity_of(case, list(range(ctx.world)), ctx.args.token_scale)
    ex = fixed_experts(ctx, case)
    inputs = fixed_inputs(ctx, case, 0)
    for c in (cap, None):  # warm-up: first calls may sync (allocations, communicators)
        fixed_step(ex, inputs, c)
    torch.cuda.synchronize()
    raised = []
    for c in (cap, None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            fixed_step(ex, inputs, c)
            raised.append(False)
        except RuntimeError:
            raised.append(True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        dist.barrier()
    return [
        ("fixed_syncs", float(raised[0]), 0.0),
        ("exact_sync_seen", float(not raised[1]), 0.0),
    ]


# --------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default="float64")
    p.add_argument("--d-model", type=int, default=16)
    p.add_argument("--d-ff", type=int, default=8)
    p.add_argument("--token-scale", type=int, default=1, help="tokens per rank times this")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument(
        "--fault",
        action="store_true",
        help="give each rank the next rank's experts (a wrong expert slice): checks must fail",
    )
    args = p.parse_args(argv)
    if args.d_model < E:
        print(f"--d-model: expected at least {E} (the routing reads the first E columns)")
        return 2
    cases = CASES
    if args.cases:
        want = args.cases.split(",")
        cases = [c for c in CASES if c.name in want]
        if len(cases) != len(want):
            print(f"--cases: unknown case in {want}; known: {[c.name for c in CASES]}")
            return 2

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    ctx = Ctx(args, device)

    mine: List[Tuple[str, str, Any]] = []  # (case, kind, payload)
    try:
        for case in cases:
            if case.compiled == "fullgraph" and device.type == "cuda":
                # torch 2.11 with NCCL: the functional all_to_all's copy guards on the
                # data-dependent received rows in the exchange's backward (seen on H200s);
                # the gloo runs check this case
                continue
            if case.form == "bad":
                mine.append((case.name, "raised", run_bad(ctx, case)))
                continue
            if case.form in ("graph", "nosync"):
                if device.type != "cuda":  # CUDA graphs and host syncs: the GPU's
                    continue
                results = (run_graph if case.form == "graph" else run_nosync)(ctx, case)
                mine.extend((case.name, "check", r) for r in results)
                continue
            run = run_block if case.form == "block" else run_layer
            results, got = run(ctx, case)
            mine.append((case.name, "route", got))
            mine.extend((case.name, "check", r) for r in results)
    except Exception:  # a rank failing alone: say where, end this rank (torchrun ends the rest)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    checks = failed = 0
    lines = []
    for i, (name, kind, payload) in enumerate(everyone[0]):
        if kind == "route":
            groups = {tuple(everyone[r][i][2]) for r in range(world)}
            for got in sorted(groups):
                lines.append(f"ROUTE world={world} case={name} rows={list(got)}")
        elif kind == "check":
            what, _, tol = payload
            err = max(everyone[r][i][2][1] for r in range(world))
            ok = err <= tol  # NaN fails
            checks += 1
            failed += not ok
            verdict = "ok" if ok else "FAIL"
            lines.append(
                f"CHECK world={world} case={name} what={what} err={err:.3e} tol={tol:g} {verdict}"
            )
        else:
            case = next(c for c in cases if c.name == name)
            bad_rank = 0 if case.bad[0] == "first" else world - 1
            want = f"found ids out of range on rank(s) [{bad_rank}]"
            ok = True
            for r in range(world):
                kind_r, msg = everyone[r][i][2]
                msg1 = msg.replace("\n", " ")
                lines.append(f"RAISED world={world} case={name} rank={r} type={kind_r} msg={msg1}")
                ok = ok and kind_r == "ValueError" and msg.startswith("expert_ids:") and want in msg
            checks += 1
            failed += not ok
            verdict = "ok" if ok else "FAIL"
            lines.append(f"CHECK world={world} case={name} what=raised err=0 tol=0 {verdict}")
    verdict = "PASS" if failed == 0 else "FAIL"
    lines.append(f"RESULT world={world} checks={checks} failed={failed} {verdict}")
    if rank == 0:
        print("\n".join(lines))
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    # no destroy_process_group: gloo's teardown sometimes aborts the process ("terminate
    # called without an active exception"); every rank is past the barrier, nothing is
    # left in flight
    os._exit(0 if failed == 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
