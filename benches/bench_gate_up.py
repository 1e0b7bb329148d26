"""The fused expert block with gate and up as two weights against one concatenated
``[gate | up]`` weight, and against concatenating the two every step; round-robin.

    python3 benches/bench_gate_up.py [--configs all|NAME,...] [--tokens 16384]
        [--layout torchtitan|packed] [--rounds 7] [--json out.json] [--md out.md]

Rows: ``up fwd`` (``_native.product("swiglu")``, pair vs concatenated: the same kernel) and
``block fwd+bwd`` (``expert_block``: concat, pair, cat/step). ``--layout torchtitan``:
``[E, F, D]`` weights read through transposed views; ``packed``: ``[E, D, F]``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from groupmm import _native
from groupmm._glue import routes
from groupmm.fused import expert_block
from harness.configs import CONFIGS, routing, select_configs
from harness.timing import round_robin


def _weights(E, D, Fh, layout, gen):
    """``(gate, up, cat)``: ``[E, D, F]`` views (torchtitan: of ``[E, F, D]`` storage) and
    the concatenated ``[E, D, 2F]`` of the same values in the same layout."""
    if layout == "torchtitan":
        w1 = torch.randn(E, Fh, D, generator=gen) / D**0.5
        w3 = torch.randn(E, Fh, D, generator=gen) / D**0.5
        cat = torch.cat([w1, w3], 1)
        to = [t.cuda().bfloat16() for t in (w1, w3, cat)]
        return [t.transpose(1, 2) for t in to]
    gate = torch.randn(E, D, Fh, generator=gen) / D**0.5
    up = torch.randn(E, D, Fh, generator=gen) / D**0.5
    return [t.cuda().bfloat16() for t in (gate, up, torch.cat([gate, up], 2))]


def _leaf(t):
    return t.detach().requires_grad_()


def run_config(name, T, layout, settings):
    D, Fh, E, k = CONFIGS[name]
    gen = torch.Generator().manual_seed(0)
    ids = routing(T, E, k, "uniform", gen).cuda()
    r = routes(ids, E)
    src, offs = r.src.int(), r.offs
    x = (torch.randn(T, D, generator=gen)).cuda().bfloat16()
    gate, up, cat = _weights(E, D, Fh, layout, gen)
    w_out = (torch.randn(E, Fh, D, generator=gen) / Fh**0.5).cuda().bfloat16()
    wts = torch.rand(T, k, generator=gen).cuda().bfloat16()
    go = torch.randn(T, D, generator=gen).cuda().bfloat16()
    leaves = {n: _leaf(t) for n, t in dict(x=x, gate=gate, up=up, cat=cat, w_out=w_out).items()}
    lw = _leaf(wts)

    def block(w_in):
        out = expert_block(leaves["x"], w_in, leaves["w_out"], offs, r.src, r.inverse, lw)
        out.backward(go)

    def cat_each_step():
        # the two weights written as one every step, the gradient split back
        both = torch.cat([leaves["gate"], leaves["up"]], 2)
        block(both)

    fwd = {
        "concat": lambda: _native.product("swiglu", x, cat, offs, (), src),
        "pair": lambda: _native.product("swiglu", x, gate, offs, (up,), src),
    }
    step = {
        "concat": lambda: block(leaves["cat"]),
        "pair": lambda: block((leaves["gate"], leaves["up"])),
        "cat/step": cat_each_step,
    }
    got = _native.product("swiglu", x, gate, offs, (up,), src)
    want = _native.product("swiglu", x, cat, offs, (), src)
    same = got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    f_res, _ = round_robin(fwd, **settings)
    s_res, _ = round_robin(step, **settings)
    return {
        "config": name,
        "shape": dict(T=T, D=D, F=Fh, E=E, k=k),
        "layout": layout,
        "pair_kernel_bitwise_equal": same,
        "up_fwd": {n: v["ms"] for n, v in f_res.items()},
        "up_fwd_spread": {n: (v.get("min"), v.get("max")) for n, v in f_res.items()},
        "block": {n: v["ms"] for n, v in s_res.items()},
        "block_spread": {n: (v.get("min"), v.get("max")) for n, v in s_res.items()},
    }


def _md(rows, header):
    out = [header, ""]
    out.append(
        "| config | T | up fwd concat ms | pair ms | pair/concat | block concat ms "
        "| pair ms | cat/step ms | concat/pair | cat-step/pair | bitwise |"
    )
    out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        f, b = r["up_fwd"], r["block"]

        def ratio(a, c):
            return f"{a / c:.3f}" if a and c else "-"

        out.append(
            f"| {r['config']} | {r['shape']['T']} | {f['concat']:.3f} | {f['pair']:.3f} "
            f"| {ratio(f['concat'], f['pair'])} | {b['concat']:.3f} | {b['pair']:.3f} "
            f"| {b['cat/step']:.3f} | {ratio(b['concat'], b['pair'])} "
            f"| {ratio(b['cat/step'], b['pair'])} | {r['pair_kernel_bitwise_equal']} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="qwen3-30b-a3b,olmoe,dsv2-lite,glm45-air,mixtral,fine")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--layout", choices=["torchtitan", "packed"], default="torchtitan")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json")
    p.add_argument("--md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gate_up: needs a CUDA GPU", file=sys.stderr)
        return 2
    settings = dict(rounds=args.rounds)
    dev = torch.cuda.get_device_name()
    header = (
        f"# Gate and up as two weights vs one ({dev}, torch {torch.__version__}, bf16, "
        f"T = {args.tokens} tokens, layout {args.layout}; ratios > 1: the pair faster)\n\n"
        f"`python3 benches/bench_gate_up.py --configs {args.configs} --tokens {args.tokens} "
        f"--layout {args.layout} --rounds {args.rounds}`"
    )
    rows = []
    for name in select_configs(args.configs):
        rows.append(run_config(name, args.tokens, args.layout, settings))
        r = rows[-1]
        print(name, r["up_fwd"], r["block"], "bitwise", r["pair_kernel_bitwise_equal"], flush=True)
        torch.cuda.empty_cache()
        if args.json:
            meta = dict(device=dev, torch=torch.__version__, cmd=" ".join(sys.argv))
            with open(args.json, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
        if args.md:
            with open(args.md, "w") as f:
                f.write(_md(rows, header))
    print(_md(rows, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
