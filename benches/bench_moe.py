"""Whole MoE layers: groupmm's ``MoELayer`` against SonicMoE, the same layer on
``F.grouped_mm`` and the plain layer most code writes, in one process, same weights and
routing, the implementations of a row timed interleaved.

    python3 benches/bench_moe.py [--configs issue22|issue28|fine|legacy|extra|all|NAME,...]
        [--tokens 4096,16384] [--routing router,uniform,skewed] [--passes fwd+bwd,fwd]
        [--rounds 10] [--no-sonic] [--budget-s SECONDS] [--json out.json] [--md out.md]
        [--png out.png]
    python3 benches/bench_moe.py --dry-run [...]     # the rows and a time estimate; no GPU
    python3 benches/bench_moe.py --from-json a.json[,b.json] [--json merged.json] [--md out.md]
        [--png out.png]                              # render (and merge) results; no GPU
    python3 benches/bench_moe.py --tiny              # one tiny config, T = 64 (a smoke run)

Implementations (every one is router -> dispatch -> SwiGLU experts -> weighted combine):

- ``fused``: ``groupmm.moe.MoELayer`` as it runs by default (``groupmm.fused.expert_block``:
  the up projection with SwiGLU and the "dgated" backward in one native call each, the
  other glue in one-pass row kernels);
- ``groupmm``: ``MoELayer(fused=False)``'s path (permute, ``GroupedExperts``, unpermute);
- ``torch-gmm``: that unfused path with ``torch.nn.functional.grouped_mm`` swapped in for
  the two grouped products (groupmm's glue, torch's GEMMs);
- ``plain``: ``F.grouped_mm`` with the glue most MoE code writes: ``x[src]`` to dispatch,
  ``y[inverse]`` and a weighted sum to combine (autograd's ``index_put`` backward, i.e.
  an ``index_add``);
- ``sonicmoe``: SonicMoE's ``sonicmoe.functional.moe_TC_softmax_topk_layer`` (optional:
  when it does not import, its column is "-" and the output says why), called as
  ``../shared/PEERS.md`` shows, on copies of the same weights made once before timing:
  router ``[E, d]`` as it is; ``w1`` ``(E, 2F, d)`` = ``w_in.transpose(1, 2)`` (rows
  ``[gate; up]``, ``concat_layout=True``) and ``w2`` ``(E, d, F)`` =
  ``w_out.transpose(1, 2)``, both handed over as ``.permute(1, 2, 0)``
  (:func:`sonic_weights`; :func:`sonic_layout_reference` is the layer those tensors define).

Configs (d_model, d_ff, experts, top-k), ``--configs`` takes names and groups:
``issue22`` (the default: issue 22's table) Qwen3-30B-A3B (2048, 768, 128, 8), OLMoE
(2048, 1024, 64, 8), Qwen3-235B-A22B (4096, 1536, 128, 8), gpt-oss-20b-like SwiGLU (2880,
2880, 32, 4); ``extra`` DeepSeek-V2-Lite's routed experts (2048, 1408, 64, 6); ``fine``
(issue 28's fine-grained settings: narrow experts, top-k 2-16, up to 256 experts, the names
spell out d, F, E, k); ``issue28`` (issue 28's table: issue22 + extra + GLM-4.5-Air-like
(4096, 1408, 128, 8) + fine); ``legacy``
(the configs of earlier runs) qwen3 (2048, 768, 128, 8), olmoe, dsv3-local (7168, 2048, 32,
8: the experts one rank holds under expert parallelism), mixtral (4096, 14336, 8, 2).

Routing: ``router`` (default; what issue 22 measures): each implementation routes with the
layer's router, Qwen3 style: softmax over all experts in float32, top-k, renormalised
(SonicMoE: ``is_softmax_over_topk=False, norm_topk_probs=True``). ``uniform`` (experts drawn
uniformly, a token's k experts distinct) and ``skewed`` (Zipf 1.2 over experts, E/8 experts
empty) fix the experts and weight them with the router's renormalised probabilities at
those experts; SonicMoE's layer always routes with its own router, so it is not measured
there.

Passes: ``fwd+bwd`` (default): forward and backward of a fixed random output gradient, the
gradients of the parameters and of x set to None before each step; ``fwd``: forward under
``torch.no_grad``.

Timing (benches/timing.py, ``round_robin``; these GPUs' clocks drift by up to ~10 % within
seconds, ../shared/PEERS.md "Timing on these GPUs"): SonicMoE JIT-compiles and autotunes on
its first call per shape (minutes), so each row first runs one SonicMoE step on its own
(its wall seconds are reported as ``sonic_warm_s``); then the implementations of the row run
round-robin over ``--rounds`` rounds, the start rotating each round; a sample is CUDA events
around N back-to-back steps (N chosen per implementation so a sample lasts about
``--sample-ms``), each sample after the same GPU spin so the host has enqueued it. Reported:
the median per implementation, its spread (min-max over the rounds), and fused's speed over
each other implementation as a ratio of medians and round by round (min-max).

Memory: per implementation, one step after the timing, every gradient set to None first:
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus
``torch.cuda.memory_allocated()`` just before the step (the parameters of every
implementation, x and the output gradient): the peak bytes a step allocates, parameter
gradients included.

Check: each implementation's output, and after the memory step its gradients of x, the
router weight and the expert weights (SonicMoE's mapped back to groupmm's layout), as
relative Frobenius differences to fused's (``rel_diff``, ``grad_rel_diff``).

Outputs: a line per row as it finishes, then the table and the summary against issue 22's
targets (fused ≥ 1.0x SonicMoE's speed on every row, geomean ≥ 1.15x, peak memory ≤
SonicMoE's); --json and --md rewritten after every row (a run cut short keeps what ran),
--png at the end (matplotlib, optional). Each names the device, the torch and CUDA
versions, SonicMoE's, quack's and nvidia-cutlass-dsl's versions where importable and
groupmm's ``build_info()``. --from-json renders result files without a GPU (also the
files of this bench before round-robin timing); several, comma-separated, are merged into
one table (e.g. a table measured in two device commands), naming each command and any
difference in device or versions between them.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time

import groupmm
import groupmm.nn as gnn
import torch
import torch.nn.functional as F
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer, permute, unpermute
from timing import (  # benches/timing.py, same folder
    calls_for,
    gmean,
    lead_for,
    line_buffered_stdout,
    load_docs,
    no_figure_lines,
    paired,
    round_robin,
    rr_settings,
)
from timing import mark as _mark
from timing import spread_pct as _spread_pct
from timing import write_outputs as timing_write

# ----------------------------------------------------------------------------------------
# configs

#: name -> (d_model, d_ff, experts, top_k); profile_moe.py unpacks these four
CONFIGS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "dsv2-lite": (2048, 1408, 64, 6),
    "qwen3": (2048, 768, 128, 8),
    "dsv3-local": (7168, 2048, 32, 8),
    "mixtral": (4096, 14336, 8, 2),
    "glm45-air": (4096, 1408, 128, 8),
    # issue 28's fine-grained settings (narrow experts, wide top-k, long sequences: the
    # settings SonicMoE is benchmarked on)
    "fine-1536-256-e128-k8": (1536, 256, 128, 8),
    "fine-1536-512-e256-k16": (1536, 512, 256, 16),
    "fine-2048-256-e256-k16": (2048, 256, 256, 16),
    "fine-4096-512-e256-k8": (4096, 512, 256, 8),
    "fine-768-1024-e32-k2": (768, 1024, 32, 2),
}
MODELS = {
    "qwen3-30b-a3b": "Qwen3-30B-A3B",
    "olmoe": "OLMoE-1B-7B",
    "qwen3-235b-a22b": "Qwen3-235B-A22B",
    "gpt-oss-20b": "gpt-oss-20b-like SwiGLU",
    "dsv2-lite": "DeepSeek-V2-Lite routed experts",
    "qwen3": "Qwen3-30B-A3B-like (earlier runs' name)",
    "dsv3-local": "DeepSeek-V3, 32 of 256 experts",
    "mixtral": "Mixtral-8x7B-like",
    "glm45-air": "GLM-4.5-Air-like",
    "fine-1536-256-e128-k8": "fine-grained d 1536, F 256, E 128, k 8",
    "fine-1536-512-e256-k16": "fine-grained d 1536, F 512, E 256, k 16",
    "fine-2048-256-e256-k16": "fine-grained d 2048, F 256, E 256, k 16",
    "fine-4096-512-e256-k8": "fine-grained d 4096, F 512, E 256, k 8",
    "fine-768-1024-e32-k2": "d 768, F 1024, E 32, k 2",
    "tiny": "tiny",
}
GROUPS = {
    "issue22": ("qwen3-30b-a3b", "olmoe", "qwen3-235b-a22b", "gpt-oss-20b"),
    "extra": ("dsv2-lite",),
    "legacy": ("qwen3", "olmoe", "dsv3-local", "mixtral"),
    "fine": (
        "fine-1536-256-e128-k8",
        "fine-1536-512-e256-k16",
        "fine-2048-256-e256-k16",
        "fine-4096-512-e256-k8",
        "fine-768-1024-e32-k2",
    ),
}
# issue 28's table: issue 22's configs, DeepSeek-V2-Lite, GLM-4.5-Air and the fine-grained ones
GROUPS["issue28"] = GROUPS["issue22"] + GROUPS["extra"] + ("glm45-air",) + GROUPS["fine"]
# every distinct config once ("qwen3" has qwen3-30b-a3b's sizes)
GROUPS["all"] = GROUPS["issue28"] + ("dsv3-local", "mixtral")
TINY = {"tiny": (64, 32, 8, 2)}

ROUTINGS = ("router", "uniform", "skewed")
PASSES = ("fwd+bwd", "fwd")
#: the columns, in the order of the tables; fused is the reference of every ratio
IMPLS = ("fused", "groupmm", "torch-gmm", "plain", "sonicmoe")
LABELS = {
    "fused": "groupmm fused",
    "groupmm": "groupmm unfused",
    "torch-gmm": "torch-gmm",
    "plain": "plain",
    "sonicmoe": "SonicMoE",
}
#: issue 22's targets: fused's speed over SonicMoE (min, geomean), peak memory over SonicMoE's
TARGET_MIN, TARGET_GEOMEAN, TARGET_MEM = 1.0, 1.15, 1.0

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"

#: --dry-run's model of an H200 (PEERS.md): dense bf16 rate, the fraction of it a layer
#: step reaches, each implementation's time over fused's, and SonicMoE's warm-up (assumed)
EST_RATE, EST_EFF = 790e12, 0.4
EST_FACTOR = {"fused": 1.0, "groupmm": 1.05, "torch-gmm": 1.15, "plain": 1.5, "sonicmoe": 1.0}
EST_SONIC_FIRST_S, EST_SONIC_SHAPE_S = 300.0, 60.0


def select_configs(arg: str) -> list:
    """Config names from a comma list of names and groups, in CONFIGS order, each once."""
    want = set()
    for tok in (t.strip() for t in arg.split(",")):
        if not tok:
            continue
        if tok in GROUPS:
            want.update(GROUPS[tok])
        elif tok in CONFIGS:
            want.add(tok)
        else:
            raise SystemExit(
                f"unknown config {tok!r}; groups: {', '.join(GROUPS)}; "
                f"configs: {', '.join(CONFIGS)}"
            )
    return [c for c in CONFIGS if c in want]


def plan_rows(configs: dict, tokens, routings, passes) -> list:
    """The rows of a run, in the order they run: per config, per T, per routing, per pass."""
    rows = []
    for name, (d, f, E, k) in configs.items():
        for T in tokens:
            for routing in routings:
                for p in passes:
                    rows.append(
                        {
                            "config": name,
                            "model": MODELS.get(name, name),
                            "d_model": d,
                            "d_ff": f,
                            "experts": E,
                            "top_k": k,
                            "T": T,
                            "routing": routing,
                            "pass": p,
                        }
                    )
    return rows


def routing(T: int, E: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] fixed expert ids, each token's k distinct (``uniform`` or ``skewed``)."""
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


