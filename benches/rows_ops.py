"""bench_rows.py's ops and shapes: what each row op moves (:func:`op_bytes`, the one
definition of the bytes), what a row allocates, the shapes of a run (:func:`plan_rows`),
the routing indices (:func:`routing_indices`), each op as groupmm runs it and as torch
would (:func:`build_op`) and the check of one against the other (:func:`check`).
bench_rows.py's docstring states each of these in words.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from groupmm._glue import routes
from groupmm._rows import gather_sum, scatter_rows
from harness.report import rel_diff

OPS = ("combine", "sum", "gather", "scatter")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
#: relative Frobenius error allowed between groupmm's and torch's combine / sum
TOL = {"bf16": 1e-2, "fp16": 1e-3, "fp32": 1e-5}
#: ops whose groupmm output must equal torch's exactly
EXACT = ("gather", "scatter")

DIMS = (768, 2048, 4096, 7168)
TOPK = (1, 2, 4, 8, 16)
TOKENS = (256, 4096, 16384, 65536)
#: fp16 and fp32 run this subset unless --dims / --topk / --tokens are given
SUBSET = {"dims": (2048, 7168), "topk": (1, 8), "tokens": (4096, 65536)}
#: --quick: (dtype, T, D, k): Qwen3-30B-A3B-like (D 2048, k 8) from a decode batch (T 256)
#: to T 65536, Qwen3-235B (4096, 8), DeepSeek-V3 (7168, 8), Mixtral (4096, 2), k = 16 at
#: D 768, k = 1 (a permutation gather), and fp16, fp32 at one shape
QUICK = (
    ("bf16", 256, 2048, 8),
    ("bf16", 4096, 2048, 8),
    ("bf16", 16384, 2048, 8),
    ("bf16", 65536, 2048, 8),
    ("bf16", 16384, 4096, 8),
    ("bf16", 4096, 7168, 8),
    ("bf16", 16384, 4096, 2),
    ("bf16", 16384, 768, 16),
    ("bf16", 65536, 4096, 1),
    ("fp16", 16384, 2048, 8),
    ("fp32", 16384, 2048, 8),
)
IDX_BYTES = 4  # int32 indices
W_BYTES = 4  # float32 weights


def num_experts(k: int) -> int:
    """E of the routing: 128, or k when k exceeds it."""
    return max(k, 128)


def op_bytes(op: str, T: int, D: int, k: int, es: int) -> int:
    """The minimum bytes ``op`` must move for T tokens, D columns, top-k k, element size
    es (bench_rows.py's docstring states it): every op reads T rows and writes R rows or
    the reverse, each once, and reads the int32 index [R] once; combine also the float32
    weights [R]. Scratch and re-reads of an implementation do not count."""
    R = T * k
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    return (R + T) * D * es + R * IDX_BYTES + (R * W_BYTES if op == "combine" else 0)


def largest_bytes(T: int, D: int, k: int, es: int) -> int:
    """The largest tensor of a shape: the [R, D] routed rows (every op reads or writes
    them; [T, D] is never larger)."""
    return max(T * k, T) * D * es


def alloc_bytes(op: str, T: int, D: int, k: int, es: int) -> int:
    """What a row allocates at most, an upper bound for the free-memory check: the op's
    inputs and int32 indices, groupmm's and torch's outputs, torch's temporaries (float32
    where it computes in float32) and the two copy buffers."""
    R = T * k
    rows, toks = R * D * es, T * D * es
    idx = 2 * R * IDX_BYTES  # src and inverse
    copy = 2 * (op_bytes(op, T, D, k, es) // 2)
    if op == "combine":  # y, w; out; index_select, .float(), the product, the f32 sum, out
        need = rows + R * W_BYTES + toks + rows + 2 * R * D * 4 + T * D * 4 + toks
    elif op == "sum":  # y; out; index_select, the f32 sum, out
        need = rows + toks + rows + T * D * 4 + toks
    elif op == "gather":  # x; out; torch's out
        need = toks + rows + rows
    elif op == "scatter":  # grad; out and scratch; repeat_interleave, torch's out
        need = toks + rows + R * IDX_BYTES + rows + rows
    else:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    return need + idx + copy


def plan_rows(
    ops=OPS,
    dtypes=("bf16", "fp16", "fp32"),
    dims=None,
    topk=None,
    tokens=None,
    max_gib: float = 3.0,
    quick: bool = False,
) -> tuple:
    """``(rows, skipped)``: the rows of a run in the order they run (per dtype, T, k, D,
    op) and the shapes left out, ``{"row", "why"}``, because their largest tensor exceeds
    ``max_gib`` GiB. ``dims``, ``topk``, ``tokens`` None: the defaults (bf16 all of DIMS,
    TOPK, TOKENS, fp16 and fp32 SUBSET); given, they apply to every dtype. ``quick``: the
    QUICK shapes of ``dtypes`` instead."""
    shapes = []
    for dt in dtypes:
        if quick:
            shapes += [(d, T, D, k) for d, T, D, k in QUICK if d == dt]
            continue
        sub = dt != "bf16"
        ds = dims or (SUBSET["dims"] if sub else DIMS)
        ks = topk or (SUBSET["topk"] if sub else TOPK)
        ts = tokens or (SUBSET["tokens"] if sub else TOKENS)
        shapes += [(dt, T, D, k) for T in ts for k in ks for D in ds]
    rows, skipped = [], []
    limit = max_gib * 2**30
    for dt, T, D, k in shapes:
        es = ELEMENT_SIZE[dt]
        big = largest_bytes(T, D, k, es)
        if big > limit:
            skipped.append(
                {
                    "row": f"{dt} T={T} D={D} k={k}",
                    "why": f"[R, D] is {big / 2**30:.2f} GiB > --max-gib {max_gib:g}",
                }
            )
            continue
        for op in ops:
            rows.append(
                {
                    "op": op,
                    "dtype": dt,
                    "T": T,
                    "D": D,
                    "k": k,
                    "R": T * k,
                    "E": num_experts(k),
                    "bytes": op_bytes(op, T, D, k, es),
                    "largest_bytes": big,
                    "alloc_bytes": alloc_bytes(op, T, D, k, es),
                }
            )
    return rows, skipped


def label(row: dict) -> str:
    return f"{row['op']} {row['dtype']} T={row['T']} D={row['D']} k={row['k']}"


def key(row: dict) -> tuple:
    return (row["op"], row["dtype"], row["T"], row["D"], row["k"])


class Indices(NamedTuple):
    """The index side of one (T, k): int32 ``src`` [R] and ``inverse`` [T, k], the
    ``expert_ids`` [T, k] they come from, and E."""

    src: torch.Tensor
    inverse: torch.Tensor
    expert_ids: torch.Tensor
    num_experts: int


def routing_indices(T: int, k: int, seed: int = 0, device="cpu") -> Indices:
    """Uniform routing: each token's k distinct experts out of E = max(k, 128) (the k
    largest of E uniform draws: a uniformly random k-subset, from a generator seeded with
    ``seed``), then ``groupmm._glue.routes`` (a stable sort by expert) on ``device``; src
    and inverse as int32."""
    E = num_experts(k)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices.to(device)
    r = routes(ids, E)
    return Indices(r.src.to(torch.int32), r.inverse.to(torch.int32), ids, E)


def torch_combine(y, inverse, w):
    T, k = inverse.shape
    rows = y.index_select(0, inverse.reshape(-1)).view(T, k, y.shape[1])
    return (rows.float() * w.unsqueeze(-1)).sum(1).to(y.dtype)


def torch_sum(y, inverse):
    T, k = inverse.shape
    rows = y.index_select(0, inverse.reshape(-1)).view(T, k, y.shape[1])
    return rows.sum(1, dtype=torch.float32).to(y.dtype)


def torch_gather(x, src):
    return x.index_select(0, src)


def torch_scatter(grad, inverse, rows: int):
    out = torch.zeros(rows, grad.shape[1], device=grad.device, dtype=grad.dtype)
    return out.index_add_(0, inverse.reshape(-1), grad.repeat_interleave(inverse.shape[1], 0))


def build_op(op: str, T: int, D: int, k: int, dtype, idx: Indices, dev, seed: int = 0):
    """``(groupmm_fn, torch_fn)`` of one row on fresh random inputs (``torch.randn`` rows,
    ``torch.rand`` weights normalised per token), every index and view made here, outside
    the timed calls."""
    torch.manual_seed(seed + 7 * T + 131 * D + k)
    R, inv = T * k, idx.inverse
    if op in ("combine", "sum"):
        y = torch.randn(R, D, device=dev, dtype=dtype)
        if op == "sum":
            return (lambda: gather_sum(y, inv, None)), (lambda: torch_sum(y, inv))
        w = torch.rand(T, k, device=dev, dtype=torch.float32) + 0.05
        w = w / w.sum(-1, keepdim=True)
        return (lambda: gather_sum(y, inv, w)), (lambda: torch_combine(y, inv, w))
    x = torch.randn(T, D, device=dev, dtype=dtype)
    if op == "gather":
        src, src_col = idx.src, idx.src.view(-1, 1)
        return (lambda: gather_sum(x, src_col, None)), (lambda: torch_gather(x, src))
    if op == "scatter":
        return (lambda: scatter_rows(x, inv, None, R)), (lambda: torch_scatter(x, inv, R))
    raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")


def check(op: str, dtype: str, got, want) -> dict:
    """``{"ok", "err", "how"}``: groupmm's output ``got`` against torch's ``want``."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return {
            "ok": False,
            "err": None,
            "how": f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} "
            f"{want.dtype}",
        }
    if op in EXACT:
        same = torch.equal(got, want)
        return {"ok": same, "err": 0.0 if same else rel_diff(got, want), "how": "exact"}
    err = rel_diff(got, want)
    return {"ok": err < TOL[dtype], "err": err, "how": f"rel err < {TOL[dtype]:g}"}
