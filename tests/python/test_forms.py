"""Every form, forward and backward, against the float64 reference; grad_fn, which
gradients are computed, gradcheck and gradgradcheck."""

from __future__ import annotations

import groupmm
import groupmm._library
import pytest
import torch
from conftest import (
    F64,
    LIST_CASES,
    PACKED_CASES,
    assert_close_rel,
    grad_or_zeros,
    make_list,
    make_packed,
    packed_case_ids,
    ref_grads,
    ref_list,
    ref_packed,
)
from groupmm import grouped_mm
from torch.autograd import gradcheck, gradgradcheck


def _close(x, y):
    torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("form,i", packed_case_ids())
def test_packed_forward_backward_vs_reference(form, i):
    a, b, offs = make_packed(form, **PACKED_CASES[form][i], seed=i)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = grouped_mm(a, b, offs=offs)
    ref = ref_packed(a, b, offs)
    assert out.dtype == F64 and out.is_contiguous()
    _close(out, ref)
    assert out.grad_fn is not None
    go = torch.randn_like(ref)
    da, db = torch.autograd.grad(out, (a, b), go)
    ra, rb = ref_grads(ref, (a, b), go)
    _close(da, ra)
    _close(db, rb)


@pytest.mark.parametrize("i", range(len(LIST_CASES)))
def test_list_forward_backward_vs_reference(i):
    As, Bs = make_list(LIST_CASES[i], seed=i)
    for t in (*As, *Bs):
        t.requires_grad_(True)
    outs = grouped_mm(As, Bs)
    refs = ref_list(As, Bs)
    assert isinstance(outs, list) and len(outs) == len(As)
    for o, r in zip(outs, refs):
        _close(o, r)
        assert o.grad_fn is not None
    if not As:
        return
    gos = [torch.randn_like(r) for r in refs]
    sum((o * g).sum() for o, g in zip(outs, gos)).backward()
    got = [grad_or_zeros(t).clone() for t in (*As, *Bs)]
    for t in (*As, *Bs):
        t.grad = None
    sum((r * g).sum() for r, g in zip(refs, gos)).backward()
    for g, t in zip(got, (*As, *Bs)):
        _close(g, grad_or_zeros(t))


def test_no_grad_outputs_have_no_grad_fn():
    a, b, offs = make_packed("2d3d", 3, 0, 4, 5, 9, seed=1)
    assert grouped_mm(a, b, offs=offs).grad_fn is None
    a.requires_grad_(True)
    with torch.no_grad():
        assert grouped_mm(a, b, offs=offs).grad_fn is None
    assert grouped_mm(a, b, offs=offs).grad_fn is not None