# ----------------------------------------------------------------------------------------
# the implementations


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


class _TorchGmm:
    """Context: GroupedExperts' grouped products on F.grouped_mm (the autograd graph a
    forward records inside keeps F.grouped_mm for the backward)."""

    def __enter__(self):
        self.saved = gnn.grouped_mm
        gnn.grouped_mm = lambda a, b, offs=None: F.grouped_mm(a, b, offs=offs)

    def __exit__(self, *exc):
        gnn.grouped_mm = self.saved


def torch_gmm_forward(layer: MoELayer, x, ids=None):
    with _TorchGmm():
        return moe_forward(layer, x, ids)


# ----------------------------------------------------------------------------------------
# SonicMoE


def _dist_version(dists, module: str):
    """The version of the first of ``dists`` with package metadata here; else the module's
    ``__version__``; "unknown (no package metadata)" for a module that imports without
    either (a source copy on PYTHONPATH); None when it is not installed."""
    from importlib.metadata import version

    for dist in dists:
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - no metadata under that name
            pass
    try:
        import importlib

        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not importable: not installed here
        return None
    return getattr(mod, "__version__", None) or "unknown (no package metadata)"


def peer_versions() -> dict:
    """SonicMoE's stack as installed here (None for what is missing)."""
    return {
        "sonic-moe": _dist_version(("sonic-moe", "sonicmoe"), "sonicmoe"),
        "quack-kernels": _dist_version(("quack-kernels",), "quack"),
        "nvidia-cutlass-dsl": _dist_version(("nvidia-cutlass-dsl",), "cutlass"),
    }


