"""groupmm.parallel: expert parallelism against one process, and expert_compute.

- :func:`~groupmm.parallel.expert_compute` (one process, no collectives) against an
  independent float64 reference (a per-expert loop of ``@`` in torch): ``counts`` or
  ``offs``, with and without a gather index and per-row weights, padding rows past
  ``offs[-1]``, empty experts, gradcheck, errors.
- ``torch.distributed`` of world size 1 in this process (gloo; NCCL on a GPU): the sharded
  layer and :func:`~groupmm.parallel.expert_parallel_block` equal the plain layer and
  :func:`~groupmm.fused.expert_block`; on the GPU, one host sync per forward, none in the
  backward.
- 2 and 4 ranks: ``tests/programs/ep_check.py`` under ``torch.distributed.run`` (gloo on
  the CPU in float64; NCCL with one GPU per rank in bf16), one launch per world size
  running every case (routing random and skewed, a rank with no tokens, uneven token
  counts, top-k 1 to 3, fused and unfused layers with padding, biases and other
  activations, EP over sub-groups, the functional block, an id out of range on one rank).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import F64, assert_close_rel, grad_or_zeros
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer
from groupmm.parallel import expert_compute, expert_parallel_block

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "programs" / "ep_check.py"
GLOO = dist.is_available() and dist.is_gloo_available()
BF16 = torch.bfloat16
ONE_OF = r"counts, offs, expert_ids: expected exactly one"


# --------------------------------------------------------------------------- expert_compute


def _reference(rows, w_in, w_out, counts, index=None, weights=None):
    """Independent float64 reference of expert_compute: the rows in expert order
    (``rows[index]``), expert ``e`` on its ``counts[e]`` positions in turn (``x @ w``,
    SwiGLU, ``@ w_out``), zeros past them, back in ``rows``' order, times the weights.
    Differentiable in its tensor inputs (torch ops only)."""
    rows, w_in, w_out = rows.to(F64), w_in.to(F64), w_out.to(F64)
    n, fh = rows.shape[0], w_out.shape[1]
    ordered = rows if index is None else rows[index.long()]
    parts, start = [], 0
    for e, c in enumerate(int(c) for c in counts):
        pre = ordered[start : start + c] @ w_in[e]
        parts.append((F.silu(pre[:, :fh]) * pre[:, fh:]) @ w_out[e])
        start += c
    parts.append(rows.new_zeros(n - start, w_out.shape[2]))  # padding positions
    out = torch.cat(parts)
    if index is not None:  # position p holds rows[index[p]]: row i is at argsort(index)[i]
        out = out[torch.argsort(index.long())]
    if weights is not None:
        out = out * weights.to(F64).reshape(n, 1)
    return out


def _compute_case(R=11, D=5, Fh=3, counts=(2, 0, 4, 3), seed=0, device="cpu", dtype=F64):
    """``(rows, w_in, w_out, counts, perm, weights)``; ``sum(counts) < R`` leaves padding."""
    gen = torch.Generator().manual_seed(seed)
    E = len(counts)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(device, dtype)

    rows = rnd(R, D)
    w_in = rnd(E, D, 2 * Fh, scale=D**-0.5)
    w_out = rnd(E, Fh, D, scale=Fh**-0.5)
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    perm = torch.randperm(R, generator=gen).to(device)
    weights = (torch.rand(R, generator=gen, dtype=F64) + 0.5).to(device, dtype)
    return rows, w_in, w_out, c, perm, weights


def _grads(out, inputs, go):
    """Gradients of ``(out * go).sum()`` w.r.t. ``inputs`` (zeros where unused)."""
    gs = torch.autograd.grad(out, inputs, go, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, inputs)]


@pytest.mark.parametrize("groups", ["counts", "counts-int32", "offs"])
@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("weighting", [None, "[R]", "[R, 1]"])
def test_expert_compute_equals_reference(groups, indexed, weighting):
    rows, w_in, w_out, counts, perm, weights = _compute_case(seed=1)
    R = rows.shape[0]
    index = perm if indexed else None
    w = None if weighting is None else weights if weighting == "[R]" else weights.view(R, 1)
    if groups == "counts":
        spec = {"counts": counts}
    elif groups == "counts-int32":
        spec = {"counts": counts.to(torch.int32)}
    else:
        spec = {"offs": counts.cumsum(0).to(torch.int32)}
    ins = [t.clone().requires_grad_() for t in (rows, w_in, w_out)]
    wt = None if w is None else w.clone().requires_grad_()
    out = expert_compute(*ins, **spec, index=index, weights=wt)
    refs = [t.clone().requires_grad_() for t in (rows, w_in, w_out)]
    w_ref = None if w is None else w.clone().requires_grad_()
    ref = _reference(*refs, counts, index, w_ref)
    assert out.shape == rows.shape and out.dtype == rows.dtype
    assert_close_rel(out, ref, F64, "out")
    go = torch.randn(rows.shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    got = _grads(out, ins + ([wt] if wt is not None else []), go)
    want = _grads(ref, refs + ([w_ref] if w_ref is not None else []), go)
    for name, g, r in zip(["rows", "w_in", "w_out", "weights"], got, want):
        assert g.shape == r.shape, name
        assert_close_rel(g, r, F64, f"grad {name}")


@pytest.mark.parametrize("indexed", [False, True])
def test_expert_compute_padding_rows_are_zero_with_zero_gradients(indexed):
    """Positions past offs[-1] (here 4 of 13) give zero output rows, and those rows and
    their weights get zero gradients; the other rows do not."""
    rows, w_in, w_out, counts, perm, weights = _compute_case(R=13, counts=(3, 1, 0, 5), seed=2)
    index = perm if indexed else None
    x = rows.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    out = expert_compute(x, w_in, w_out, counts=counts, index=index, weights=w)
    out.backward(torch.randn_like(out))
    total = int(counts.sum())
    padded = torch.arange(total, rows.shape[0])  # positions past offs[-1]
    if index is not None:
        padded = index[padded]  # the rows those positions hold
    used = torch.ones(rows.shape[0], dtype=torch.bool)
    used[padded] = False
    assert padded.numel() == 4
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    assert torch.equal(x.grad[padded], torch.zeros_like(x.grad[padded]))
    assert torch.equal(w.grad[padded], torch.zeros_like(w.grad[padded]))
    assert (out[used].abs().sum(1) > 0).all()
    assert (x.grad[used].abs().sum(1) > 0).all() and (w.grad[used] != 0).all()


@pytest.mark.parametrize(
    "counts", [(0, 3, 0, 0, 4, 0), (0, 0, 0), (7,), (0, 0, 5)], ids=["gaps", "none", "one", "last"]
)
def test_expert_compute_empty_experts(counts):
    """Experts with no rows (leading, inner, trailing, all of them): values and weight
    gradients (zero for the empty experts) equal the reference."""
    R = max(sum(counts), 1) + 1
    rows, w_in, w_out, c, perm, weights = _compute_case(R=R, counts=counts, seed=3)
    ins = [t.clone().requires_grad_() for t in (rows, w_in, w_out)]
    out = expert_compute(*ins, counts=c, index=perm, weights=weights)
    refs = [t.clone().requires_grad_() for t in (rows, w_in, w_out)]
    ref = _reference(*refs, c, perm, weights)
    assert_close_rel(out, ref, F64, "out")
    go = torch.randn_like(out)
    got = _grads(out, ins, go)
    for name, g, r in zip(["rows", "w_in", "w_out"], got, _grads(ref, refs, go)):
        assert_close_rel(g, r, F64, f"grad {name}")
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert torch.count_nonzero(got[1][empty]) == 0 and torch.count_nonzero(got[2][empty]) == 0


def test_expert_compute_counts_and_offs_agree_bitwise():
    rows, w_in, w_out, counts, perm, weights = _compute_case(seed=4)
    a = expert_compute(rows, w_in, w_out, counts=counts, index=perm, weights=weights)
    offs = counts.cumsum(0).to(torch.int32)
    b = expert_compute(rows, w_in, w_out, offs=offs, index=perm, weights=weights)
    assert torch.equal(a, b)


def test_expert_compute_no_rows():
    rows, w_in, w_out, counts, _, _ = _compute_case(R=0, counts=(0, 0, 0), seed=5)
    x = rows.clone().requires_grad_()
    out = expert_compute(x, w_in, w_out, counts=counts, weights=rows.new_zeros(0))
    assert out.shape == (0, rows.shape[1])
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, rows.shape[1])


def test_expert_compute_gradcheck():
    """float64 gradcheck (rows, both weights, router weights) with a gather index, an
    empty expert and a padding row."""
    rows, w_in, w_out, counts, perm, weights = _compute_case(
        R=6, D=3, Fh=2, counts=(2, 0, 3), seed=6
    )

    def f(rows, w_in, w_out, weights):
        return expert_compute(rows, w_in, w_out, counts=counts, index=perm, weights=weights)

    inputs = [t.clone().requires_grad_() for t in (rows, w_in, w_out, weights)]
    assert torch.autograd.gradcheck(f, inputs)


def _error_cases():
    """``(id, kwargs changes, exception, message start)``: each error names its argument."""
    R = 11
    return [
        ("neither", {"counts": None}, ValueError, ONE_OF),
        ("both", {"offs": "offs"}, ValueError, ONE_OF),
        ("rows-1d", {"rows": "rows[0]"}, ValueError, r"rows: expected shape \[R, D\]"),
        ("counts-2d", {"counts": "counts[None]"}, ValueError, r"counts: expected shape \[E\]"),
        ("counts-float", {"counts": "counts.double()"}, TypeError, r"counts: expected an integer"),
        (
            "counts-length",
            {"counts": "counts[:3]"},
            ValueError,
            r"w_in: expected shape \[E=3, D=5, 2F\] \(E = len\(counts\), D = rows.shape\[1\]\)",
        ),
        (
            "offs-length",
            {"counts": None, "offs": "offs[:3]"},
            ValueError,
            r"w_in: expected shape \[E=3, D=5, 2F\] \(E = len\(offs\), D = rows.shape\[1\]\)",
        ),
        (
            "offs-2d",
            {"counts": None, "offs": "offs[None]"},
            ValueError,
            r"offs: expected shape \[E\]",
        ),
        ("index-length", {"index": "perm[:-1]"}, ValueError, rf"index: expected shape \[R={R}\]"),
        ("index-2d", {"index": "perm[None]"}, ValueError, r"index: expected shape \[R\]"),
        ("index-float", {"index": "perm.double()"}, TypeError, r"index: expected an integer"),
        (
            "weights-width",
            {"weights": "weights2"},
            ValueError,
            rf"weights: expected shape \[R={R}\]",
        ),
        (
            "weights-length",
            {"weights": "weights[:-1]"},
            ValueError,
            rf"weights: expected shape \[R={R}\]",
        ),
        ("weights-list", {"weights": "[1.0]"}, TypeError, r"weights: expected a torch.Tensor"),
        ("w_in-1d", {"w_in": "w_in[0, 0]"}, ValueError, r"w_in: expected shape \[E, D, 2F\]"),
        ("w_in-odd", {"w_in": "w_in[..., :5]"}, ValueError, r"w_in: expected an even"),
        (
            "w_in-width",
            {"w_in": "w_in[:, :4]"},
            ValueError,
            r"w_in: expected shape \[E=4, D=5, 2F\]",
        ),
        (
            "w_in-experts",
            {"w_in": "w_in[:3]"},
            ValueError,
            r"w_in: expected shape \[E=4, D=5, 2F\]",
        ),
        (
            "w_out-hidden",
            {"w_out": "w_out[:, :2]"},
            ValueError,
            r"w_out: expected shape \[E=4, F=3, D=5\]",
        ),
        (
            "w_out-experts",
            {"w_out": "w_out[:3]"},
            ValueError,
            r"w_out: expected shape \[E=4, F=3, D=5\]",
        ),
        ("w_out-2d", {"w_out": "w_out[0]"}, ValueError, r"w_out: expected shape \[E, F, D\]"),
        (
            "w_in-dtype",
            {"w_in": "w_in.float()"},
            TypeError,
            r"w_in: expected dtype torch.float64 \(the dtype of rows\)",
        ),
        (
            "w_out-dtype",
            {"w_out": "w_out.float()"},
            TypeError,
            r"w_out: expected dtype torch.float64 \(the dtype of rows\)",
        ),
        (
            "counts-device",
            {"counts": "counts.to('meta')"},
            RuntimeError,
            r"counts: expected a tensor on cpu",
        ),
        (
            "offs-device",
            {"counts": None, "offs": "offs.to('meta')"},
            RuntimeError,
            r"offs: expected a tensor on cpu",
        ),
        (
            "index-device",
            {"index": "perm.to('meta')"},
            RuntimeError,
            r"index: expected a tensor on cpu",
        ),
        (
            "weights-device",
            {"weights": "weights.to('meta')"},
            RuntimeError,
            r"weights: expected a tensor on cpu",
        ),
        (
            "w_in-device",
            {"w_in": "w_in.to('meta')"},
            RuntimeError,
            r"w_in: expected a tensor on cpu",
        ),
        (
            "w_out-device",
            {"w_out": "w_out.to('meta')"},
            RuntimeError,
            r"w_out: expected a tensor on cpu",
        ),
    ]


@pytest.mark.parametrize(
    "changes,exc,message", [c[1:] for c in _error_cases()], ids=[c[0] for c in _error_cases()]
)
def test_expert_compute_errors_name_the_argument(changes, exc, message):
    rows, w_in, w_out, counts, perm, weights = _compute_case(seed=8)
    env = {
        "rows": rows,
        "w_in": w_in,
        "w_out": w_out,
        "counts": counts,
        "offs": counts.cumsum(0).to(torch.int32),
        "perm": perm,
        "weights": weights,
        "weights2": weights[:, None].expand(-1, 2),
    }
    args = {"rows": rows, "w_in": w_in, "w_out": w_out, "counts": counts, "offs": None}
    args.update({k: None if v is None else eval(v, {}, env) for k, v in changes.items()})
    with pytest.raises(exc, match="^" + message):
        expert_compute(args.pop("rows"), args.pop("w_in"), args.pop("w_out"), **args)


# ------------------------------------------------------------------ one process, world size 1


@contextlib.contextmanager
def _world_of_one(backend: str) -> Iterator[None]:
    """A default process group of world size 1 in this process, destroyed after."""
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _layer_grads(layer: MoELayer, x: torch.Tensor, go: torch.Tensor) -> Dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = layer(x)
    (out * go).sum().backward()
    got = {"out": out.detach(), "x": x.grad}
    got.update({n: grad_or_zeros(p) for n, p in layer.named_parameters()})
    return got


@pytest.mark.skipif(not GLOO, reason="needs gloo")
@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=2),
        dict(top_k=1),
        dict(top_k=2, fused=False),
        dict(top_k=3, fused=False, activation="gelu", bias=True, pad_to=4),
    ],
    ids=["fused-k2", "fused-k1", "unfused-k2", "unfused-gelu-bias-pad4"],
)
def test_sharded_layer_world_of_one_equals_layer(kw):
    """gloo, world size 1: MoELayer.sharded() holds every expert and computes what the
    plain layer does (values and every gradient, float64)."""
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 4, aux_loss_coef=0.0, dtype=F64, **kw)
    x = torch.randn(13, 16, dtype=F64)
    go = torch.randn(13, 16, dtype=F64)
    with _world_of_one("gloo"):
        ep = layer.sharded()
        assert ep.ep_group is not None and ep.experts.num_experts == 4
        assert ep.fused == layer.fused
        got = _layer_grads(ep, x, go)
        with pytest.raises(ValueError, match="^ep_group: this layer's experts are sharded already"):
            ep.sharded()
    want = _layer_grads(layer, x, go)
    assert got.keys() == want.keys()
    for name in want:
        assert_close_rel(got[name], want[name], F64, name)


@pytest.mark.skipif(not GLOO, reason="needs gloo")
@pytest.mark.parametrize("weighted", [True, False])
def test_expert_parallel_block_world_of_one_equals_expert_block(weighted):
    gen = torch.Generator().manual_seed(9)
    T, D, Fh, E, k = 9, 6, 4, 4, 2
    x = torch.randn(T, D, generator=gen, dtype=F64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids[ids == 2] = 1  # expert 2 empty (and a token may take expert 1 twice)
    w_in = torch.randn(E, D, 2 * Fh, generator=gen, dtype=F64)
    w_out = torch.randn(E, Fh, D, generator=gen, dtype=F64)
    weights = torch.rand(T, k, generator=gen, dtype=F64) if weighted else None
    go = torch.randn(T, D, generator=gen, dtype=F64)
    tensors = [t for t in (x, w_in, w_out, weights) if t is not None]

    def run(f):
        ins = [t.clone().requires_grad_() for t in tensors]
        out = f(*ins)
        return [out, *_grads(out, ins, go)]

    def block(x, w_in, w_out, weights=None):
        r = routes(ids, E)
        return expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)

    with _world_of_one("gloo"):
        got = run(lambda x, w_in, w_out, w=None: expert_parallel_block(x, ids, w, w_in, w_out))
    for name, a, b in zip(["out", "x", "w_in", "w_out", "weights"], got, run(block)):
        assert_close_rel(a, b, F64, name)


@pytest.mark.skipif(not GLOO, reason="needs gloo")
@pytest.mark.parametrize("form", ["block", "fused-layer", "unfused-layer"])
def test_expert_parallel_double_backward_raises(form):
    """The exchanges' backward is a collective outside autograd: a double backward raises
    (it used to leave their second-order terms out, silently: 1e4 off a float64
    reference in gradgradcheck)."""
    gen = torch.Generator().manual_seed(11)
    T, D, Fh, E = 5, 4, 2, 4
    x = torch.randn(T, D, generator=gen, dtype=F64, requires_grad=True)
    with _world_of_one("gloo"):
        if form == "block":
            ids = torch.randint(0, E, (T, 2), generator=gen)
            w_in = torch.randn(E, D, 2 * Fh, generator=gen, dtype=F64, requires_grad=True)
            w_out = torch.randn(E, Fh, D, generator=gen, dtype=F64, requires_grad=True)
            out = expert_parallel_block(x, ids, None, w_in, w_out)
        else:
            torch.manual_seed(0)
            layer = MoELayer(D, Fh, E, 2, dtype=F64, fused=form == "fused-layer")
            out = layer.sharded()(x)
        (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            gx.square().sum().backward()


@pytest.mark.skipif(not GLOO, reason="needs gloo")
def test_expert_parallel_block_errors_name_the_argument():
    """Local argument errors (raised before any collective) and an id out of range."""
    T, D, Fh, E = 5, 4, 2, 4
    x = torch.randn(T, D, dtype=F64)
    ids = torch.randint(0, E, (T, 2))
    w_in = torch.randn(E, D, 2 * Fh, dtype=F64)
    w_out = torch.randn(E, Fh, D, dtype=F64)
    with _world_of_one("gloo"):
        with pytest.raises(ValueError, match=r"^expert_ids: expected shape \[T=5, k\]"):
            expert_parallel_block(x, ids[:-1], None, w_in, w_out)
        with pytest.raises(TypeError, match=r"^expert_ids: expected an integer"):
            expert_parallel_block(x, ids.double(), None, w_in, w_out)
        with pytest.raises(ValueError, match=r"^weights: expected shape \[5, 2\]"):
            expert_parallel_block(x, ids, torch.rand(T, 3, dtype=F64), w_in, w_out)
        with pytest.raises(TypeError, match=r"^w_out: expected dtype torch.float64"):
            expert_parallel_block(x, ids, None, w_in, w_out.float())
        with pytest.raises(ValueError, match=r"^w_out: expected shape"):
            expert_parallel_block(x, ids, None, w_in, w_out[:3])
        with pytest.raises(RuntimeError, match=r"^weights: expected a tensor on cpu"):
            expert_parallel_block(x, ids, torch.rand(T, 2, dtype=F64, device="meta"), w_in, w_out)
        with pytest.raises(RuntimeError, match=r"^w_in: expected a tensor on cpu"):
            expert_parallel_block(x, ids, None, w_in.to("meta"), w_out)
        with pytest.raises(RuntimeError, match=r"^w_out: expected a tensor on cpu"):
            expert_parallel_block(x, ids, None, w_in, w_out.to("meta"))
        bad = ids.clone()
        bad[2, 1] = E
        with pytest.raises(
            ValueError, match=r"^expert_ids: expected expert ids in \[0, 4\).*rank\(s\) \[0\]"
        ):
            expert_parallel_block(x, bad, None, w_in, w_out)
        # the group is still usable afterwards
        assert expert_parallel_block(x, ids, None, w_in, w_out).shape == (T, D)


# --------------------------------------------------------------------------- 2 and 4 ranks

LINE = re.compile(r"^(ROUTE|CHECK|RAISED|RESULT) world=(\d+) (.*)$")


def _launch(world: int, *args: str, timeout: int = 120, env: Optional[Dict[str, str]] = None):
    """ep_check.py under torch.distributed.run: ``(returncode, parsed lines, output)``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        str(WORKER),
        *args,
    ]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT
        )
    except subprocess.TimeoutExpired as e:  # a hang (a rank left waiting in a collective)
        pytest.fail(f"{world} ranks did not finish in {timeout} s:\n{e.stdout}\n{e.stderr}")
    lines: List[Dict[str, str]] = []
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if m:
            kind, w, rest = m.groups()
            assert int(w) == world, line
            fields = dict(re.findall(r"(\w+)=(\[[^\]]*\]|\S+)", rest.split(" msg=")[0]))
            fields["kind"] = kind
            if " msg=" in rest:
                fields["msg"] = rest.split(" msg=", 1)[1]
            fields["verdict"] = rest.rsplit(" ", 1)[-1]
            lines.append(fields)
    return proc.returncode, lines, proc.stdout + proc.stderr