class _Spy:
    """Wraps a backward entry point of the extension and records its need flags."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args):
        self.calls.append(tuple(args[-2:]))
        return self.fn(*args)


@pytest.mark.parametrize("form", ["2d3d", "2d2d", "3d2d", "3d3d"])
@pytest.mark.parametrize("which", ["a", "b"])
def test_only_needed_gradient_is_computed(form, which, monkeypatch):
    spy = _Spy(groupmm._library._native_mm_bwd)
    monkeypatch.setattr(groupmm._library, "_native_mm_bwd", spy)
    case = PACKED_CASES[form][0]
    a, b, offs = make_packed(form, **case, seed=3)
    leaf = a if which == "a" else b
    other = b if which == "a" else a
    leaf.requires_grad_(True)
    out = grouped_mm(a, b, offs=offs)
    out.sum().backward()  # stride-0 expanded gradient
    assert other.grad is None
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape
    assert spy.calls == [(which == "a", which == "b")]
    ref_leaf = leaf.detach().clone().requires_grad_(True)
    args = (ref_leaf, b) if which == "a" else (a, ref_leaf)
    ref_packed(*args, offs).sum().backward()
    _close(leaf.grad, ref_leaf.grad)


@pytest.mark.parametrize("which", ["As", "Bs", "one"])
def test_list_only_needed_gradients(which, monkeypatch):
    spy = _Spy(groupmm._library._native_list_bwd)
    monkeypatch.setattr(groupmm._library, "_native_list_bwd", spy)
    As, Bs = make_list(LIST_CASES[0], seed=5)
    if which == "As":
        want = As
    elif which == "Bs":
        want = Bs
    else:
        want = [As[1]]
    for t in want:
        t.requires_grad_(True)
    outs = grouped_mm(As, Bs)
    sum(o.sum() for o in outs).backward()
    for t in (*As, *Bs):
        if any(t is w for w in want):
            assert t.grad is not None and t.grad.shape == t.shape
        else:
            assert t.grad is None
    need_a = which in ("As", "one")
    assert spy.calls == [(need_a, not need_a)]
    refs = [a.detach().clone().requires_grad_(True) for a in As]
    refb = [b.detach().clone().requires_grad_(True) for b in Bs]
    sum(r.sum() for r in ref_list(refs, refb)).backward()
    for t, r in zip((*As, *Bs), (*refs, *refb)):
        if t.grad is not None:
            _close(t.grad, r.grad)


# --------------------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("form,i", packed_case_ids())
def test_gradcheck_packed(form, i):
    a, b, offs = make_packed(form, **PACKED_CASES[form][i], seed=10 + i)
    a.requires_grad_(True)
    b.requires_grad_(True)

    def f(a, b):
        return grouped_mm(a, b, offs=offs)

    assert gradcheck(f, (a, b))
    assert gradgradcheck(f, (a, b))


@pytest.mark.parametrize("i", range(len(LIST_CASES) - 1))
def test_gradcheck_list(i):
    As, Bs = make_list(LIST_CASES[i], seed=20 + i)
    n = len(As)
    inputs = [t.requires_grad_(True) for t in (*As, *Bs)]

    def f(*ts):
        return tuple(grouped_mm(list(ts[:n]), list(ts[n:])))

    assert gradcheck(f, inputs)
    assert gradgradcheck(f, inputs)


def test_out_dtype_float32_backward_returns_input_dtype():
    # out_dtype=float32 from bf16: the gradient comes back in bf16 and matches the
    # float64 reference of the rounded inputs
    a, b, offs = make_packed("2d3d", 3, 0, 8, 16, 12, dtype=torch.bfloat16, seed=4)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    go = torch.randn_like(out)
    (out * go).sum().backward()
    assert a.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.bfloat16
    ra = a.detach().double().requires_grad_(True)
    rb = b.detach().double().requires_grad_(True)
    (ref_packed(ra, rb, offs) * go.bfloat16().double()).sum().backward()
    assert_close_rel(a.grad, ra.grad, torch.bfloat16, "da")
    assert_close_rel(b.grad, rb.grad, torch.bfloat16, "db")
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_mm(a.double(), b.double(), offs=offs, out_dtype=torch.float32)


def test_torch_ops_called_directly_are_differentiable():
    a, b, offs = make_packed("3d2d", 3, 4, 0, 5, 9, seed=6)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = torch.ops.groupmm.grouped_mm(a, b, offs, None)
    ref = ref_packed(a, b, offs)
    _close(out, ref)
    go = torch.randn_like(out)
    got = torch.autograd.grad(out, (a, b), go)
    want = torch.autograd.grad(ref, (a, b), go)
    for x, y in zip(got, want):
        _close(x, y)
    assert gradcheck(lambda a, b: torch.ops.groupmm.grouped_mm(a, b, offs, None), (a, b))
    assert gradgradcheck(lambda a, b: torch.ops.groupmm.grouped_mm(a, b, offs, None), (a, b))


@pytest.mark.parametrize("form", ["2d3d", "2d2d", "3d2d", "3d3d"])
@pytest.mark.parametrize("which", ["a", "b"])
def test_gradgradcheck_one_input_requires_grad(form, which):
    a, b, offs = make_packed(form, **PACKED_CASES[form][0], seed=30)
    if which == "a":
        assert gradgradcheck(lambda a: grouped_mm(a, b, offs=offs), (a.requires_grad_(True),))
    else:
        assert gradgradcheck(lambda b: grouped_mm(a, b, offs=offs), (b.requires_grad_(True),))


def test_gradgradcheck_list_mixed_requires_grad():
    As, Bs = make_list(LIST_CASES[0], seed=31)
    a0, b1 = As[0].requires_grad_(True), Bs[1].requires_grad_(True)

    def f(a0, b1):
        return tuple(grouped_mm([a0, *As[1:]], [Bs[0], b1, *Bs[2:]]))

    assert gradcheck(f, (a0, b1))
    assert gradgradcheck(f, (a0, b1))
