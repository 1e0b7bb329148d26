"""``torch.compile(fullgraph=True)`` traces through groupmm: an MoE-style function
(x -> grouped_mm with offs -> silu -> grouped_mm), forward and backward, matches eager;
static and dynamic shapes; the list form; autocast inside a compiled function."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import I32, assert_close_rel, ref_packed
from groupmm import grouped_mm


def moe(x, w1, w2, offs):
    h = grouped_mm(x, w1, offs=offs)
    return grouped_mm(F.silu(h), w2, offs=offs)


def moe_ref(x, w1, w2, offs):
    return ref_packed(F.silu(ref_packed(x, w1, offs)), w2, offs)


def _inputs(t, e=4, d=8, h=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen, requires_grad=True)
    w1 = torch.randn(e, d, h, generator=gen).div_(d**0.5).requires_grad_(True)
    w2 = torch.randn(e, h, d, generator=gen).div_(h**0.5).requires_grad_(True)
    ends = torch.randint(0, t + 1, (e,), generator=gen).sort().values
    ends[1] = ends[0]  # an empty expert
    return x, w1, w2, ends.to(I32)


def _check(fn, args):
    x, w1, w2, offs = args
    out = fn(x, w1, w2, offs)
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w1, w2), go)
    eager = moe(x, w1, w2, offs)
    egrads = torch.autograd.grad(eager, (x, w1, w2), go)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, egrads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    # and against the float64 reference, so eager itself is checked too
    ref = moe_ref(*(t.detach().double().requires_grad_(True) for t in (x, w1, w2)), offs)
    assert_close_rel(out, ref, torch.float32, "compiled out")


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_moe_fullgraph(dynamic):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(moe, fullgraph=True, dynamic=dynamic)
    _check(fn, _inputs(16))
    # a second token count: recompiles (static) or reuses the graph (dynamic)
    _check(fn, _inputs(23, seed=1))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1 if dynamic else graphs == 2


def test_compile_list_form():
    torch._dynamo.reset()

    def f(As, Bs):
        return [o.relu() for o in grouped_mm(As, Bs)]

    gen = torch.Generator().manual_seed(3)
    dims = [(3, 4, 5), (0, 2, 3), (2, 6, 0)]
    As = [torch.randn(m, k, generator=gen, requires_grad=True) for m, n, k in dims]
    Bs = [torch.randn(k, n, generator=gen, requires_grad=True) for m, n, k in dims]
    outs = torch.compile(f, fullgraph=True)(As, Bs)
    sum(o.sum() for o in outs).backward()
    got = [t.grad.clone() for t in (*As, *Bs)]
    for t in (*As, *Bs):
        t.grad = None
    eager = f(As, Bs)
    sum(o.sum() for o in eager).backward()
    for o, e in zip(outs, eager):
        torch.testing.assert_close(o, e)
    for g, t in zip(got, (*As, *Bs)):
        torch.testing.assert_close(g, t.grad)


def test_compile_out_and_autocast():
    torch._dynamo.reset()

    def f(x, w, offs, out):
        with torch.no_grad():
            grouped_mm(x, w, offs=offs, out=out)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return grouped_mm(x, w, offs=offs)

    x, w, _, offs = _inputs(10)
    out = torch.full((10, 12), 3.0)
    y = torch.compile(f, fullgraph=True)(x, w, offs, out)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, grouped_mm(x.detach().bfloat16(), w.detach().bfloat16(), offs=offs))
    assert torch.equal(out, grouped_mm(x.detach(), w.detach(), offs=offs))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_compile_list_out():
    torch._dynamo.reset()

    def f(As, Bs, outs):
        with torch.no_grad():
            grouped_mm(As, Bs, out=outs)
        return outs[0] * 2

    gen = torch.Generator().manual_seed(4)
    As = [torch.randn(3, 4, generator=gen), torch.randn(2, 0, generator=gen)]
    Bs = [torch.randn(4, 6, generator=gen), torch.randn(0, 1, generator=gen)]
    outs = [torch.full((3, 6), 5.0), torch.full((2, 1), 5.0)]
    y = torch.compile(f, fullgraph=True)(As, Bs, outs)
    want = grouped_mm(As, Bs)
    assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
    assert torch.count_nonzero(outs[1]) == 0  # K = 0
    assert torch.equal(y, 2 * outs[0])
