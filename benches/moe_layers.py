"""The MoE layers bench_moe.py times and profile_moe.py profiles, every one router ->
dispatch -> SwiGLU experts -> weighted combine on the same weights (bench_moe.py's
docstring describes each): ``fused`` (``MoELayer`` as it runs by default), ``groupmm``
(its unfused path), ``torch-gmm`` (that path on ``F.grouped_mm``), ``plain``
(:class:`Plain`) and ``sonicmoe`` (benches/peer_sonicmoe.py); and :func:`run_row`, the
measurement of one bench_moe row (warm-up, check, round-robin timing, memory, gradients).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer, permute, unpermute
from harness.configs import routing
from harness.report import error_text, rel_diff
from harness.timing import round_robin, rr_settings
from moe_report import make_row
from peers.sonicmoe import sonic_forward, to_groupmm_layout
from peers.torch import TorchGmm, why_no_grouped_mm


def _weights(layer: MoELayer, x, ids):
    """The router's normalised probabilities at the fixed experts ``ids`` (differentiable)."""
    probs = layer.router.gate(x).float().softmax(-1)
    w = probs.gather(1, ids)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype)


def route(layer: MoELayer, x, ids):
    """``(weights, ids)``: the layer's own router when ``ids`` is None (softmax, top-k,
    renormalised), else the router's renormalised probabilities at the fixed ``ids``."""
    if ids is None:
        r = layer.router(x)
        return r.weights, r.expert_ids
    return _weights(layer, x, ids), ids


class Plain(torch.nn.Module):
    """The layer most MoE code writes: router, ``x[src]``, two ``F.grouped_mm``, SwiGLU,
    ``y[inverse]`` and a weighted sum (the weights of ``layer``)."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x, ids=None):
        layer = self.layer
        E, k = layer.num_experts, layer.top_k
        weights, ids = route(layer, x, ids)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.searchsorted(flat[order], torch.arange(E, device=x.device), right=True).to(
            torch.int32
        )
        h = F.grouped_mm(x[order // k], layer.experts.w_in, offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, layer.experts.w_out, offs=offs)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=x.device)
        )
        rows = y[inverse].view(x.shape[0], k, -1)
        return (rows * weights.unsqueeze(-1)).sum(1)


def moe_forward(layer: MoELayer, x, ids=None, fused=False):
    """MoELayer.forward (its fused path with ``fused``), with the fixed routing ``ids``
    or, when None, the layer's router."""
    w, ids = route(layer, x, ids)
    if fused:
        r = routes(ids, layer.num_experts)
        ex = layer.experts
        return expert_block(x, ex.w_in, ex.w_out, r.offs, r.src, r.inverse, w)
    p = permute(x, ids, layer.num_experts)
    y = layer.experts(p.tokens, p.offs)
    return unpermute(y, p.inverse, w)


def torch_gmm_forward(layer: MoELayer, x, ids=None):
    with TorchGmm():
        return moe_forward(layer, x, ids)


def row_inputs(T: int, d: int, E: int, k: int, kind: str, dev, dtype) -> tuple:
    """``(ids, x, gy)`` of a row: the fixed expert ids (None for the layer's router), the
    input x (a leaf) and the output gradient, each from its own seed so that every
    implementation, bench_moe.py's timing and profile_moe.py's profile see the same."""
    ids = None
    if kind != "router":
        gen = torch.Generator().manual_seed(T + E)
        ids = routing(T, E, k, kind, gen).to(dev)
    torch.manual_seed(T)
    x = torch.randn(T, d, device=dev, dtype=dtype).requires_grad_()
    gy = torch.randn(T, d, device=dev, dtype=dtype)
    return ids, x, gy


def build_impls(layer: MoELayer, ids, k: int, S=None, sonic_w=None, why_no_sonic=None):
    """``(forwards, leaves, errors)``: implementation -> ``fn(x)``, -> the leaf tensors
    whose gradients a step resets (x excluded), -> why it does not run here."""
    params = list(layer.parameters())
    plain = Plain(layer)
    fwd, leaves, errors = {}, {}, {}
    if ids is None:
        assert layer.fused, "the layer's default path must be the fused one"
        fwd["fused"] = layer  # MoELayer.forward as a user runs it
    else:
        fwd["fused"] = lambda x: moe_forward(layer, x, ids, fused=True)
    fwd["groupmm"] = lambda x: moe_forward(layer, x, ids)
    no_gmm = why_no_grouped_mm()
    if no_gmm is None:
        fwd["torch-gmm"] = lambda x: torch_gmm_forward(layer, x, ids)
        fwd["plain"] = lambda x: plain(x, ids)
    else:
        for name in ("torch-gmm", "plain"):
            errors[name] = no_gmm
    for name in fwd:
        leaves[name] = params
    if S is None:
        errors["sonicmoe"] = why_no_sonic or "not loaded"
    elif ids is not None:
        errors["sonicmoe"] = "fixed routing: SonicMoE's layer routes with its own router"
    else:
        rw, w1, w2 = sonic_w
        fwd["sonicmoe"] = lambda x: sonic_forward(S, x, rw, w1, w2, k)
        leaves["sonicmoe"] = [rw, w1, w2]
    return fwd, leaves, errors