@pytest.mark.skipif(not GLOO, reason="needs gloo")
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_gloo_ranks_equal_one_process(world):
    """float64 on gloo: every output row and gradient of every case equals the whole
    layer (or expert_block) in one process to 1e-10 relative."""
    rc, lines, output = _launch(world, "--backend", "gloo", "--dtype", "float64")
    assert rc == 0, output
    checks = [ln for ln in lines if ln["kind"] == "CHECK"]
    assert lines[-1]["kind"] == "RESULT" and lines[-1]["verdict"] == "PASS", output
    assert lines[-1]["checks"] == str(len(checks)) and lines[-1]["failed"] == "0", output
    assert len(checks) >= 80, output
    for c in checks:
        assert c["verdict"] == "ok", (c, output)
        if c["what"] != "raised":
            assert float(c["err"]) <= 1e-10 and float(c["tol"]) <= 1e-10, c
    cases = {c["case"] for c in checks}
    for need in (
        "random-k2-fused",
        "skewed-k2-fused",
        "random-k1-fused-uneven",
        "zero-rank-k3-fused",
        "all-empty-k2-fused",
        "random-k2-unfused",
        "skewed-k2-unfused-gelu-bias-pad4",
        "random-k3-unfused-relu-pad3",
        "block-random-k2",
        "block-skewed-k1",
        "block-random-k3-unweighted",
        "subgroups-k2-fused",
        "bad-id-high-last-rank",
        "bad-id-negative-first-rank",
        "compiled-k2-fused",
        "compiled-k1-unfused",
        "fixed-random-k2-fused",
        "fixed-skewed-k2-fused",
        "fixed-zero-rank-k3-fused",
        "fixed-all-empty-k2-fused",
        "fixed-random-k2-direct",
        "fixed-subgroups-k2-fused",
        "fixed-fullgraph-k2-fused",
        "fixed-block-random-k3-unweighted",
        "fixed-block-skewed-k1",
        "fixed-bad-id-high-last-rank",
        "fixed-bad-id-negative-first-rank",
    ):
        assert need in cases, need
    # every gradient was compared: router gate, expert weights (and biases), x
    whats = {(c["case"], c["what"]) for c in checks}
    for what in ("out", "grad_x", "grad_router_gate", "grad_w_in", "grad_w_out"):
        assert ("random-k2-fused", what) in whats
    assert ("skewed-k2-unfused-gelu-bias-pad4", "grad_b_out") in whats
    assert ("block-random-k2", "grad_weights") in whats
    # skewed routing leaves the last rank's experts without rows
    routed = {ln["case"]: ln["rows"] for ln in lines if ln["kind"] == "ROUTE"}
    for case in ("skewed-k2-fused", "skewed-k2-unfused-gelu-bias-pad4", "block-skewed-k1"):
        rows = [int(v) for v in routed[case].strip("[]").split(",")]
        assert len(rows) == world and rows[-1] == 0 and sum(rows) > 0, (case, rows)
    # an id out of range on one rank: the same ValueError on every rank, no hang
    # (fixed sizes: raised a few calls later, check_routing here, saying so)
    for case, bad_rank, when in (
        ("bad-id-high-last-rank", world - 1, ""),
        ("bad-id-negative-first-rank", 0, ""),
        ("fixed-bad-id-high-last-rank", world - 1, " (an earlier call's)"),
        ("fixed-bad-id-negative-first-rank", 0, " (an earlier call's)"),
    ):
        raised = [ln for ln in lines if ln["kind"] == "RAISED" and ln["case"] == case]
        assert sorted(int(ln["rank"]) for ln in raised) == list(range(world)), output
        for ln in raised:
            assert ln["type"] == "ValueError", ln
            assert ln["msg"].startswith(
                f"expert_ids: expected expert ids in [0, 8) (E = world size {world}"
            )
            assert ln["msg"].endswith(f"found ids out of range on rank(s) [{bad_rank}]{when}"), ln


