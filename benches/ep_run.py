"""One row of bench_ep.py on every rank: the inputs (one routing for every implementation),
each implementation built on them, the first step (and --check), the warm-up, the rounds
with the split, the all-to-all bandwidth; the per-rank numbers gathered into the row."""

from __future__ import annotations

import math
import statistics

import groupmm
import groupmm.parallel as gpar
import torch
import torch.distributed as dist
import torch.nn.functional as F
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer, RouterOutput
from harness.configs import EP_ROUTINGS as ROUTINGS
from harness.configs import make_routing
from harness.report import error_text, rel_diff
from harness.report.ep import LOCAL, PHASES, check_lines, make_row, phases_of
from harness.timing import rr_orders
from peers.torchtitan import build_torchtitan, torchtitan_grads

#: --check's tolerances on relative differences, by dtype (torchtitan: always bf16's)
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2}
TOL_BF16 = TOL["bfloat16"]
GRADS = ("out", "x", "weights", "w_in", "w_out")


class FixedRouter(torch.nn.Module):
    """A router stub: the same expert ids and weights (in ``dtype``) whatever the input."""

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


def agree(ok: bool, dev) -> bool:
    """True on every rank when ``ok`` holds on every rank."""
    t = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def gather_experts(ex, group, W: int) -> tuple:
    """``(w_in, w_out)`` of all E experts (every rank's shard, in rank order), detached."""
    parts_in = [torch.empty_like(ex.w_in) for _ in range(W)]
    parts_out = [torch.empty_like(ex.w_out) for _ in range(W)]
    dist.all_gather(parts_in, ex.w_in.detach().contiguous(), group=group)
    dist.all_gather(parts_out, ex.w_out.detach().contiguous(), group=group)
    return torch.cat(parts_in), torch.cat(parts_out)


def time_alltoall(rows: int, d: int, ctx: dict, samples: int, warmup: int = 3) -> list:
    """This rank's ms of ``samples`` equal-split ``all_to_all_single`` calls of ``rows``
    rows of ``d``, a synchronize and a barrier before each."""
    dev, dtype, group, clock = ctx["dev"], ctx["dtype"], ctx["group"], ctx["clock"]
    send = torch.ones(rows, d, device=dev, dtype=dtype)
    recv = torch.empty_like(send)
    out = []
    for i in range(warmup + samples):
        clock.sync()
        dist.barrier(group)
        s = clock.stamp()
        dist.all_to_all_single(recv, send, group=group)
        e = clock.stamp()
        clock.sync()
        if i >= warmup:
            out.append(clock.ms(s, e))
    return out