def grads_of(name, layer, x, sonic_w) -> dict:
    """The gradients a step left, in groupmm's layout."""
    if name == "sonicmoe":
        rw, w1, w2 = sonic_w
        w_in, w_out = (None, None)
        if w1.grad is not None and w2.grad is not None:
            w_in, w_out = to_groupmm_layout(w1.grad, w2.grad)
        return {"x": x.grad, "router": rw.grad, "w_in": w_in, "w_out": w_out}
    ex = layer.experts
    return {
        "x": x.grad,
        "router": layer.router.gate.weight.grad,
        "w_in": ex.w_in.grad,
        "w_out": ex.w_out.grad,
    }


def run_row(plan_row, layer, S, sonic_w, why_no_sonic, args, dev, dtype) -> dict:
    """Measure one row: SonicMoE's warm-up, the output check, the round-robin timing, then
    per implementation the memory step and the gradient check."""
    T, E, k, d = plan_row["T"], plan_row["experts"], plan_row["top_k"], plan_row["d_model"]
    backward = plan_row["pass"] == "fwd+bwd"
    cuda = torch.cuda.is_available()  # memory figures (the CPU tests stand a fake in)
    ids, x, gy = row_inputs(T, d, E, k, plan_row["routing"], dev, dtype)
    fwd, leaves, errors = build_impls(layer, ids, k, S, sonic_w, why_no_sonic)
    everything = [x] + [t for ls in leaves.values() for t in ls]

    def clear():
        for t in everything:
            t.grad = None

    def make_step(fn, ls):
        def step():
            for t in ls:
                t.grad = None
            if backward:
                fn(x).backward(gy)
            else:
                with torch.no_grad():
                    fn(x)

        return step

    steps = {name: make_step(fn, [x, *leaves[name]]) for name, fn in fwd.items()}
    sonic_warm_s = None
    if "sonicmoe" in steps:
        print("   SonicMoE warm-up: one step (JIT compile and autotune on first use) ...")
        t0 = time.perf_counter()
        try:
            steps["sonicmoe"]()
            if cuda:
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported in the row, the others go on
            errors["sonicmoe"] = error_text(e, first_line=False)
            del steps["sonicmoe"], fwd["sonicmoe"]
        sonic_warm_s = time.perf_counter() - t0
        print(f"   SonicMoE warm-up took {sonic_warm_s:.1f} s")
    diffs, outs = {}, {}
    for name, fn in list(fwd.items()):
        try:
            with torch.no_grad():
                outs[name] = fn(x)
        except Exception as e:  # noqa: BLE001 - e.g. no sm90 F.grouped_mm for this dtype
            errors[name] = error_text(e, first_line=False)
            steps.pop(name, None)
            continue
        if name != "fused" and "fused" in outs:
            diffs[name] = rel_diff(outs[name], outs["fused"])
    outs.clear()
    clear()
    timed, meta = round_robin(steps, **rr_settings(args))
    peaks, grad_diffs, ref = {}, {}, None
    for name, step in steps.items():
        if (timed.get(name) or {}).get("error"):
            continue
        clear()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        step()
        if cuda:
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
        if backward:
            g = grads_of(name, layer, x, sonic_w)
            if name == "fused":
                ref = {key: None if v is None else v.detach().clone() for key, v in g.items()}
            elif ref is not None:
                grad_diffs[name] = {key: rel_diff(g[key], ref[key]) for key in ref}
    clear()
    ref = None
    base = dict(plan_row, dtype=str(dtype).replace("torch.", ""), lead_ms=meta["lead_ms"])
    base["sonic_warm_s"] = sonic_warm_s
    return make_row(base, timed, peaks, diffs, grad_diffs, errors)