@pytest.mark.skipif(not GLOO, reason="needs gloo")
def test_expert_parallel_check_fails_on_a_wrong_expert_slice():
    """The worker's checks are live: each rank holding the next rank's experts fails
    them, and the job exits non-zero."""
    cases = "random-k2-fused,block-random-k2,skewed-k2-unfused-gelu-bias-pad4"
    rc, lines, output = _launch(2, "--fault", "--cases", cases)
    assert rc != 0, output
    assert lines and lines[-1]["kind"] == "RESULT" and lines[-1]["verdict"] == "FAIL", output
    failed = {
        (c["case"], c["what"]) for c in lines if c["kind"] == "CHECK" and c["verdict"] == "FAIL"
    }
    for case in cases.split(","):
        assert (case, "out") in failed and (case, "grad_w_in") in failed, output


# --------------------------------------------------------------------------- GPU

SYNC = "called a synchronizing CUDA operation"


def _gpu_layer(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("top_k", 2)
    return MoELayer(256, 128, 8, aux_loss_coef=0.0, device="cuda", dtype=BF16, **kw)


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [True, False])
def test_sharded_layer_nccl_world_of_one_bf16_equals_layer(fused):
    """NCCL, world size 1: the sharded bf16 layer equals the plain one (the same routing:
    the same router on the same tokens), values and every gradient."""
    layer = _gpu_layer(fused=fused)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 256, generator=gen).to("cuda", BF16)
    go = torch.randn(300, 256, generator=gen).to("cuda", BF16)
    with _world_of_one("nccl"):
        got = _layer_grads(layer.sharded(), x, go)
        torch.cuda.synchronize()
    want = _layer_grads(layer, x, go)
    for name in want:
        assert_close_rel(got[name], want[name], BF16, name)


