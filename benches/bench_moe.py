"""Whole MoE layers: groupmm's ``MoELayer`` against SonicMoE, the same layer on
``F.grouped_mm`` and a plain layer, same weights and routing, timed round-robin with peak
memory and output and gradient differences.

    python3 benches/bench_moe.py [--configs layer|layer-wide|fine|legacy|extra|all|NAME,...]
        [--tokens 4096,16384] [--routing router,uniform,skewed] [--passes fwd+bwd,fwd]
        [--rounds 10] [--no-sonic] [--budget-s S] [--json F] [--md F]
    python3 benches/bench_moe.py --dry-run [...]     # the rows; no GPU
    python3 benches/bench_moe.py --from-json a.json[,b.json] [--json merged.json] [--md F]
    python3 benches/bench_moe.py --tiny              # one tiny config, T = 64

Implementations: ``fused``, ``groupmm`` (unfused), ``torch-gmm`` (on ``F.grouped_mm``),
``plain`` and ``sonicmoe`` (routing ``router`` only: it routes itself).
"""

from __future__ import annotations

import sys
import time

import groupmm
import torch
import torch.nn.functional as F
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer, permute, unpermute
from harness.cli import (
    add_output_args,
    add_rr_args,
    check_lists,
    check_rr_args,
    line_buffered_stdout,
    no_cuda,
    parser,
)
from harness.configs import CONFIGS, MODELS, PASSES, ROUTINGS, TINY, routing, select_configs
from harness.report import error_text, from_json, rel_diff, run_doc, run_rows
from harness.report import write_outputs as write_files
from harness.report.moe import (
    describe_env,
    format_row,
    label,
    make_row,
    merge_docs,
    print_table,
    render_md,
    summarize,
)
from harness.timing import round_robin, rr_settings
from peers.sonicmoe import (
    load_sonic,
    peer_versions,
    sonic_forward,
    sonic_weights,
    to_groupmm_layout,
)
from peers.torch import TorchGmm, why_no_grouped_mm

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--configs", default="layer", help="config names and groups (default layer)")
    p.add_argument("--tokens", default="4096,16384", help="comma list of T (tokens)")
    p.add_argument("--routing", default="router", help="router (default), uniform, skewed")
    p.add_argument("--passes", default="fwd+bwd", help="fwd+bwd (default), fwd")
    p.add_argument("--tiny", action="store_true", help="one tiny config, T = 64 (a smoke run)")
    add_rr_args(p, rounds=10, sample_ms=25.0, min_calls=2, max_calls=10, unit="steps")
    p.add_argument("--no-sonic", action="store_true", help="leave SonicMoE out")
    add_output_args(p)
    args = p.parse_args(argv)
    check_rr_args(p, args)
    check_lists(p, (args.routing, ROUTINGS), (args.passes, PASSES))
    return args


def plan_rows(configs: dict, tokens, routings, passes) -> list:
    """The rows of a run in the order they run: per config, T, routing, pass."""
    return [
        {"config": name, "model": MODELS.get(name, name), "d_model": d, "d_ff": f}
        | {"experts": E, "top_k": k, "T": T, "routing": r, "pass": p}
        for name, (d, f, E, k) in configs.items()
        for T in tokens
        for r in routings
        for p in passes
    ]


def step_flops(row: dict) -> float:
    """FLOPs of the experts in one step: 2·T·k·d·3F forward, three times that with bwd."""
    fwd = 2.0 * row["T"] * row["top_k"] * row["d_model"] * 3 * row["d_ff"]
    return fwd * (3.0 if row["pass"] == "fwd+bwd" else 1.0)


def dry_run(plan, configs, args) -> int:
    for r in plan:
        print(
            f"{r['config']:15} T={r['T']:<6} {r['routing']:7} {r['pass']:7} "
            f"d={r['d_model']:<5} d_ff={r['d_ff']:<5} E={r['experts']:<3} k={r['top_k']} "
            f"rows/expert {r['T'] * r['top_k'] / r['experts']:7.1f}  "
            f"{step_flops(r) / 1e12:6.2f} TFLOP/step  {r['model']}"
        )
    print(f"{len(plan)} rows over {len(configs)} configs")
    return 0


# ------------------------------------------------------------------------------- the layers


def route(layer: MoELayer, x, ids):
    """``(weights, ids)``: the layer's router, or its renormalised probabilities at ``ids``."""
    if ids is None:
        r = layer.router(x)
        return r.weights, r.expert_ids
    w = layer.router.gate(x).float().softmax(-1).gather(1, ids)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype), ids


