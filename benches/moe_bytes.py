"""The routed-row byte budget of one MoE layer step (profile_moe.py, ``--bytes-only``;
analytic, no GPU): the bytes of the routed rows (tensors of R = T*k rows) that one
forward+backward step reads and writes, pass by pass, for groupmm's fused block and for
SonicMoE, from the config and T alone.

A pass is (phase, name, reads, writes), each of reads and writes a tuple of (tensor,
shape) with a symbolic shape (DIMS): ("R", "D") is R rows of D elements. Only tensors
whose first dimension is R count (``shape_bytes``); token-order [T, ·] tensors and
weights are listed at 0 so that each pass reads whole. Index vectors (src, inverse, offs)
and per-row scalars (the router-weight scale, its gradient's partial sums: 4 bytes a row)
are not listed. The fused table (:func:`fused_passes`) MUST follow groupmm/fused.py's
forward and backward; update it when fused.py changes.
"""

from __future__ import annotations

from groupmm import fused as _fused  # _slabs: the dW_in slabs the byte budget counts
from moe_configs import CONFIGS  # benches/moe_configs.py, same folder
from moe_report import LABELS  # benches/moe_report.py, same folder
from report import fmt  # benches/report.py, same folder

#: the symbols of a shape and what each stands for (``dims``)
DIMS = ("R", "T", "k", "D", "F", "2F", "E")

_RD, _RF, _R2F, _TD, _TK = ("R", "D"), ("R", "F"), ("R", "2F"), ("T", "D"), ("T", "k")
_W_IN, _W_OUT = ("E", "D", "2F"), ("E", "F", "D")


def fused_passes(gather_x_in_gemm: bool = True, dy_in_gemm: bool = True, slabs: int = 1) -> tuple:
    """groupmm's fused block (``groupmm.fused.expert_block``) as passes over the routed
    rows, forward then backward, in the order they run: a tuple of (phase, pass, reads,
    writes).

    This table MUST follow groupmm/fused.py's forward and backward; update it when
    fused.py changes. The defaults are the default path on Hopper (16-bit): every GEMM
    over routed rows reads them through ``src`` (``gather_x_in_gemm``: the up projection
    and dW_in read ``x``'s rows, dW_in in one product; ``dy_in_gemm``: the dgated and dW_out
    GEMMs read ``d_out``'s, no ``dy``). Both off is the gather-first path
    (``GROUPMM_SM90_GATHER=0``, other GPUs): ``x``'s rows gathered into a copy ``xs``
    before the up projection, ``dy = d_out[src]`` copied once for the dgated and dW_out
    GEMMs, and ``x``'s rows gathered again for dW_in, one column slab at a time (``slabs``
    of them: ``groupmm.fused._slabs``, two where D >= 128, one below; each slab's GEMM
    reads all of ``d_pre``)."""
    gx, gy = gather_x_in_gemm, dy_in_gemm
    # the tensors: (name, symbolic shape)
    x_src, xs = ("x[src]", _RD), ("xs", _RD)
    x_rows = ("x[src] (in the GEMM)", _RD) if gx else xs  # what the x-side GEMMs read
    d_src, dy = ("d_out[src]", _RD), ("dy", _RD)
    dy_rows = ("d_out[src] (in the GEMM)", _RD) if gy else dy  # what the dy-side GEMMs read
    pre, act, y, out = ("pre", _R2F), ("act", _RF), ("y", _RD), ("out", _TD)
    d_pre, act_s, dxr, dx = ("d_pre", _R2F), ("act_s", _RF), ("dx rows", _RD), ("dx", _TD)
    w_in, w_out, weights = ("w_in", _W_IN), ("w_out", _W_OUT), ("weights", _TK)
    dw_in, dw_out = ("dw_in", _W_IN), ("dw_out", _W_OUT)
    # dW_in reads d_pre once per slab of x's columns
    d_pres = (
        tuple((f"d_pre (slab {i})", _R2F) for i in range(1, slabs + 1)) if slabs > 1 else (d_pre,)
    )
    in_slabs = f" in {slabs} column slabs" if slabs > 1 else ""
    # fmt: off
    table = (
        # (phase, pass, reads, writes); None where a switch removes the pass
        None if gx else
        ("fwd", "gather x[src] (row kernel)",           (x_src,),                (xs,)),
        ("fwd", "up projection + SwiGLU GEMM",          (x_rows, w_in),          (pre, act)),
        ("fwd", "down projection GEMM",                 (act, w_out),            (y,)),
        ("fwd", "combine (weighted sum over k)",        (y, weights),            (out,)),
        None if gy else
        ("bwd", "gather dy = d_out[src] (row kernel)",  (d_src,),                (dy,)),
        ("bwd", "dgated GEMM (d_pre over pre)",         (dy_rows, pre, w_out),   (d_pre, act_s)),
        ("bwd", "dW_out GEMM",                          (act_s, dy_rows),        (dw_out,)),
        ("bwd", "dX GEMM",                              (d_pre, w_in),           (dxr,)),
        ("bwd", "sum over k (row kernel)",              (dxr,),                  (dx,)),
        None if gx else
        ("bwd", f"gather x[src]{in_slabs} (row kernel)", (x_src,),               (xs,)),
        ("bwd", f"dW_in GEMM{in_slabs}",                (x_rows, *d_pres),       (dw_in,)),
    )
    # fmt: on
    return tuple(p for p in table if p is not None)


