"""Whole MoE layers: groupmm's ``MoELayer`` against the same layer on ``F.grouped_mm``
and against the plain layer most code writes, in one process, same weights and routing.

    python benches/bench_moe.py [--json out.json] [--reps 10] [--tokens 4096,16384]
    python benches/bench_moe.py --device cpu --tiny          # a quick run anywhere
    python benches/bench_moe.py --replot out.json --png out.png   # the chart of a run

Implementations (every one is router -> permute -> experts -> combine, SwiGLU experts):

- ``groupmm``: ``groupmm.moe.MoELayer(fused=False)`` (groupmm's grouped GEMMs; dispatch
  and combine whose backward is row kernels, no ``index_put``);
- ``fused``: ``MoELayer``'s default path, ``groupmm.fused.expert_up`` / ``expert_down``
  (the glue in one-pass row kernels, ``groupmm._rows``);
- ``torch-gmm``: the same ``MoELayer`` with ``torch.nn.functional.grouped_mm`` swapped in
  for the two grouped products (so the difference to ``groupmm`` is the GEMMs alone);
- ``plain``: ``F.grouped_mm`` with the glue most MoE code writes: ``x[src]`` to dispatch,
  ``y[inverse]`` and a weighted sum to combine (autograd's ``index_put`` backward).

Configs (d_model, d_ff, experts, top-k): Qwen3-30B-A3B-like (2048, 768, 128, 8),
OLMoE-like (2048, 1024, 64, 8), DeepSeek-V3-local-like (7168, 2048, 32, 8: the experts one
rank holds under expert parallelism), Mixtral-like (4096, 14336, 8, 2). Routing:
``uniform`` (experts drawn uniformly: balanced up to sampling noise; a token's k experts
distinct) or ``skewed`` (Zipf 1.2 over experts, E/8 experts empty); the router's scores
are computed but the chosen experts are this fixed routing, so every implementation sees
the same groups.

Passes: ``fwd`` under ``torch.no_grad``; ``fwd+bwd``: forward and backward of a fixed
random output gradient, parameter gradients set to None before each step. Times: CUDA
events, steps back to back, median of ``--reps`` after warm-up (benches/timing.py).
Memory: peak bytes allocated during one fwd+bwd step above what was allocated before it
(parameters, input, output gradient), from ``torch.cuda.max_memory_allocated``. The
ratios are ``torch-gmm``'s and ``plain``'s time over ``groupmm``'s and over ``fused``'s:
> 1 favours groupmm.
"""

from __future__ import annotations

import argparse
import json
import sys

import groupmm
import groupmm.nn as gnn
import torch
import torch.nn.functional as F
from groupmm.fused import expert_down, expert_up
from groupmm.moe import MoELayer, _routes, permute, unpermute
from timing import median_ms  # benches/timing.py, same folder

CONFIGS = {
    "qwen3": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "dsv3-local": (7168, 2048, 32, 8),
    "mixtral": (4096, 14336, 8, 2),
}
TINY = {"tiny": (64, 32, 8, 2)}