def load_sonic():
    """``({"layer": moe_TC_softmax_topk_layer, "ActivationType": ...}, None)`` or
    ``(None, why)`` (the import error, first line)."""
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_TC_softmax_topk_layer
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        lines = str(e).strip().splitlines() or [""]
        return None, f"{type(e).__name__}: {lines[0][:160]}"
    return {"layer": moe_TC_softmax_topk_layer, "ActivationType": ActivationType}, None


def sonic_weights(layer: MoELayer) -> tuple:
    """Copies of ``layer``'s weights in SonicMoE's layout, as new leaf tensors:
    ``router_w`` ``[E, d]`` (the gate's ``nn.Linear`` weight), ``w1`` ``(E, 2F, d)`` with
    rows ``[gate; up]`` (``w_in`` is ``[E, d, 2F]``, columns ``[gate | up]``) and ``w2``
    ``(E, d, F)`` (``w_out`` is ``[E, F, d]``), each contiguous, so that ``w.permute(1, 2,
    0)`` has the stride order (2, 0, 1) SonicMoE documents."""
    with torch.no_grad():
        router_w = layer.router.gate.weight.detach().clone()
        w1 = layer.experts.w_in.detach().transpose(1, 2).contiguous()
        w2 = layer.experts.w_out.detach().transpose(1, 2).contiguous()
    return tuple(t.requires_grad_() for t in (router_w, w1, w2))


def sonic_args(w1, w2) -> tuple:
    """The expert weights as SonicMoE's layer takes them: ``(2F, d, E)`` and ``(d, F, E)``."""
    return w1.permute(1, 2, 0), w2.permute(1, 2, 0)


def to_groupmm_layout(w1, w2) -> tuple:
    """SonicMoE's ``w1`` ``(E, 2F, d)`` and ``w2`` ``(E, d, F)`` (or their gradients) as
    groupmm's ``w_in`` ``[E, d, 2F]`` and ``w_out`` ``[E, F, d]`` (views)."""
    return w1.transpose(1, 2), w2.transpose(1, 2)


def sonic_forward(S: dict, x, router_w, w1, w2, k: int):
    """One SonicMoE layer forward, called as PEERS.md shows (Qwen3 routing)."""
    w1p, w2p = sonic_args(w1, w2)
    o, _logits, _freq = S["layer"](
        x,
        router_w,
        w1p,
        None,
        w2p,
        None,
        k,
        torch.cuda.current_stream().cuda_stream,
        S["ActivationType"].SWIGLU,
        False,
        is_softmax_over_topk=False,
        norm_topk_probs=True,
        concat_layout=True,
    )
    return o