def _sonicmoe_passes() -> tuple:
    x_src, d_src = ("x[src] (in the GEMM)", _RD), ("d_out[src] (in the GEMM)", _RD)
    h, a, y, out = ("h", _R2F), ("a", _RF), ("y", _RD), ("out", _TD)
    dh, a_s, dxr, dx = ("dh", _R2F), ("a'", _RF), ("dx rows", _RD), ("dx", _TD)
    w1, w2, weights = ("w1", _W_IN), ("w2", _W_OUT), ("weights", _TK)
    dw1, dw2 = ("dw1", _W_IN), ("dw2", _W_OUT)
    # fmt: off
    return (
        ("fwd", "up projection + SwiGLU GEMM, x gathered",  (x_src, w1),      (h, a)),
        ("fwd", "down projection GEMM",                     (a, w2),          (y,)),
        ("fwd", "combine (weighted sum over k)",            (y, weights),     (out,)),
        ("bwd", "dgated GEMM, dO gathered",                 (d_src, h, w2),   (dh, a_s)),
        ("bwd", "dW2 GEMM, dO gathered",                    (a_s, d_src),     (dw2,)),
        ("bwd", "dX GEMM",                                  (dh, w1),         (dxr,)),
        ("bwd", "sum over k",                               (dxr,),           (dx,)),
        ("bwd", "dW1 GEMM, x gathered",                     (x_src, dh),      (dw1,)),
    )


#: SonicMoE's layer as passes over the routed rows (phase, pass, reads, writes), from its
#: design: its GEMMs read the rows of x and of the output gradient dO through the routing
#: index (no gathered copies); h/dh [R, 2F] are its pre-activation and its gradient, a
#: the activation, a' the activation scaled by the router weight
SONICMOE_PASSES = _sonicmoe_passes()


#: element bytes of the dtypes a result file names (``doc["dtype"]``)
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def dims(d: int, f: int, experts: int, k: int, tokens: int) -> dict:
    """What each symbol of DIMS stands for at a config ``(d, f, experts, k)`` and T."""
    return {"R": tokens * k, "T": tokens, "k": k, "D": d, "F": f, "2F": 2 * f, "E": experts}


def shape_bytes(shape: tuple, sizes: dict, es: int) -> int:
    """The bytes a tensor of symbolic ``shape`` counts: its size times ``es`` when its
    rows are the routed rows (first symbol "R"), else 0."""
    if shape[0] != "R":
        return 0
    n = es
    for s in shape:
        n *= sizes[s]
    return n


def pass_bytes(passes, config: tuple, tokens: int, es: int = 2) -> dict:
    """A pass table multiplied out at ``config = (d, f, experts, k)``, T = ``tokens`` and
    ``es`` bytes an element: ``{"fwd", "bwd"}`` bytes read + written per phase and
    ``"passes"``: per pass its phase, name, ``read_bytes``, ``write_bytes`` and each
    tensor (``{"tensor", "shape", "bytes"}``)."""
    sizes = dims(*config, tokens)
    out = {"fwd": 0, "bwd": 0, "passes": []}
    for phase, name, reads, writes in passes:
        entry = {"phase": phase, "pass": name}
        for key, tensors in (("read", reads), ("write", writes)):
            ts = [
                {"tensor": t, "shape": " x ".join(s), "bytes": shape_bytes(s, sizes, es)}
                for t, s in tensors
            ]
            entry[key + "_bytes"] = sum(t["bytes"] for t in ts)
            entry[key + "s"] = ts
        out[phase] += entry["read_bytes"] + entry["write_bytes"]
        out["passes"].append(entry)
    return out


def byte_budget(
    config: tuple,
    tokens: int,
    es: int = 2,
    gather_x_in_gemm: bool = True,
    dy_in_gemm: bool = True,
) -> dict:
    """The routed-row bytes of one step, ``{"fused": .., "sonicmoe": ..}`` (each
    ``pass_bytes``), with the element size, R and the fused table's switches (and its
    dW_in slabs where x's rows are gathered first, as ``groupmm.fused`` splits D)."""
    slabs = 1 if gather_x_in_gemm else len(_fused._slabs(config[0]))
    fused = fused_passes(gather_x_in_gemm, dy_in_gemm, slabs)
    return {
        "element_bytes": es,
        "R": tokens * config[3],
        "fused_switches": {"gather_x_in_gemm": gather_x_in_gemm, "dy_in_gemm": dy_in_gemm},
        "fused": pass_bytes(fused, config, tokens, es),
        "sonicmoe": pass_bytes(SONICMOE_PASSES, config, tokens, es),
    }


def gib(n: int) -> float:
    return n / 2**30


