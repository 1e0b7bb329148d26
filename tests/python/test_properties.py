"""Hypothesis property tests: random group shapes (G 0..5; each of M, N, K from
{0, 1, random <= 24}; random offs with empty groups and tails) for every form, forward
and backward against the float64 reference, plus the exact-zero rules."""

from __future__ import annotations

import pytest
import torch
from conftest import F64, I32, ref_grads, ref_list, ref_packed
from groupmm import grouped_mm
from hypothesis import given
from hypothesis import strategies as st

DIM = st.one_of(st.just(0), st.just(1), st.integers(2, 24))


@st.composite
def offs_for(draw, groups: int, extent: int):
    """Non-decreasing ends in 0..=extent: repeats are empty groups, last < extent a tail."""
    ends = sorted(draw(st.lists(st.integers(0, extent), min_size=groups, max_size=groups)))
    if groups and draw(st.booleans()):
        ends[-1] = extent  # no tail
    return torch.tensor(ends, dtype=I32)


@st.composite
def packed_problem(draw, form: str):
    g = draw(st.integers(0, 5))
    m, n, k, extent = draw(DIM), draw(DIM), draw(DIM), draw(DIM)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    if form == "2d3d":
        return rnd(extent, k), rnd(g, k, n), draw(offs_for(g, extent))
    if form == "2d2d":
        return rnd(m, extent), rnd(extent, n), draw(offs_for(g, extent))
    if form == "3d2d":
        return rnd(g, m, k), rnd(k, extent), draw(offs_for(g, extent))
    return rnd(g, m, k), rnd(g, k, n), None


def _close(x, y):
    torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


def _run(a, b, offs):
    a = a.clone().requires_grad_(True)
    b = b.clone().requires_grad_(True)
    out = grouped_mm(a, b, offs=offs)
    ref = ref_packed(a, b, offs)
    _close(out, ref)
    go = torch.randn_like(ref)
    da, db = torch.autograd.grad(out, (a, b), go)
    ra, rb = ref_grads(ref, (a, b), go)
    _close(da, ra)
    _close(db, rb)
    return out.detach(), da, db


@given(packed_problem("2d3d"))
def test_grouped_rows(p):
    a, b, offs = p
    out, da, db = _run(a, b, offs)
    ends = offs.tolist()
    last = ends[-1] if ends else 0
    assert torch.count_nonzero(out[last:]) == 0  # rows past the last offset
    assert torch.count_nonzero(da[last:]) == 0
    start = 0
    for g, end in enumerate(ends):
        if end == start:  # an empty expert gets exactly zero weight gradient
            assert torch.count_nonzero(db[g]) == 0
        start = end


@given(packed_problem("2d2d"))
def test_grouped_reduction(p):
    a, b, offs = p
    out, da, db = _run(a, b, offs)
    ends = offs.tolist()
    last = ends[-1] if ends else 0
    assert torch.count_nonzero(da[:, last:]) == 0  # reduction columns past the end
    assert torch.count_nonzero(db[last:]) == 0
    start = 0
    for g, end in enumerate(ends):
        if end == start:  # an empty group yields a zero [M, N] block
            assert torch.count_nonzero(out[g]) == 0
        start = end


@given(packed_problem("3d2d"))
def test_grouped_columns(p):
    a, b, offs = p
    out, da, db = _run(a, b, offs)
    ends = offs.tolist()
    last = ends[-1] if ends else 0
    assert torch.count_nonzero(out[:, last:]) == 0  # columns past the last offset
    assert torch.count_nonzero(db[:, last:]) == 0
    start = 0
    for g, end in enumerate(ends):
        if end == start:
            assert torch.count_nonzero(da[g]) == 0
        start = end


@given(packed_problem("3d3d"))
def test_batched(p):
    a, b, _ = p
    out, _, _ = _run(a, b, None)
    if a.shape[2] == 0:
        assert torch.count_nonzero(out) == 0  # K = 0 gives zeros


@st.composite
def list_problem(draw):
    dims = draw(st.lists(st.tuples(DIM, DIM, DIM), min_size=0, max_size=5))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    As = [torch.randn(m, k, generator=gen, dtype=F64) for m, n, k in dims]
    Bs = [torch.randn(k, n, generator=gen, dtype=F64) for m, n, k in dims]
    need = draw(st.lists(st.booleans(), min_size=2 * len(dims), max_size=2 * len(dims)))
    return As, Bs, need


@given(list_problem())
def test_list(p):
    As, Bs, need = p
    ins = [t.clone().requires_grad_(r) for t, r in zip((*As, *Bs), need)]
    n = len(As)
    outs = grouped_mm(ins[:n], ins[n:])
    refs = ref_list(ins[:n], ins[n:])
    assert len(outs) == n
    for o, r, a in zip(outs, refs, ins[:n]):
        _close(o, r)
        if a.shape[1] == 0:
            assert torch.count_nonzero(o) == 0
    leaves = [t for t in ins if t.requires_grad]
    if not leaves:
        assert all(o.grad_fn is None for o in outs)
        return
    gos = [torch.randn_like(r) for r in refs]
    loss = sum((o * g).sum() for o, g in zip(outs, gos))
    got = torch.autograd.grad(loss, leaves, retain_graph=True)
    rloss = sum((r * g).sum() for r, g in zip(refs, gos))
    want = torch.autograd.grad(rloss, leaves)
    for x, y in zip(got, want):
        _close(x, y)
    sum(o.sum() for o in outs).backward()
    for t in ins:
        assert (t.grad is None) == (not t.requires_grad)
    for a, b in zip(ins[:n], ins[n:]):
        m, nn = a.shape[0], b.shape[1]
        if b.requires_grad and m == 0:  # an empty group: exactly zero weight gradient
            assert torch.count_nonzero(b.grad) == 0
        if a.requires_grad and nn == 0:
            assert torch.count_nonzero(a.grad) == 0


@pytest.mark.parametrize("form", ["2d3d", "2d2d", "3d2d", "3d3d"])
@given(data=st.data())
def test_forward_only_no_grad(form, data):
    a, b, offs = data.draw(packed_problem(form))
    out = grouped_mm(a, b, offs=offs)
    assert out.grad_fn is None
    _close(out, ref_packed(a, b, offs))
