"""The fused expert block with its gate and up weights as two tensors (``w_in=(gate, up)``,
torchtitan's ``w1``/``w3`` layout, Mixtral-style ``gate_proj``/``up_proj``): the same
function as the concatenated ``[E, D, 2F]`` weight, against the float64 token-by-token
reference, each weight getting its own gradient; on CUDA the forward runs the same
kernel (bitwise equal to the concatenated weight's) and no concatenated copy is made;
through ``expert_compute`` and ``expert_parallel_block`` (a world of one) and under
``torch.compile``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, HAS_CUDA, assert_close_rel
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.parallel import expert_compute

F64 = torch.float64


def _case(T=9, D=16, Fh=8, E=5, k=2, seed=0, device="cpu", dtype=F64, empty=(1,)):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    pick = torch.stack([torch.randperm(len(allowed), generator=gen)[:k] for _ in range(T)])
    ids = allowed[pick]
    x = torch.randn(T, D, generator=gen, dtype=F64)
    gate = torch.randn(E, D, Fh, generator=gen, dtype=F64) / D**0.5
    up = torch.randn(E, D, Fh, generator=gen, dtype=F64) / D**0.5
    w_out = torch.randn(E, Fh, D, generator=gen, dtype=F64) / Fh**0.5
    weights = torch.rand(T, k, generator=gen, dtype=F64)
    go = torch.randn(T, D, generator=gen, dtype=F64)
    to = [t.to(device, dtype) for t in (x, gate, up, w_out, weights, go)]
    return ids.to(device), to


def _reference(x, ids, gate, up, w_out, weights):
    """float64, token by token: ``sum_j w[t, j] * (silu(x gate_e) * (x up_e)) w_out_e``."""
    out = torch.zeros(x.shape[0], w_out.shape[-1], dtype=F64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            act = F.silu(x[t] @ gate[e]) * (x[t] @ up[e])
            out[t] += weights[t, j] * (act @ w_out[e])
    return out


def _leaves(ts):
    return [t.clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_pair_equals_reference(device, dtype, layout):
    """Output and every gradient (x, gate, up, w_out, router weights) against float64;
    ``transposed``: views of ``[E, F, D]`` storage (torchtitan's ``w1``/``w3``), whose
    gradients keep that layout."""
    ids, (x, gate, up, w_out, weights, go) = _case(device=device, dtype=dtype)
    if layout == "transposed":
        gate = gate.transpose(1, 2).contiguous().transpose(1, 2)
        up = up.transpose(1, 2).contiguous().transpose(1, 2)
    x, gate, up, w_out, weights = _leaves([x, gate, up, w_out, weights])
    r = routes(ids, gate.shape[0])
    out = expert_block(x, (gate, up), w_out, r.offs, r.src, r.inverse, weights)
    grads = torch.autograd.grad(out, [x, gate, up, w_out, weights], go)
    refs = _leaves([t.detach().double().cpu() for t in (x, gate, up, w_out, weights)])
    ref = _reference(refs[0], ids.cpu(), *refs[1:])
    want = torch.autograd.grad(ref, refs, go.double().cpu())
    names = ("x", "gate", "up", "w_out", "weights")
    if dtype == F64:
        torch.testing.assert_close(out.cpu(), ref)
        for name, g, w in zip(names, grads, want):
            torch.testing.assert_close(g.cpu(), w, msg=name)
    else:
        assert_close_rel(out, ref, dtype, "out")
        for name, g, w in zip(names, grads, want):
            assert_close_rel(g, w, dtype, name)
    if layout == "transposed":  # the parameters' own layout: no transposed copy
        assert grads[1].transpose(1, 2).is_contiguous() and grads[2].transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_pair_equals_concatenated(device):
    """The pair and ``[gate | up]`` give the same output (bitwise) and gradients (the
    weights' as the two halves of the concatenated weight's; ``x``'s summed in another
    order: within rounding)."""
    dtype = torch.bfloat16 if device == "cuda" else F64
    ids, (x, gate, up, w_out, weights, go) = _case(
        T=64, D=64, Fh=64, E=8, device=device, dtype=dtype
    )
    r = routes(ids, gate.shape[0])
    a = _leaves([x, gate, up, w_out, weights])
    out_a = expert_block(a[0], (a[1], a[2]), a[3], r.offs, r.src, r.inverse, a[4])
    ga = torch.autograd.grad(out_a, a, go)
    b = _leaves([x, torch.cat([gate, up], 2), w_out, weights])
    out_b = expert_block(b[0], b[1], b[2], r.offs, r.src, r.inverse, b[3])
    gb = torch.autograd.grad(out_b, b, go)
    assert torch.equal(out_a, out_b)
    fh = gate.shape[2]
    assert torch.equal(ga[1], gb[1][..., :fh]) and torch.equal(ga[2], gb[1][..., fh:])
    assert torch.equal(ga[3], gb[2]) and torch.equal(ga[4], gb[3])
    assert_close_rel(ga[0], gb[0].double(), dtype if dtype != F64 else torch.float32, "x")


@pytest.mark.parametrize("device", DEVICES)
def test_pair_through_expert_compute(device):
    """``expert_compute`` on rows in expert order (no index) and by expert ids."""
    ids, (x, gate, up, w_out, weights, go) = _case(device=device)
    r = routes(ids, gate.shape[0])
    rows = x.index_select(0, r.src.long())
    counts = torch.diff(r.offs, prepend=r.offs.new_zeros(1))
    got = expert_compute(rows, (gate, up), w_out, counts=counts)
    want = expert_compute(rows, torch.cat([gate, up], 2), w_out, counts=counts)
    torch.testing.assert_close(got, want)
    got = expert_compute(x, (gate, up), w_out, expert_ids=ids, weights=weights)
    want = expert_compute(x, torch.cat([gate, up], 2), w_out, expert_ids=ids, weights=weights)
    torch.testing.assert_close(got, want)


def test_pair_errors_name_the_argument():
    ids, (x, gate, up, w_out, weights, _) = _case()
    r = routes(ids, gate.shape[0])
    args = (r.offs, r.src, r.inverse, weights)
    with pytest.raises(ValueError, match=r"w_in\[1\]: expected shape \[5, 16, 8\]"):
        expert_block(x, (gate, up[..., :4]), w_out, *args)
    with pytest.raises(TypeError, match=r"w_in\[1\]: expected dtype torch.float64"):
        expert_block(x, (gate, up.float()), w_out, *args)
    with pytest.raises(ValueError, match=r"w_in: expected a pair \(gate, up\), found 3"):
        expert_block(x, (gate, up, up), w_out, *args)
    with pytest.raises(ValueError, match=r"w_out: expected shape \[E=5, F=8, D=16\]"):
        expert_block(x, (gate, up), w_out[:, :4], *args)
    with pytest.raises(
        ValueError,
        match=r"w_in\[0\]: expected shape \[E=5, D=8, F\] \(E = len\(offs\), D = x.shape\[1\]\)",
    ):
        expert_block(x[:, :8], (gate, up), w_out, *args)


@pytest.mark.parametrize("device", DEVICES)
def test_pair_compiles_fullgraph(device):
    from torch._dynamo.utils import counters

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ids, ts = _case(T=32, D=32, Fh=16, E=4, device=device, dtype=dtype)
    x, gate, up, w_out, weights = _leaves(ts[:5])
    r = routes(ids, gate.shape[0])

    def f(x, gate, up, w_out, weights):
        return expert_block(x, (gate, up), w_out, r.offs, r.src, r.inverse, weights)

    torch._dynamo.reset()
    counters.clear()
    backend = "inductor" if device == "cuda" else "aot_eager"
    inputs = [x, gate, up, w_out, weights]
    got = torch.compile(f, fullgraph=True, backend=backend)(*inputs)
    got_grads = torch.autograd.grad(got, inputs, ts[5])
    want = f(*inputs)
    want_grads = torch.autograd.grad(want, inputs, ts[5])
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_pair_runs_the_fused_kernel(layout):
    """On CUDA the fused up projection takes the pair as two operands (the native call
    answers, no composition) and writes what the kernel writes for ``[gate | up]``
    (bitwise); a pair of other strides is composed (None), still equal."""
    from groupmm import _native

    ids, (x, gate, up, w_out, weights, go) = _case(
        T=256, D=128, Fh=192, E=8, device="cuda", dtype=torch.bfloat16
    )
    r = routes(ids, gate.shape[0])
    if layout == "transposed":
        gate = gate.transpose(1, 2).contiguous().transpose(1, 2)
        up = up.transpose(1, 2).contiguous().transpose(1, 2)
    src = r.src.int()
    got = _native.product("swiglu", x, gate, r.offs, (up,), src)
    assert got is not None
    want = _native.product("swiglu", x, torch.cat([gate, up], 2), r.offs, (), src)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # up in the other major than gate: other strides, composed by the caller
    other = up.contiguous() if layout == "transposed" else up.mT.contiguous().mT
    assert _native.product("swiglu", x, gate, r.offs, (other,), src) is None


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_pair_through_expert_parallel_block():
    """``expert_parallel_block`` (a gloo world of one) with the pair: the output and the
    gradients of both weights as with the concatenated weight."""
    from groupmm.parallel import expert_parallel_block
    from test_parallel import _world_of_one

    ids, (x, gate, up, w_out, weights, go) = _case()
    a = _leaves([gate, up])
    b = _leaves([torch.cat([gate, up], 2)])
    with _world_of_one("gloo"):
        got = expert_parallel_block(x, ids, weights, (a[0], a[1]), w_out)
        want = expert_parallel_block(x, ids, weights, b[0], w_out)
        got_grads = torch.autograd.grad(got, a, go)
        (want_grad,) = torch.autograd.grad(want, b, go)
    torch.testing.assert_close(got, want)
    fh = gate.shape[2]
    torch.testing.assert_close(got_grads[0], want_grad[..., :fh])
    torch.testing.assert_close(got_grads[1], want_grad[..., fh:])