def run_row(spec: dict, args, ctx: dict) -> dict:
    """Every implementation on one (config, routing); the row, on every rank."""
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

    def sharing(**kw):  # the same expert weights and routing, another path
        m = MoELayer(
            d, f, E, k, aux_loss_coef=0.0, device="meta", dtype=dtype, ep_group=group, **kw
        )
        m.experts, m.router = ex, FixedRouter(ids, weights, dtype, E)
        return m

    fixed = sharing(ep_capacity=T)  # fixed: capacity T
    piped = sharing(ep_capacity=T, ep_chunks=args.pipeline_chunks)

    def pipelined(x):
        # its slices pass the phase marks once each: the step alone is timed
        enabled, split.enabled = split.enabled, False
        try:
            if dev.type != "cuda" or not args.pipeline_sms:
                return piped(x)
            with groupmm.sm_limit(args.pipeline_sms):
                return piped(x)
        finally:
            split.enabled = enabled

    # the rows this rank receives (one plan: the counts exchange and its host sync)
    plan = gpar.plan(ids, ex.num_experts, group)
    R = int(sum(plan.out_splits))
    del plan
    recv = gather(R)
    # the fused plan's rows to and from each rank (collective, as fused's forward plans)
    tplan = gpar.plan_tokens(ids, ex.num_experts, group)
    splits = {"in": list(tplan.in_splits), "out": list(tplan.out_splits)}
    del tplan
    lead = rank == 0

    fwd, leaves, errors = {}, {}, {}
    want = set(args.impls.split(","))
    # every expert on every rank: the whole layer's weights and the check's reference
    w_all = gather_experts(ex, group, W) if ("whole" in want or args.check) else None
    for name, m in (("fused", fused), ("fixed", fixed), ("pipelined", pipelined)):
        if name in want:
            fwd[name] = lambda m=m: m(x)
            leaves[name] = [x, weights, ex.w_in, ex.w_out]
    module = None  # torchtitan's own classes, its experts on torch._grouped_mm
    if "torchtitan" in want and ctx["tt"] is None:
        errors["torchtitan"] = ctx["tt_why"]
    elif "torchtitan" in want:
        why = None
        try:
            module = build_torchtitan(ctx["tt"], mesh, split, ex, E, k, dev, dtype)
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            why = error_text(e)
        if agree(why is None, dev):

            def tt_forward():
                x3, ids3, s3 = x.view(1, T, d), ids.view(1, T, k), weights.view(1, T, k)
                # MoE.forward's tokens per expert: the one-hot routing map, summed
                rmap = torch.zeros(1, T, E, dtype=torch.bool, device=x.device)
                counts = rmap.scatter_(-1, ids3, True).sum(dim=(0, 1))
                return module(x3, s3, ids3, counts).view(T, d)

            fwd["torchtitan"] = tt_forward
            leaves["torchtitan"] = [x, weights, *module.parameters()]
        else:
            errors["torchtitan"] = why or "failed to build on another rank"
    if "whole" in want:
        assert w_all is not None
        w_in_all, w_out_all = (w.requires_grad_() for w in w_all)  # the reference detaches

        def whole():
            r = routes(ids, E)
            w = weights.to(dtype)  # as the router stub gives them
            return expert_block(x, w_in_all, w_out_all, r.offs, r.src, r.inverse, w)

        fwd["whole"] = whole
        leaves["whole"] = [x, weights, w_in_all, w_out_all]

    def make_step(name):
        fn, ls = fwd[name], leaves[name]

        def step():
            for t in ls:
                t.grad = None
            out = fn()
            split.stamp("f3")
            out.backward(gy)

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
            out.backward(gy)
            clock.sync()
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            why = error_text(e)
            out = None
        if not agree(why is None, dev):
            errors[name] = why or "failed on another rank"
            del steps[name]
            continue
        if args.check:
            if name == "torchtitan":
                gw_in, gw_out = torchtitan_grads(module)
            elif name == "whole":  # every rank's tokens' gradient of this rank's experts
                gw_in, gw_out = (
                    _own_slice(leaf.grad, group, rank, ex.num_experts) for leaf in leaves[name][2:]
                )
            else:
                gw_in, gw_out = ex.w_in.grad, ex.w_out.grad
            grads = (x.grad, weights.grad, gw_in, gw_out)
            got[name] = dict(zip(GRADS, (out.detach(), *(_copy(g) for g in grads))))
        del out
        for t in leaves[name]:
            t.grad = None
    if args.check:
        assert w_all is not None
        check = run_check(got, x, ids, weights, ex, w_all, gy, ctx)
        got.clear()
        w_all = None  # whole's closure keeps its own references (when it runs)
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
            why = error_text(e)
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
            stamps[n] += [phases_of(clock.ms, st, ep=n not in LOCAL) for st in recs]
    if "fixed" in names:  # the routing flags of the fixed-size calls not checked yet
        gpar.check_routing(group)
    # the all-to-all bandwidth at the fixed-size exchange's rows and the exact dispatch's
    alltoall = {}
    if args.a2a_samples:
        sent = gather(sum(splits["in"]))
        exact = max(W, round(sum(sent) / W / W) * W)
        for key, n in (("fixed", W * T), ("exact", exact)):
            alltoall[key] = {"rows": n, "ms": time_alltoall(n, d, ctx, args.a2a_samples)}
    phases = {
        n: {
            p: statistics.median(v[p] for v in st)
            for p in ("step", *PHASES)
            if st and all(p in v for v in st)
        }
        for n, st in stamps.items()
    }
    row_bytes = d * torch.empty((), dtype=dtype).element_size()
    mine = dict(rank=rank, recv_rows=R, splits=splits, row_bytes=row_bytes)
    mine.update(alltoall=alltoall or None, samples=samples, phases=phases)
    return make_row(spec, W, gather(mine), names, errors, check, str(dtype).replace("torch.", ""))


def _copy(t):
    return None if t is None else t.detach().clone()


def _own_slice(g, group, rank: int, e: int):
    """This rank's ``e`` experts of a whole-layer gradient summed over the ranks."""
    if g is None:
        return None
    g = g.detach().clone()
    dist.all_reduce(g, group=group)
    return g[rank * e : (rank + 1) * e]


def run_check(got: dict, x, ids, weights, ex, w_all, gy, ctx) -> dict:
    """Each first step's largest differences over ranks to the plain-torch reference and
    to fused's."""
    group, rank = ctx["group"], ctx["rank"]
    dtype = ctx["dtype"]
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    ref = dense_reference(x, ids, weights, *w_all, gy, ct)
    out, dx, dw, dwi, dwo = ref
    dist.all_reduce(dwi, group=group)
    dist.all_reduce(dwo, group=group)
    e = ex.num_experts
    ref_d = dict(
        zip(GRADS, (out, dx, dw, dwi[rank * e : (rank + 1) * e], dwo[rank * e : (rank + 1) * e]))
    )
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
        tol = TOL_BF16 if name == "torchtitan" else TOL[dname]
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