def routing(T: int, E: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] expert ids, each token's k distinct."""
    if kind == "uniform":
        # k distinct experts per token, every expert T*k/E times (up to rounding)
        base = torch.randperm(T * k, generator=gen) % E
        ids = base.view(T, k)
        shift = torch.arange(k).view(1, k)
        return (ids[:, :1] + shift * max(E // k, 1)) % E
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p[torch.randperm(E, generator=gen)[: E // 8]] = 0  # E/8 experts empty
    p = p[torch.randperm(E, generator=gen)]
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)


class Plain(torch.nn.Module):
    """The layer most MoE code writes: router, ``x[src]``, two ``F.grouped_mm``, SwiGLU,
    ``y[inverse]`` and a weighted sum (the weights of ``layer``)."""

    def __init__(self, layer: MoELayer):
        super().__init__()
        self.layer = layer

    def forward(self, x, ids):
        layer = self.layer
        E, k = layer.num_experts, layer.top_k
        weights = _weights(layer, x, ids)
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


def _weights(layer: MoELayer, x, ids):
    """The router's normalised probabilities at the fixed experts ``ids`` (differentiable)."""
    probs = layer.router.gate(x).float().softmax(-1)
    w = probs.gather(1, ids)
    return (w / w.sum(-1, keepdim=True)).to(x.dtype)


def moe_forward(layer: MoELayer, x, ids, fused=False):
    """MoELayer.forward with the fixed routing ``ids`` (its fused path with ``fused``)."""
    w = _weights(layer, x, ids)
    if fused:
        r = _routes(ids, layer.num_experts, None)
        h = expert_up(x, layer.experts.w_in, r.offs, r.src, r.inverse)
        return expert_down(h, layer.experts.w_out, r.offs, r.inverse, w)
    p = permute(x, ids, layer.num_experts)
    y = layer.experts(p.tokens, p.offs)
    return unpermute(y, p.inverse, w)


class _TorchGmm:
    """Context: GroupedExperts' grouped products on F.grouped_mm."""

    def __enter__(self):
        self.saved = gnn.grouped_mm
        gnn.grouped_mm = lambda a, b, offs=None: F.grouped_mm(a, b, offs=offs)

    def __exit__(self, *exc):
        gnn.grouped_mm = self.saved


def plot(result: dict, path: str) -> None:
    """Bar chart of a run: forward+backward time per config (panel per T and routing),
    one bar per implementation, and peak memory; ``result`` as ``--json`` writes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    impls = [i for i in ("groupmm", "fused", "torch-gmm", "plain") if f"{i} fwd+bwd ms" in rows[0]]
    cases = sorted({(r["T"], r["routing"]) for r in rows})
    fig, axes = plt.subplots(2, len(cases), figsize=(4.2 * len(cases), 7), squeeze=False)
    for col, (T, kind) in enumerate(cases):
        sel = [r for r in rows if r["T"] == T and r["routing"] == kind]
        for row, (key, unit) in enumerate(((" fwd+bwd ms", "ms"), (" peak bytes", "MiB"))):
            ax = axes[row][col]
            width = 0.8 / len(impls)
            for n, impl in enumerate(impls):
                vals = [(r[impl + key] or 0) / (2**20 if unit == "MiB" else 1) for r in sel]
                ax.bar([i + n * width for i in range(len(sel))], vals, width, label=impl)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sel))])
            ax.set_xticklabels([r["config"] for r in sel], fontsize=8)
            ax.set_title(
                f"T={T} {kind}: fwd+bwd {unit}" if row == 0 else f"peak {unit}", fontsize=9
            )
            ax.tick_params(axis="y", labelsize=8)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"MoE layers, {result['device']}, {result['dtype']}, torch {result['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _fmt(v, scale=1.0):
    return "-" if v is None else f"{v / scale:.3f}" if scale == 1.0 else f"{v / scale:.0f}"


def measure(fn, x, gy, params, reps, cuda):
    def fwd():
        with torch.no_grad():
            fn(x)

    def step():
        for p in params:
            p.grad = None
        fn(x).backward(gy)

    t_fwd = median_ms(fwd, reps, cuda=cuda)
    t_step = median_ms(step, reps, cuda=cuda)
    peak = None
    if cuda:
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return t_fwd, t_step, peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--routing", default="uniform,skewed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="one tiny config, T = 64 (a smoke run)")
    ap.add_argument("--json")
    ap.add_argument("--png", help="a bar chart of the run (needs matplotlib)")
    ap.add_argument("--replot", metavar="JSON", help="only chart an earlier --json result")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as fh:
            plot(json.load(fh), args.png or args.replot.replace(".json", ".png"))
        return 0
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    configs = TINY if args.tiny else {c: CONFIGS[c] for c in args.configs.split(",")}
    tokens = [64] if args.tiny else [int(t) for t in args.tokens.split(",")]
    dev = torch.device(args.device)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device {name}; torch {torch.__version__}; groupmm {groupmm.__version__}; {dtype}")
    rows = []
    impls = ("groupmm", "fused", "torch-gmm", "plain")
    print(
        "config T routing | fwd ms: groupmm fused torch-gmm plain | fwd+bwd ms: groupmm fused"
        " torch-gmm plain | peak MiB: groupmm fused torch-gmm plain | fwd+bwd: torch-gmm and"
        " plain over groupmm, over fused"
    )
    for cname, (d, f, E, k) in configs.items():
        torch.manual_seed(0)
        layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype)
        params = list(layer.parameters())
        plain = Plain(layer)
        for T in tokens:
            for kind in args.routing.split(","):
                gen = torch.Generator().manual_seed(T + E)
                ids = routing(T, E, k, kind, gen).to(dev)
                x = torch.randn(T, d, device=dev, dtype=dtype, generator=None).requires_grad_()
                gy = torch.randn(T, d, device=dev, dtype=dtype)
                res = {}
                outs = {}
                for impl in impls:
                    if impl == "plain":
                        fn = lambda x, m=plain, i=ids: m(x, i)  # noqa: E731
                    elif impl == "fused":
                        fn = lambda x, m=layer, i=ids: moe_forward(m, x, i, True)  # noqa: E731
                    else:
                        fn = lambda x, m=layer, i=ids: moe_forward(m, x, i)  # noqa: E731
                    try:
                        if impl == "torch-gmm":
                            with _TorchGmm():
                                res[impl] = measure(fn, x, gy, params, args.reps, cuda)
                                with torch.no_grad():
                                    outs[impl] = fn(x).float()
                        else:
                            res[impl] = measure(fn, x, gy, params, args.reps, cuda)
                            with torch.no_grad():
                                outs[impl] = fn(x).float()
                    except Exception as e:  # report and go on (e.g. no F.grouped_mm)
                        res[impl] = (None, None, None)
                        print(f"  {impl}: {type(e).__name__}: {e}", file=sys.stderr)
                    if cuda:
                        torch.cuda.empty_cache()
                diff = {
                    i: float((outs[i] - outs["groupmm"]).norm() / outs["groupmm"].norm())
                    for i in outs
                    if i != "groupmm" and "groupmm" in outs
                }
                row = dict(config=cname, d_model=d, d_ff=f, experts=E, top_k=k, T=T, routing=kind)
                row.update(
                    {f"{i} fwd ms": r[0] for i, r in res.items()},
                    **{f"{i} fwd+bwd ms": r[1] for i, r in res.items()},
                    **{f"{i} peak bytes": r[2] for i, r in res.items()},
                    rel_diff=diff,
                )
                rows.append(row)

                g = res["groupmm"][1]
                cells = [
                    " ".join(_fmt(res[i][j], 2**20 if j == 2 else 1.0) for i in impls)
                    for j in range(3)
                ]
                fz = res["fused"][1]
                speed = [
                    _fmt(res[i][1] / base if res[i][1] and base else None)
                    for base in (g, fz)
                    for i in ("torch-gmm", "plain")
                ]
                print(f"{cname} {T} {kind} | " + " | ".join(cells) + " | " + " ".join(speed))
    result = dict(device=name, torch=torch.__version__, dtype=str(dtype), rows=rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