def _gpu_block_case(T=300, D=256, Fh=128, E=8, k=2, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to("cuda", BF16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
    w_in = (torch.randn(E, D, 2 * Fh, generator=gen) * D**-0.5).to("cuda", BF16)
    w_out = (torch.randn(E, Fh, D, generator=gen) * Fh**-0.5).to("cuda", BF16)
    weights = torch.rand(T, k, generator=gen).to("cuda", BF16)
    return [
        t.requires_grad_() if t.is_floating_point() else t for t in (x, ids, weights, w_in, w_out)
    ]


def _count_syncs(fn):
    """``(result, syncs)``: ``fn()`` under sync debug mode "warn", counting torch's
    synchronizing-operation warnings (every one recorded: filter "always")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [w for w in caught if SYNC in str(w.message)]


@pytest.mark.cuda
def test_expert_parallel_block_one_host_sync_forward_none_backward():
    """The forward syncs with the host exactly once (the split sizes' ``.tolist()`` in
    groupmm/_exchange.py, the plan), the backward never (sync debug mode "error")."""
    x, ids, weights, w_in, w_out = _gpu_block_case()
    go = torch.randn_like(x)
    with _world_of_one("nccl"):
        # warm-up: the NCCL communicator is made on the first collective
        expert_parallel_block(x, ids, weights, w_in, w_out).backward(go)
        torch.cuda.synchronize()
        out, syncs = _count_syncs(lambda: expert_parallel_block(x, ids, weights, w_in, w_out))
        assert len(syncs) == 1, [(w.filename, w.lineno) for w in syncs]
        assert syncs[0].filename.endswith(os.path.join("groupmm", "_exchange.py")), syncs[0]
        torch.cuda.set_sync_debug_mode("error")
        try:
            out.backward(go)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _, syncs = _count_syncs(lambda: out.detach().sum().item())  # the counter counts
        assert len(syncs) == 1
        torch.cuda.synchronize()


@pytest.mark.cuda
def test_expert_parallel_block_fixed_sizes_no_host_sync_graph_replays_new_routing():
    """Fixed-size exchanges (``capacity``): forward and backward with no host sync (sync
    debug mode "error"), equal to the exact-size block; and the whole step captured in a
    CUDA graph, replayed with other routing, tokens and weights copied into its inputs,
    equal to an eager step on those."""

    def step(inputs, cap):
        x, ids, weights, w_in, w_out = (t.detach().clone() for t in inputs)
        leaves = [x, weights, w_in, w_out]
        for t in leaves:
            t.requires_grad_()
        out = expert_parallel_block(x, ids, weights, w_in, w_out, capacity=cap)
        out.backward(go)
        return [out.detach()] + [t.grad for t in leaves]

    first = _gpu_block_case(seed=2)
    second = _gpu_block_case(seed=3)
    go = torch.randn(300, 256, device="cuda", dtype=BF16)
    cap = 320
    with _world_of_one("nccl"):
        want = step(first, None)
        step(first, cap)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = step(first, cap)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for name, g, w in zip(("out", "x", "weights", "w_in", "w_out"), got, want):
            assert_close_rel(g, w, BF16, name)
        static = [t.detach().clone() for t in first]
        sx, sids, sw, s_in, s_out = static
        leaves = [sx, sw, s_in, s_out]
        for t in leaves:
            t.requires_grad_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                expert_parallel_block(sx, sids, sw, s_in, s_out, capacity=cap).backward(go)
        torch.cuda.current_stream().wait_stream(side)
        for t in leaves:
            t.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = expert_parallel_block(sx, sids, sw, s_in, s_out, capacity=cap)
            out.backward(go)
        with torch.no_grad():
            for dst, src in zip(static, second):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [out] + [t.grad for t in leaves]
        want = step(second, None)
        for name, g, w in zip(("out", "x", "weights", "w_in", "w_out"), replayed, want):
            assert_close_rel(g, w, BF16, f"replay {name}")
        assert not torch.equal(want[0], step(first, None)[0])  # new routing, new result
        # a graph that captured NCCL calls goes before its communicator (else the group's
        # destruction waits forever)
        del replayed, out
        graph.reset()
        torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.parametrize("indexed", [False, True])
def test_expert_compute_cuda_bf16_equals_reference_without_host_sync(indexed):
    rows, w_in, w_out, counts, perm, weights = _compute_case(
        R=400, D=256, Fh=128, counts=(90, 0, 130, 75, 0, 60, 40), seed=10, device="cuda", dtype=BF16
    )
    index = perm if indexed else None
    ins = [t.clone().requires_grad_() for t in (rows, w_in, w_out, weights)]
    go = torch.randn_like(rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = expert_compute(*ins[:3], counts=counts, index=index, weights=ins[3])
        got = _grads(out, ins, go)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    refs = [t.detach().cpu().to(F64).requires_grad_() for t in (rows, w_in, w_out, weights)]
    ref = _reference(*refs[:3], counts.cpu(), None if index is None else index.cpu(), refs[3])
    assert_close_rel(out, ref, BF16, "out")
    for name, g, r in zip(
        ["rows", "w_in", "w_out", "weights"], got, _grads(ref, refs, go.cpu().to(F64))
    ):
        assert_close_rel(g, r, BF16, f"grad {name}")


@pytest.mark.cuda
def test_expert_compute_cuda_wrong_device_names_the_argument():
    rows, w_in, w_out, counts, perm, weights = _compute_case(device="cuda")
    with pytest.raises(RuntimeError, match=r"^counts: expected a tensor on cuda"):
        expert_compute(rows, w_in, w_out, counts=counts.cpu())
    with pytest.raises(RuntimeError, match=r"^index: expected a tensor on cuda"):
        expert_compute(rows, w_in, w_out, counts=counts, index=perm.cpu())
    with pytest.raises(RuntimeError, match=r"^weights: expected a tensor on cuda"):
        expert_compute(rows, w_in, w_out, counts=counts, weights=weights.cpu())
    with pytest.raises(RuntimeError, match=r"^w_in: expected a tensor on cuda"):
        expert_compute(rows, w_in.cpu(), w_out, counts=counts)
    with pytest.raises(RuntimeError, match=r"^w_out: expected a tensor on cuda"):
        expert_compute(rows, w_in, w_out.cpu(), counts=counts)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_nccl_ranks_equal_one_gpu(world):
    """bf16 on NCCL, one GPU per rank, every case of the gloo test: outputs and gradients
    within 2e-2 relative of a float32 one-GPU reference of the same (rounded) layer."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    args = ["--backend", "nccl", "--dtype", "bfloat16", "--d-model", "128", "--d-ff", "64"]
    rc, lines, output = _launch(
        world, *args, "--token-scale", "23", timeout=300, env={"NCCL_NVLS_ENABLE": "0"}
    )
    assert rc == 0, output
    checks = [ln for ln in lines if ln["kind"] == "CHECK"]
    assert lines[-1]["kind"] == "RESULT" and lines[-1]["verdict"] == "PASS", output
    assert len(checks) >= 80 and all(c["verdict"] == "ok" for c in checks), output
    raised = [ln for ln in lines if ln["kind"] == "RAISED"]
    assert len(raised) == 4 * world and all(ln["type"] == "ValueError" for ln in raised), output
    # fixed sizes on the GPU: a captured CUDA graph replayed with new routing, no host sync
    cases = {c["case"] for c in checks}
    assert {"fixed-graph-k2-fused", "fixed-no-sync-k2-fused"} <= cases, output


@pytest.mark.cuda
@pytest.mark.parametrize("indexed", [False, True])
def test_expert_compute_cuda_no_rows(indexed):
    """No rows at all (an expert-parallel rank that received none): an empty output and
    zero weight gradients, on the fused kernels' path (bf16), with no error."""
    rows, w_in, w_out, counts, perm, weights = _compute_case(
        R=0, D=256, Fh=128, counts=(0, 0, 0), seed=11, device="cuda", dtype=BF16
    )
    ins = [t.clone().requires_grad_() for t in (rows, w_in, w_out, weights)]
    out = expert_compute(*ins[:3], counts=counts, index=perm if indexed else None, weights=ins[3])
    assert out.shape == (0, 256)
    got = _grads(out, ins, torch.randn_like(out))
    assert got[0].shape == (0, 256)
    assert torch.count_nonzero(got[1]) == 0 and torch.count_nonzero(got[2]) == 0


def _reference_by_ids(rows, w_in, w_out, ids, weights):
    """Independent float64 reference of ``expert_compute(expert_ids=...)``: for each row
    and slot with an id in ``[0, E)``, the slot's weight times that expert's SwiGLU MLP of
    the row, summed over the slots (other ids: sentinels, nothing)."""
    rows, w_in, w_out = rows.to(F64), w_in.to(F64), w_out.to(F64)
    experts, fh = w_in.shape[0], w_out.shape[1]
    out = rows.new_zeros(rows.shape[0], w_out.shape[2])
    for i in range(rows.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            if 0 <= e < experts:
                pre = rows[i] @ w_in[e]
                y = (F.silu(pre[:fh]) * pre[fh:]) @ w_out[e]
                out[i] = out[i] + (y if weights is None else weights[i, j].to(F64) * y)
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_expert_compute_by_expert_ids_equals_reference(weighted):
    """``expert_ids=`` (DeepEP-style: each row once, its local experts per slot, -1 and
    ids >= E as sentinels): output and every gradient against the per-row reference;
    sentinel slots get no weight gradient."""
    rows, w_in, w_out, _, _, _ = _compute_case(R=9, counts=(0, 0, 0, 0), seed=12)
    gen = torch.Generator().manual_seed(13)
    ids = torch.randint(-1, 5, (9, 3), generator=gen)  # E = 4: -1 and 4 are sentinels
    ids[2] = -1  # a row with no local expert at all
    weights = torch.rand(9, 3, generator=gen, dtype=F64) + 0.5 if weighted else None
    ins = [t.clone().requires_grad_() for t in (rows, w_in, w_out)]
    if weighted:
        ins.append(weights.clone().requires_grad_())
    out = expert_compute(*ins[:3], expert_ids=ids, weights=ins[3] if weighted else None)
    refs = [t.detach().clone().requires_grad_() for t in ins]
    ref = _reference_by_ids(*refs[:3], ids, refs[3] if weighted else None)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert torch.count_nonzero(out[2]) == 0
    go = torch.randn_like(ref)
    got = _grads(out, ins, go)
    for g, r in zip(got, _grads(ref, refs, go)):
        torch.testing.assert_close(g, r, rtol=1e-11, atol=1e-11)
    if weighted:
        sentinel = (ids < 0) | (ids >= 4)
        assert torch.count_nonzero(got[3][sentinel]) == 0


def test_expert_compute_by_expert_ids_errors():
    rows, w_in, w_out, counts, perm, _ = _compute_case(R=6, counts=(1, 2, 0, 3))
    ids = torch.zeros(6, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=ONE_OF):
        expert_compute(rows, w_in, w_out, counts=counts, expert_ids=ids)
    with pytest.raises(ValueError, match="^index: expected None with expert_ids"):
        expert_compute(rows, w_in, w_out, expert_ids=ids, index=perm)
    with pytest.raises(ValueError, match=r"^expert_ids: expected shape \[R=6, k\]"):
        expert_compute(rows, w_in, w_out, expert_ids=ids[:5])
    with pytest.raises(ValueError, match="^weights: expected"):
        expert_compute(rows, w_in, w_out, expert_ids=ids, weights=torch.ones(6, 3, dtype=F64))
    one = expert_compute(rows, w_in, w_out, expert_ids=ids[:, 0])  # [R] is k = 1
    torch.testing.assert_close(one, _reference_by_ids(rows, w_in, w_out, ids[:, :1], None))