def sonic_layout_reference(x, router_w, w1p, w2p, k: int):
    """The layer the tensors handed to SonicMoE define, in plain torch ops (a loop over
    experts): logits ``x @ router_wᵀ``; softmax over all experts (float32 or wider), top-k,
    renormalised; for expert e, ``h = x @ w1p[:, :, e]ᵀ``, ``gate, up = h.chunk(2)``
    (``concat_layout=True``), ``y = (silu(gate) * up) @ w2p[:, :, e]ᵀ``; the output is the
    weighted sum of each token's k rows. ``w1p`` ``(2F, d, E)``, ``w2p`` ``(d, F, E)``."""
    logits = F.linear(x, router_w)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
    top, ids = probs.topk(k, dim=-1)
    top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(router_w.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (x[tok] @ w1p[:, :, e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2p[:, :, e].T
        out = out.index_add(0, tok, y * top[tok, slot].unsqueeze(-1))
    return out


# ----------------------------------------------------------------------------------------
# rows, summaries and rendering: pure functions of numbers (CPU-tested)


def fmt(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def make_row(base: dict, timed: dict, peaks=None, diffs=None, grad_diffs=None, errors=None):
    """One result row. ``timed``: implementation -> ``round_robin`` result (any may be
    missing or failed); ``peaks``: implementation -> peak bytes; ``diffs`` /
    ``grad_diffs``: relative differences to fused's output / gradients; ``errors``:
    implementation -> why it has no figure (merged with round_robin's errors)."""
    peaks, diffs, grad_diffs = peaks or {}, diffs or {}, grad_diffs or {}
    ms = {k: (timed.get(k) or {}).get("ms") for k in IMPLS}
    ok = [k for k in IMPLS if ms[k]]
    row = dict(base)
    row["ms"] = ms
    row["spread_ms"] = {k: {q: timed[k][q] for q in ("min", "q1", "q3", "max")} for k in ok}
    row["samples_ms"] = {k: timed[k]["samples"] for k in ok}
    row["calls"] = {k: timed[k]["calls"] for k in ok}
    row["host_ms"] = {k: timed[k]["host_ms"] for k in ok}
    row["peak_bytes"] = {k: peaks.get(k) for k in IMPLS}
    row["rel_diff"] = dict(diffs)
    row["grad_rel_diff"] = dict(grad_diffs)
    row.update(ratios(row))
    g = row["samples_ms"].get("fused")
    row["paired"] = {k: paired(g, row["samples_ms"].get(k)) for k in IMPLS if k != "fused"}
    errs = {k: v for k, v in (errors or {}).items() if v}
    for k in IMPLS:
        if timed.get(k) and timed[k].get("error"):
            errs.setdefault(k, timed[k]["error"])
    row["errors"] = errs
    return row


def ratios(row: dict) -> dict:
    """fused's speed over each other implementation (their time over fused's: > 1 favours
    fused) and fused's peak memory over theirs (< 1: fused takes less)."""
    ms, pk = row.get("ms", {}), row.get("peak_bytes", {})
    f, pf = ms.get("fused"), pk.get("fused")
    speed = {k: (ms[k] / f if f and ms.get(k) else None) for k in IMPLS if k != "fused"}
    mem = {k: (pf / pk[k] if pf and pk.get(k) else None) for k in IMPLS if k != "fused"}
    return {"speed": speed, "mem": mem}


def label(row: dict) -> str:
    return f"{row['config']} T={row['T']} {row['routing']} {row['pass']}"


def summarize(rows) -> dict:
    """Over the fwd+bwd rows: fused's speed over SonicMoE, torch-gmm and plain (count,
    geomean, min and the row holding it, max), fused's memory over SonicMoE's (max and the
    rows above 1), and issue 22's three targets, each met, not met or not measured."""
    rs = [r for r in rows if r.get("pass", "fwd+bwd") == "fwd+bwd"]
    out = {"rows": len(rs), "speed": {}, "mem": {}, "targets": []}
    for k in ("sonicmoe", "torch-gmm", "plain", "groupmm"):
        vals = [(r["speed"][k], r) for r in rs if (r.get("speed") or {}).get(k)]
        if vals:
            lo = min(vals, key=lambda p: p[0])
            out["speed"][k] = {
                "n": len(vals),
                "geomean": gmean([v for v, _ in vals]),
                "min": lo[0],
                "min_row": label(lo[1]),
                "max": max(v for v, _ in vals),
            }
        mvals = [(r["mem"][k], r) for r in rs if (r.get("mem") or {}).get(k)]
        if mvals:
            out["mem"][k] = {
                "n": len(mvals),
                "max": max(v for v, _ in mvals),
                "over": [label(r) for v, r in mvals if v > TARGET_MEM],
            }
    sp, mm = out["speed"].get("sonicmoe"), out["mem"].get("sonicmoe")
    for what, thr, val, at_least in (
        ("speed vs SonicMoE, every row", TARGET_MIN, sp and sp["min"], True),
        ("speed vs SonicMoE, geomean", TARGET_GEOMEAN, sp and sp["geomean"], True),
        ("peak memory / SonicMoE's, every row", TARGET_MEM, mm and mm["max"], False),
    ):
        met = None if val is None else (val >= thr if at_least else val <= thr)
        out["targets"].append({"what": what, "target": thr, "value": val, "met": met})
    return out


def summary_lines(rows) -> list:
    s = summarize(rows)
    lines = []
    for k, lab in (("sonicmoe", "SonicMoE"), ("torch-gmm", "torch-gmm"), ("plain", "plain")):
        st = s["speed"].get(k)
        if st:
            lines.append(
                f"fused speed / {lab}: geomean {st['geomean']:.2f}, min {st['min']:.2f} "
                f"({st['min_row']}), max {st['max']:.2f} over {st['n']} fwd+bwd rows"
            )
    m = s["mem"].get("sonicmoe")
    if m:
        over = f"; above SonicMoE's: {', '.join(m['over'])}" if m["over"] else ""
        lines.append(f"peak memory fused / SonicMoE: max {m['max']:.2f}{over}")
    lines.append(
        "issue 22 targets: "
        + "; ".join(
            f"{t['what']} {'≤' if t['what'].startswith('peak') else '≥'} {t['target']:.2f}: "
            f"{fmt(t['value'])} {_mark(t['met'])}"
            for t in s["targets"]
        )
    )
    return lines


def _mib(v):
    return "-" if v is None else f"{v / 2**20:.0f}"


def format_row(row: dict) -> str:
    """One progress line: ms per implementation (± half the min-max range over the
    rounds, in % of the median), fused's speed over each, peak MiB, SonicMoE's output
    difference to fused's."""

    def cell(k):
        sp = _spread_pct(row, k)
        return fmt(row["ms"].get(k), ".3f") + (f"±{sp / 2:.1f}%" if sp is not None else "")

    sp = row.get("speed") or {}
    pk = row.get("peak_bytes") or {}
    d = (row.get("rel_diff") or {}).get("sonicmoe")
    return (
        f"{row['config']:15} {row['T']:6} {row['routing']:7} {row['pass']:7} | ms "
        + " ".join(f"{k} {cell(k)}" for k in IMPLS)
        + " | fused speed / "
        + " ".join(f"{k} {fmt(sp.get(k))}" for k in IMPLS if k != "fused")
        + " | peak MiB "
        + " ".join(f"{k} {_mib(pk.get(k))}" for k in IMPLS)
        + (f" | sonic out diff {d:.1e}" if d is not None else "")
    )


def describe_env(doc: dict) -> list:
    """Lines naming the device, versions and timer of a result document."""
    gm = doc.get("groupmm") or {}
    gm_s = ", ".join(f"{k} {v}" for k, v in gm.items()) if isinstance(gm, dict) else str(gm)
    ver = doc.get("versions") or {}
    stack = ", ".join(f"{k} {v or 'absent'}" for k, v in ver.items()) or "versions not recorded"
    if doc.get("sonicmoe"):
        sonic = f"SonicMoE measured ({stack})"
    else:
        sonic = f"SonicMoE not measured: {doc.get('sonicmoe_why') or 'not in this run'} ({stack})"
    lines = [
        f"device {doc.get('device')}; torch {doc.get('torch')}, "
        f"CUDA {doc.get('cuda') or '(not recorded)'}; {doc.get('dtype')}",
        sonic,
        f"groupmm build_info: {gm_s or 'not recorded'}",
    ]
    tm = doc.get("timer")
    if tm:
        per = f"{tm['calls']} steps" if tm.get("calls") else f"~{tm['sample_ms']:g} ms"
        lines.append(
            f"timer: round-robin over {tm['rounds']} rounds, {per} per sample, medians, "
            "spread min-max; SonicMoE warmed up (JIT compile, autotune) with one step per "
            "row before timing"
        )
    elif doc.get("legacy"):
        lines.append("timer: CUDA events per step, steps back to back, median (no interleaving)")
    return lines


def check_lines(rows) -> list:
    """Per implementation, the largest relative difference of its output and of its
    gradients to fused's over the rows, and where."""
    lines = []
    for k in IMPLS[1:]:
        out = [(r["rel_diff"][k], label(r)) for r in rows if (r.get("rel_diff") or {}).get(k)]
        grad = [
            (v, f"{label(r)}, d{name}")
            for r in rows
            for name, v in ((r.get("grad_rel_diff") or {}).get(k) or {}).items()
            if v is not None
        ]
        if out or grad:
            parts = []
            for what, best in (("output", out), ("gradients", grad)):
                if best:
                    v, where = max(best)
                    parts.append(f"{what} at most {v:.1e} ({where})")
            lines.append(f"{LABELS[k]} vs groupmm fused, relative difference: " + "; ".join(parts))
    return lines


def render_md(doc: dict) -> str:
    """The result document as markdown: environment, command, summary, one table row per
    result row (ms: median, and the min-max over the rounds in %; ratios: fused's speed
    over the others, ratio of medians and the range of the round-by-round ratios; bold
    where issue 22's target fails)."""
    env = describe_env(doc)
    out = ["**" + env[0] + "**", ""] + [ln + "  " for ln in env[1:]]
    if commands(doc):
        out += ["", "```bash", *commands(doc), "```"]
    if doc.get("merged_differ"):
        out += ["", f"*(merged runs differ in: {', '.join(doc['merged_differ'])})*"]
    if not doc.get("complete", True):
        out += ["", "*(incomplete run: the rows measured so far)*"]
    rows = doc.get("rows", [])
    out += [""] + [ln + "  " for ln in summary_lines(rows)]

    def ms_cell(r, k):
        v, sp = r["ms"].get(k), _spread_pct(r, k)
        if v is None:
            return "-"
        return f"{v:.2f}" + (f" ±{sp / 2:.1f}%" if sp is not None else "")

    def ratio_cell(r, k, target=None):
        v = (r.get("speed") or {}).get(k)
        if v is None:
            return "-"
        p = (r.get("paired") or {}).get(k)
        s = f"{v:.2f}"
        if target is not None and v < target and r["pass"] == "fwd+bwd":
            s = f"**{s}**"
        return s + (f" ({p['min']:.2f}–{p['max']:.2f})" if p else "")

    def host_cell(r):
        # the host's time per fused step (issue 28: below the GPU time, so that the GPU
        # never waits for the host); bold where it is not
        h, g = (r.get("host_ms") or {}).get("fused"), r["ms"].get("fused")
        if h is None:
            return "-"
        return f"**{h:.2f}**" if g is not None and h >= g else f"{h:.2f}"

    def mem_cell(r):
        pk = r.get("peak_bytes") or {}
        s = f"{_mib(pk.get('fused'))} / {_mib(pk.get('sonicmoe'))}"
        m = (r.get("mem") or {}).get("sonicmoe")
        return f"**{s}**" if m is not None and m > TARGET_MEM and r["pass"] == "fwd+bwd" else s

    out += [
        "",
        "| config (d, d_ff, E, k) | T | routing | pass | groupmm fused ms | fused host ms "
        "| groupmm unfused ms | torch-gmm ms | plain ms | SonicMoE ms | fused speed / SonicMoE "
        "| / torch-gmm | / plain | peak MiB fused / SonicMoE "
        "| peak MiB unfused / torch-gmm / plain |",
        "| --- | ---: | --- | --- |" + " ---: |" * 11,
    ]
    for r in rows:
        pk = r.get("peak_bytes") or {}
        cells = [
            f"{r['config']} ({r['d_model']}, {r['d_ff']}, {r['experts']}, {r['top_k']})",
            str(r["T"]),
            r["routing"],
            r["pass"],
            ms_cell(r, IMPLS[0]),
            host_cell(r),
            *(ms_cell(r, k) for k in IMPLS[1:]),
            ratio_cell(r, "sonicmoe", TARGET_MIN),
            ratio_cell(r, "torch-gmm"),
            ratio_cell(r, "plain"),
            mem_cell(r),
            " / ".join(_mib(pk.get(k)) for k in ("groupmm", "torch-gmm", "plain")),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += no_figure_lines(rows, label, LABELS.__getitem__)
    checks = check_lines(rows)
    if checks:
        out += [""] + [ln + "  " for ln in checks]
    if doc.get("skipped"):
        out += ["", "skipped: " + "; ".join(f"{s['row']} ({s['why']})" for s in doc["skipped"])]
    return "\n".join(out) + "\n"


def render_png(doc: dict, path: str) -> bool:
    """ms per row and implementation (bars, min-max whiskers) over peak MiB; False when
    matplotlib is missing or there are no rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc.get("rows", [])
    if not rows:
        return False
    impls = [k for k in IMPLS if any(r["ms"].get(k) for r in rows)]
    if not impls:
        return False
    n = len(rows)
    xs = list(range(n))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(8, 1.3 * n), 8), sharex=True)
    w = 0.8 / len(impls)
    for i, k in enumerate(impls):
        vals, lo, hi, mib = [], [], [], []
        for r in rows:
            v = r["ms"].get(k) or 0.0
            sp = (r.get("spread_ms") or {}).get(k)
            vals.append(v)
            lo.append(v - sp["min"] if sp and v else 0.0)
            hi.append(sp["max"] - v if sp and v else 0.0)
            mib.append(((r.get("peak_bytes") or {}).get(k) or 0) / 2**20)
        pos = [x + (i - (len(impls) - 1) / 2) * w for x in xs]
        ax.bar(pos, vals, w, yerr=[lo, hi], error_kw={"elinewidth": 0.6}, label=LABELS[k])
        ax2.bar(pos, mib, w, label=LABELS[k])
    ax.set_ylabel("ms per step (median, min-max)")
    ax2.set_ylabel("peak MiB above inputs")
    ax.legend(fontsize=8)
    title = describe_env(doc)[:2]
    title += commands(doc)
    ax.set_title("\n".join(ln[:150] for ln in title), fontsize=8)
    ax2.set_xticks(xs)
    ax2.set_xticklabels(
        [f"{r['config']}\nT={r['T']} {r['routing']}\n{r['pass']}" for r in rows], fontsize=7
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def commands(doc: dict) -> list:
    """The command line of each run a document holds."""
    runs = doc.get("runs") or ([doc["argv"]] if doc.get("argv") is not None else [])
    return [" ".join(["python3 benches/bench_moe.py", *argv]) for argv in runs]


#: what must agree between runs merged into one table
ENV_KEYS = ("device", "torch", "cuda", "dtype", "groupmm", "sonicmoe", "versions", "timer")


def merge_docs(docs: list) -> dict:
    """Several result documents (e.g. one per device command) as one: rows in order,
    the command of each run, skipped rows that no other run measured, and the keys of
    ENV_KEYS that differ between the runs (``merged_differ``)."""
    if len(docs) == 1:
        return docs[0]
    out = dict(docs[0])
    out["runs"] = [argv for d in docs for argv in (d.get("runs") or [d.get("argv") or []])]
    out.pop("argv", None)
    out["rows"] = [r for d in docs for r in d.get("rows", [])]
    done = {label(r) for r in out["rows"]}
    out["skipped"] = [s for d in docs for s in d.get("skipped", []) if s["row"] not in done]
    out["complete"] = all(d.get("complete", True) for d in docs)
    out["merged_differ"] = [k for k in ENV_KEYS if any(d.get(k) != out.get(k) for d in docs)]
    out["summary"] = summarize(out["rows"])
    return out


def upgrade_legacy(doc: dict) -> dict:
    """A result file of this bench before round-robin timing (rows with ``"<impl> fwd+bwd
    ms"`` keys) as a document of the current form: one fwd+bwd and one fwd row each."""
    if doc.get("schema"):
        return doc
    rows = []
    for old in doc.get("rows", []):
        for p in PASSES:
            r = {k: old[k] for k in ("config", "d_model", "d_ff", "experts", "top_k", "T")}
            r["routing"] = old.get("routing", "uniform")
            r["pass"] = p
            r["ms"] = {k: old.get(f"{k} {p} ms") for k in IMPLS}
            r["peak_bytes"] = {
                k: old.get(f"{k} peak bytes") if p == "fwd+bwd" else None for k in IMPLS
            }
            r["rel_diff"] = old.get("rel_diff") or {}
            r.update(ratios(r))
            rows.append(r)
    return {
        "schema": "moe-legacy",
        "legacy": True,
        "device": doc.get("device"),
        "torch": doc.get("torch"),
        "dtype": str(doc.get("dtype", "")).replace("torch.", ""),
        "sonicmoe": False,
        "sonicmoe_why": "not in this bench then",
        "rows": rows,
    }


# ----------------------------------------------------------------------------------------
# the plan's estimate (--dry-run; no GPU)


def step_flops(row: dict) -> float:
    """FLOPs of one fwd+bwd (or fwd) step of the experts: 2·T·k·d·3F forward (up 2F,
    down F), three times that with the backward."""
    fwd = 2.0 * row["T"] * row["top_k"] * row["d_model"] * 3 * row["d_ff"]
    return fwd * (3.0 if row["pass"] == "fwd+bwd" else 1.0)


def estimate_s(plan, args, sonic: bool) -> dict:
    """A rough wall-time estimate of a plan on an H200: every implementation's warm-up,
    samples and check steps at EST_EFF of the dense rate (scaled by EST_FACTOR), a second
    of host work per row, and SonicMoE's warm-up at the assumed EST_SONIC_FIRST_S for the
    first row and EST_SONIC_SHAPE_S for every other. A budget check, not a measurement."""
    gpu, warm, host = 0.0, 0.0, 0.0
    impls = [k for k in IMPLS if sonic or k != "sonicmoe"]
    for row in plan:
        t_f = step_flops(row) / (EST_EFF * EST_RATE) * 1e3  # ms
        ms = {k: t_f * EST_FACTOR[k] for k in impls}
        if row["routing"] != "router":
            ms.pop("sonicmoe", None)
        calls = {
            k: args.calls or calls_for(v, args.sample_ms, args.min_calls, args.max_calls)
            for k, v in ms.items()
        }
        lead = max(lead_for(2.0, v, calls[k]) for k, v in ms.items())  # ~2 ms host per step
        for k, v in ms.items():
            # warm-up, round_robin's host/GPU estimate (4 steps), output check, memory step
            gpu += (args.warmup + 6) * v + args.rounds * (calls[k] * v + lead)
        if "sonicmoe" in ms:
            warm += EST_SONIC_FIRST_S if warm == 0.0 else EST_SONIC_SHAPE_S
        host += 1.0
    total = gpu / 1e3 + warm + host + (15.0 if sonic else 0.0)  # + SonicMoE's import
    return {
        "rows": len(plan),
        "gpu_s": gpu / 1e3,
        "sonic_warm_s": warm,
        "host_s": host,
        "total_s": total,
    }


# ----------------------------------------------------------------------------------------
# GPU


#: elements of one slice of rel_diff (float32 copies of at most this many)
_CHUNK = 1 << 24


def rel_diff(a, b):
    """Relative Frobenius difference ``|a - b| / |b|`` in float32, a slice of dim 0 at a
    time (the expert-weight gradients are GBs); None when either is missing."""
    if a is None or b is None:
        return None
    num = den = 0.0
    step = max(1, _CHUNK // max(1, b[0].numel())) if b.dim() > 1 else b.numel()
    for i in range(0, b.shape[0], step):
        sa, sb = a[i : i + step].float(), b[i : i + step].float()
        num += float((sa - sb).square().sum())
        den += float(sb.square().sum())
    return math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


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
    if hasattr(F, "grouped_mm"):
        fwd["torch-gmm"] = lambda x: torch_gmm_forward(layer, x, ids)
        fwd["plain"] = lambda x: plain(x, ids)
    else:
        for name in ("torch-gmm", "plain"):
            errors[name] = f"no F.grouped_mm in torch {torch.__version__}"
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
    ids = None
    if plan_row["routing"] != "router":
        gen = torch.Generator().manual_seed(T + E)
        ids = routing(T, E, k, plan_row["routing"], gen).to(dev)
    torch.manual_seed(T)
    x = torch.randn(T, d, device=dev, dtype=dtype).requires_grad_()
    gy = torch.randn(T, d, device=dev, dtype=dtype)
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
            errors["sonicmoe"] = f"{type(e).__name__}: {str(e).strip()[:160]}"
            del steps["sonicmoe"], fwd["sonicmoe"]
        sonic_warm_s = time.perf_counter() - t0
        print(f"   SonicMoE warm-up took {sonic_warm_s:.1f} s")
    diffs, outs = {}, {}
    for name, fn in list(fwd.items()):
        try:
            with torch.no_grad():
                outs[name] = fn(x)
        except Exception as e:  # noqa: BLE001 - e.g. no sm90 F.grouped_mm for this dtype
            errors[name] = f"{type(e).__name__}: {str(e).strip()[:160]}"
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


# ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--configs",
        default="issue22",
        help="comma list of config names and groups: issue22 (default), issue28, fine, extra, "
        "legacy, all",
    )
    p.add_argument("--tokens", default="4096,16384", help="comma list of T (tokens)")
    p.add_argument("--routing", default="router", help="router (default), uniform, skewed")
    p.add_argument("--passes", default="fwd+bwd", help="fwd+bwd (default), fwd")
    p.add_argument("--tiny", action="store_true", help="one tiny config, T = 64 (a smoke run)")
    p.add_argument("--rounds", type=int, default=10, help="round-robin rounds per row")
    p.add_argument("--sample-ms", type=float, default=25.0, help="target GPU ms of a sample")
    p.add_argument("--calls", type=int, help="fixed back-to-back steps per sample")
    p.add_argument("--reps", type=int, help="old name of --calls")
    p.add_argument("--min-calls", type=int, default=2)
    p.add_argument("--max-calls", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="steps before timing, per row")
    p.add_argument("--no-sonic", action="store_true", help="leave SonicMoE out even if installed")
    p.add_argument(
        "--budget-s", type=float, default=0, help="start no new row after this many seconds"
    )
    p.add_argument("--json", help="results, rewritten after every row")
    p.add_argument("--md", help="the table in markdown, rewritten after every row")
    p.add_argument("--png", help="a chart of the run (needs matplotlib)")
    p.add_argument("--dry-run", action="store_true", help="print the rows and an estimate")
    p.add_argument(
        "--from-json",
        help="render result files (comma list: merged into one table; --md, --png, and --json "
        "for the merged file); no GPU",
    )
    p.add_argument("--replot", help="old name of --from-json")
    args = p.parse_args(argv)
    if args.calls is None:
        args.calls = args.reps
    args.from_json = args.from_json or args.replot
    if min(args.rounds, args.min_calls, args.max_calls, args.warmup) < 1:
        p.error("rounds, calls and warmup must be at least 1")
    for lst, ok in ((args.routing, ROUTINGS), (args.passes, PASSES)):
        bad = [v for v in lst.split(",") if v not in ok]
        if bad:
            p.error(f"unknown {bad}; choose from {', '.join(ok)}")
    return args


def write_outputs(doc: dict, args) -> None:
    """JSON and markdown of the result document (timing.write_outputs)."""
    timing_write(doc, args.json, args.md, render_md)


def print_table(doc) -> None:
    print()
    for ln in describe_env(doc):
        print(ln)
    for r in doc.get("rows", []):
        print(format_row(r))
    for ln in summary_lines(doc.get("rows", [])):
        print(ln)


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        docs = load_docs(args.from_json, upgrade_legacy)
        doc = merge_docs(docs)
        print_table(doc)
        if args.json and len(docs) > 1:
            write_outputs(doc, argparse.Namespace(json=args.json, md=None))
        if args.md:
            with open(args.md, "w") as fh:
                fh.write(render_md(doc))
        if args.png and not render_png(doc, args.png):
            print("no chart (matplotlib missing, or no rows)")
        return 0

    configs = TINY if args.tiny else {c: CONFIGS[c] for c in select_configs(args.configs)}
    tokens = [64] if args.tiny else [int(t) for t in args.tokens.split(",")]
    plan = plan_rows(configs, tokens, args.routing.split(","), args.passes.split(","))
    if args.dry_run:
        for r in plan:
            print(
                f"{r['config']:15} T={r['T']:<6} {r['routing']:7} {r['pass']:7} "
                f"d={r['d_model']:<5} d_ff={r['d_ff']:<5} E={r['experts']:<3} k={r['top_k']} "
                f"rows/expert {r['T'] * r['top_k'] / r['experts']:7.1f}  "
                f"{step_flops(r) / 1e12:6.2f} TFLOP/step  {r['model']}"
            )
        est = estimate_s(plan, args, sonic=not args.no_sonic)
        sonic = ""
        if est["sonic_warm_s"]:
            sonic = (
                f", SonicMoE warm-ups ~{est['sonic_warm_s']:.0f} s (assumed "
                f"{EST_SONIC_FIRST_S:.0f} s for the first row, {EST_SONIC_SHAPE_S:.0f} s per "
                "later row: JIT compile and autotune, cached on disk afterwards)"
            )
        print(
            f"{est['rows']} rows over {len(configs)} configs; estimated wall on an H200 "
            f"~{est['total_s']:.0f} s (timed steps ~{est['gpu_s']:.0f} s{sonic}, host "
            f"~{est['host_s']:.0f} s; a rough model, not a measurement)"
        )
        return 0

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--dry-run or --from-json work on the CPU)")
        return 2
    t_start = time.perf_counter()
    dev = torch.device(DEV)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    S, why = (None, "--no-sonic") if args.no_sonic else load_sonic()
    doc = {
        "schema": "moe-2",
        "complete": False,
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": str(dtype).replace("torch.", ""),
        "groupmm": groupmm.build_info(),
        "sonicmoe": S is not None,
        "sonicmoe_why": why,
        "versions": peer_versions(),
        "timer": {**rr_settings(args), "sonic_warmup": "one step per row before timing"},
        "rows": [],
        "skipped": [],
    }
    for ln in describe_env(doc):
        print(ln)
    n_rows = len(plan)
    done = 0
    for cname, (d, f, E, k) in configs.items():
        mine = [r for r in plan if r["config"] == cname]
        el = time.perf_counter() - t_start
        if args.budget_s and el > args.budget_s:
            why_skip = f"--budget-s {args.budget_s:g} spent"
            doc["skipped"] += [{"row": label(r), "why": why_skip} for r in mine]
            print(f"skip {cname}: budget of {args.budget_s:g} s spent")
            continue
        print(f"== {cname}: d={d} d_ff={f} E={E} k={k} ({MODELS.get(cname, cname)})")
        torch.manual_seed(0)
        layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype)
        sonic_w = sonic_weights(layer) if S is not None else None  # copied once, untimed
        for r in mine:
            el = time.perf_counter() - t_start
            if args.budget_s and el > args.budget_s:
                doc["skipped"].append(
                    {"row": label(r), "why": f"--budget-s {args.budget_s:g} spent"}
                )
                print(f"skip {label(r)}: budget spent")
                continue
            try:
                row = run_row(r, layer, S, sonic_w, why, args, dev, dtype)
            except torch.cuda.OutOfMemoryError as e:
                doc["skipped"].append({"row": label(r), "why": f"out of memory: {str(e)[:80]}"})
                print(f"skip {label(r)}: out of memory")
                continue
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            done += 1
            doc["rows"].append(row)
            doc["elapsed_s"] = time.perf_counter() - t_start
            doc["summary"] = summarize(doc["rows"])
            write_outputs(doc, args)  # after every row: a run cut short keeps what ran
            print(f"[{done:3}/{n_rows} {doc['elapsed_s']:5.0f}s] " + format_row(row))
            for who, err in row["errors"].items():
                print(f"      {who}: {err}")
        del layer, sonic_w
    doc["complete"] = True
    doc["elapsed_s"] = time.perf_counter() - t_start
    doc["summary"] = summarize(doc["rows"])
    write_outputs(doc, args)
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    if args.png and not render_png(doc, args.png):
        print("no chart (matplotlib missing, or no rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