class Plain(torch.nn.Module):
    """The layer most MoE code writes: ``x[src]``, two ``F.grouped_mm``, ``y[inverse]``."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x, ids=None):
        layer, k = self.layer, self.layer.top_k
        weights, ids = route(layer, x, ids)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = torch.arange(layer.num_experts, device=x.device)
        offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)
        gate, up = F.grouped_mm(x[order // k], layer.experts.w_in, offs=offs).chunk(2, dim=-1)
        y = F.grouped_mm(F.silu(gate) * up, layer.experts.w_out, offs=offs)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.numel(), device=x.device)
        )
        return (y[inverse].view(x.shape[0], k, -1) * weights.unsqueeze(-1)).sum(1)


def moe_forward(layer: MoELayer, x, ids=None, fused=False):
    """MoELayer.forward (its fused path with ``fused``) with fixed ``ids`` or its router."""
    w, ids = route(layer, x, ids)
    if fused:
        r = routes(ids, layer.num_experts)
        return expert_block(x, layer.experts.w_in, layer.experts.w_out, r.offs, r.src, r.inverse, w)
    p = permute(x, ids, layer.num_experts)
    return unpermute(layer.experts(p.tokens, p.offs), p.inverse, w)


def row_inputs(T: int, d: int, E: int, k: int, kind: str, dev, dtype) -> tuple:
    """``(ids, x, gy)`` of a row, each from its own seed (ids None for the router)."""
    ids = None
    if kind != "router":
        ids = routing(T, E, k, kind, torch.Generator().manual_seed(T + E)).to(dev)
    torch.manual_seed(T)
    x = torch.randn(T, d, device=dev, dtype=dtype).requires_grad_()
    return ids, x, torch.randn(T, d, device=dev, dtype=dtype)


def build_impls(layer: MoELayer, ids, k: int, S=None, sonic_w=None, why_no_sonic=None):
    """``(forwards, leaves, errors)``: name -> ``fn(x)``, -> the leaves whose gradients a
    step resets (x excluded), -> why it does not run here."""
    params, plain = list(layer.parameters()), Plain(layer)
    fwd, errors = {}, {}
    if ids is None:
        assert layer.fused, "the layer's default path must be the fused one"
        fwd["fused"] = layer
    else:
        fwd["fused"] = lambda x: moe_forward(layer, x, ids, fused=True)
    fwd["groupmm"] = lambda x: moe_forward(layer, x, ids)
    if (no_gmm := why_no_grouped_mm()) is None:

        def torch_gmm(x):
            with TorchGmm():
                return moe_forward(layer, x, ids)

        fwd["torch-gmm"], fwd["plain"] = torch_gmm, (lambda x: plain(x, ids))
    else:
        errors["torch-gmm"] = errors["plain"] = no_gmm
    leaves = dict.fromkeys(fwd, params)
    if S is None:
        errors["sonicmoe"] = why_no_sonic or "not loaded"
    elif ids is not None:
        errors["sonicmoe"] = "fixed routing: SonicMoE's layer routes with its own router"
    else:
        fwd["sonicmoe"] = lambda x: sonic_forward(S, x, *sonic_w, k)
        leaves["sonicmoe"] = list(sonic_w)
    return fwd, leaves, errors


def grads_of(name, layer, x, sonic_w) -> dict:
    """The gradients a step left, in groupmm's layout."""
    if name != "sonicmoe":
        ex = layer.experts
        return dict(
            x=x.grad, router=layer.router.gate.weight.grad, w_in=ex.w_in.grad, w_out=ex.w_out.grad
        )
    rw, w1, w2 = sonic_w
    w_in = w_out = None
    if w1.grad is not None and w2.grad is not None:
        w_in, w_out = to_groupmm_layout(w1.grad, w2.grad)
    return dict(x=x.grad, router=rw.grad, w_in=w_in, w_out=w_out)


def run_row(plan_row, layer, S, sonic_w, why_no_sonic, args, dev, dtype) -> dict:
    """One row: SonicMoE's warm-up, the output check, the round-robin timing, then per
    implementation one step for its peak memory and gradients."""
    T, E, k, d = plan_row["T"], plan_row["experts"], plan_row["top_k"], plan_row["d_model"]
    backward = plan_row["pass"] == "fwd+bwd"
    cuda = torch.cuda.is_available()
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
    base = dict(plan_row, dtype=str(dtype).replace("torch.", ""), lead_ms=meta["lead_ms"])
    base["sonic_warm_s"] = sonic_warm_s
    return make_row(base, timed, peaks, diffs, grad_diffs, errors)


# ------------------------------------------------------------------------------------ main


def write_outputs(doc: dict, args) -> None:
    write_files(doc, args.json, args.md, render_md)


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, merge_docs, print_table, render_md)
        return 0
    configs = TINY if args.tiny else {c: CONFIGS[c] for c in select_configs(args.configs)}
    tokens = [64] if args.tiny else [int(t) for t in args.tokens.split(",")]
    plan = plan_rows(configs, tokens, args.routing.split(","), args.passes.split(","))
    if args.dry_run:
        return dry_run(plan, configs, args)
    if no_cuda():
        return 2
    t_start = time.perf_counter()
    dev = torch.device(DEV)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    S, why = (None, "--no-sonic") if args.no_sonic else load_sonic()
    doc = run_doc("moe-2", argv)
    doc.update(
        dtype=str(dtype).replace("torch.", ""),
        groupmm=groupmm.build_info(),
        sonicmoe=S is not None,
        sonicmoe_why=why,
        versions=peer_versions(),
        timer={**rr_settings(args), "sonic_warmup": "one step per row before timing"},
        rows=[],
        skipped=[],
    )
    print("\n".join(describe_env(doc)))
    held = {}  # the layer of the config running, and its SonicMoE weights

    def measure(r):
        if held.get("config") != r["config"]:
            held.clear()
            name, (d, f, E, k) = r["config"], configs[r["config"]]
            print(f"== {name}: d={d} d_ff={f} E={E} k={k} ({MODELS.get(name, name)})")
            torch.manual_seed(0)
            layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype)
            sonic_w = sonic_weights(layer) if S is not None else None  # copied once
            held.update(config=r["config"], layer=layer, sonic_w=sonic_w)
        return run_row(r, held["layer"], S, held["sonic_w"], why, args, dev, dtype)

    def show(row, head):
        print(head + format_row(row))

    write = lambda d: write_outputs(d, args)  # noqa: E731
    run_rows(doc, plan, args, t_start, label, measure, summarize, write, show)
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