def budget_totals(budget) -> tuple:
    """``(fused fwd, fused bwd, SonicMoE fwd, SonicMoE bwd, fused/SonicMoE)``: GiB and the
    ratio of the totals; all None without a budget."""
    if budget is None:
        return (None,) * 5
    fz, sn = budget["fused"], budget["sonicmoe"]
    ratio = (fz["fwd"] + fz["bwd"]) / (sn["fwd"] + sn["bwd"])
    return gib(fz["fwd"]), gib(fz["bwd"]), gib(sn["fwd"]), gib(sn["bwd"]), ratio


def doc_budget(doc: dict, config: str, tokens: int, *rows):
    """The byte budget of a (config, tokens): the first of ``rows`` that has one (a
    result file's ``"bytes"``), else computed from the config (element size from the
    file's dtype, bf16 if it names none; the fused switches it records), else None (a
    config this file's bench_moe does not know)."""
    for r in rows:
        if r and r.get("bytes"):
            return r["bytes"]
    if config not in CONFIGS:
        return None
    es = ELEMENT_BYTES.get(doc.get("dtype") or "bfloat16", 2)
    # a file that records no switches predates them: the rows were gathered first
    sw = doc.get("bytes_switches") or {"gather_x_in_gemm": False, "dy_in_gemm": False}
    return byte_budget(CONFIGS[config], tokens, es, **sw)


def _tensor_cell(tensors) -> str:
    return ", ".join(f"{t['tensor']} [{t['shape'].replace(' x ', ', ')}]" for t in tensors)


def bytes_pass_table(config: str, tokens: int, budget: dict) -> list:
    """The markdown lines of one (config, tokens)'s byte budget per pass, both
    implementations, with each phase's totals."""
    R, es = budget["R"], budget["element_bytes"]
    sw = [k for k, on in budget.get("fused_switches", {}).items() if on]
    lines = [
        f"### Byte budget per pass: {config} T={tokens} (R = {R} routed rows, {es} bytes an "
        f"element{'; fused with ' + ', '.join(sw) if sw else ''})",
        "",
        "| impl | phase | pass | reads | writes | read GiB | written GiB |",
        "| --- | --- | --- | --- | --- | ---: | ---: |",
    ]
    for impl in ("fused", "sonicmoe"):
        b = budget[impl]
        label = LABELS.get(impl, impl)
        for i, p in enumerate(b["passes"], 1):
            lines.append(
                f"| {label} | {p['phase']} | {i}. {p['pass']} | {_tensor_cell(p['reads'])} | "
                f"{_tensor_cell(p['writes'])} | {gib(p['read_bytes']):.3f} | "
                f"{gib(p['write_bytes']):.3f} |"
            )
        for phase in ("fwd", "bwd"):
            ps = [p for p in b["passes"] if p["phase"] == phase]
            rd = gib(sum(p["read_bytes"] for p in ps))
            wr = gib(sum(p["write_bytes"] for p in ps))
            lines.append(
                f"| {label} | {phase} | **total {gib(b[phase]):.3f} GiB** |  |  | "
                f"{rd:.3f} | {wr:.3f} |"
            )
    lines += [
        "",
        "Only tensors of R rows count; [T, ·] tensors and weights are listed at 0. The "
        "tables: `fused_passes` and `SONICMOE_PASSES` in benches/moe_bytes.py.",
    ]
    return lines


def bytes_line(config: str, tokens: int, budget) -> str | None:
    """``config T=.. routed-row bytes: fused a + b GiB, SonicMoE c + d GiB (fwd + bwd),
    fused/SonicMoE r``; None without a budget."""
    if budget is None:
        return None
    ff, fb, sf, sb, ratio = budget_totals(budget)
    return (
        f"{config} T={tokens} routed-row bytes (fwd + bwd): fused {ff:.3f} + {fb:.3f} GiB, "
        f"SonicMoE {sf:.3f} + {sb:.3f} GiB, fused/SonicMoE {ratio:.2f}"
    )


def bytes_detail_lines(budgets, every: bool) -> list:
    """The per-pass tables of the first ``(config, tokens, budget)`` that has a budget, or
    of every one (``every``), each after an empty line."""
    out = []
    for config, tokens, budget in budgets:
        if budget is None:
            continue
        out += ["", *bytes_pass_table(config, tokens, budget)]
        if not every:
            break
    return out


def render_bytes_md(budgets, bytes_detail: bool = False) -> str:
    """``--bytes-only``'s markdown: per ``(config, tokens, budget)`` the routed-row bytes
    of both implementations, then the per-pass tables (the first row's, or every row's)."""
    out = [
        "# Routed-row byte budget of one forward+backward step (analytic)",
        "",
        "| config | T | R | fused R-GiB fwd | fused R-GiB bwd | SonicMoE R-GiB fwd "
        "| SonicMoE R-GiB bwd | R-bytes fused/SonicMoE |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config, tokens, budget in budgets:
        *gibs, ratio = budget_totals(budget)
        R = budget["R"] if budget else None
        cells = [
            config,
            str(tokens),
            fmt(R, "d"),
            *(fmt(v, ".3f") for v in gibs),
            fmt(ratio, ".2f"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    out += bytes_detail_lines(budgets, bytes_detail)
    return "\n".join(out) + "\n"
