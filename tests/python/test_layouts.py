"""Non-contiguous inputs (slices, transposed weights, stride-0 expanded tensors and
gradients) give the contiguous result, forward and backward."""

from __future__ import annotations

import pytest
import torch
from conftest import F64, I32, assert_close_rel, make_list, make_packed, ref_grads, ref_packed
from groupmm import grouped_mm


def _close(x, y):
    torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def _strided_copy(t: torch.Tensor, how: str) -> torch.Tensor:
    """The values of ``t`` in a non-contiguous layout."""
    if how == "transposed":  # stored as [..., cols, rows], viewed back
        return t.mT.contiguous().mT
    if how == "sliced":  # every other column of a wider buffer, offset by one row
        big = torch.randn(*t.shape[:-2], t.shape[-2] + 1, 2 * t.shape[-1] + 1, dtype=t.dtype)
        view = big[..., 1:, 1::2]
        view.copy_(t)
        return view
    if how == "batch_last":  # the batch dimension innermost
        if t.dim() < 3:
            return t.mT.contiguous().mT
        return t.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    raise AssertionError(how)


HOWS = ["transposed", "sliced", "batch_last"]
FORM_DIMS = {
    "2d3d": dict(groups=3, m=0, n=6, k=5, extent=11),
    "2d2d": dict(groups=3, m=4, n=6, k=0, extent=11),
    "3d2d": dict(groups=3, m=4, n=0, k=5, extent=11),
    "3d3d": dict(groups=3, m=4, n=6, k=5, extent=0),
}


@pytest.mark.parametrize("form", list(FORM_DIMS))
@pytest.mark.parametrize("how_a", HOWS)
@pytest.mark.parametrize("how_b", HOWS)
def test_strided_inputs_equal_contiguous(form, how_a, how_b):
    a, b, offs = make_packed(form, **FORM_DIMS[form], seed=1)
    sa, sb = _strided_copy(a, how_a), _strided_copy(b, how_b)
    assert not (sa.is_contiguous() and sb.is_contiguous())
    want = grouped_mm(a, b, offs=offs)
    got = grouped_mm(sa, sb, offs=offs)
    assert got.is_contiguous()
    _close(got, want)
    _close(got, ref_packed(a, b, offs))
    # backward through the strided views
    sa.requires_grad_(True)
    sb.requires_grad_(True)
    out = grouped_mm(sa, sb, offs=offs)
    go = torch.randn_like(out)
    ga, gb = torch.autograd.grad(out, (sa, sb), go)
    ref = ref_packed(a.requires_grad_(True), b.requires_grad_(True), offs)
    ra, rb = ref_grads(ref, (a, b), go)
    _close(ga, ra)
    _close(gb, rb)


def test_transposed_expert_weights_like_nn_linear():
    """Weights stored ``[E, N, K]`` (nn.Linear layout) used as ``[E, K, N]``."""
    gen = torch.Generator().manual_seed(2)
    w_nk = torch.randn(4, 7, 5, generator=gen, dtype=F64, requires_grad=True)
    x = torch.randn(12, 5, generator=gen, dtype=F64, requires_grad=True)
    offs = torch.tensor([3, 3, 8, 10], dtype=I32)
    w = w_nk.transpose(-2, -1)
    assert not w.is_contiguous()
    out = grouped_mm(x, w, offs=offs)
    _close(out, grouped_mm(x.detach(), w.detach().contiguous(), offs=offs))
    go = torch.randn_like(out)
    out.backward(go)
    ref = ref_packed(x, w, offs)
    rx, rw = ref_grads(ref, (x, w_nk), go)
    _close(x.grad, rx)
    _close(w_nk.grad, rw)
    assert w_nk.grad.shape == (4, 7, 5)


@pytest.mark.parametrize("form", list(FORM_DIMS))
def test_expanded_gradient_from_sum(form):
    """``out.sum().backward()`` hands the backward a stride-0 expanded gradient."""
    a, b, offs = make_packed(form, **FORM_DIMS[form], seed=3)
    a.requires_grad_(True)
    b.requires_grad_(True)
    grouped_mm(a, b, offs=offs).sum().backward()
    ref = ref_packed(a, b, offs)
    ra, rb = ref_grads(ref, (a, b), torch.ones_like(ref))
    _close(a.grad, ra)
    _close(b.grad, rb)


@pytest.mark.parametrize("form", list(FORM_DIMS))
def test_stride_zero_inputs(form):
    """Broadcast (stride-0) operands, e.g. one weight shared by every expert."""
    a, b, offs = make_packed(form, **FORM_DIMS[form], seed=4)
    ea = a[..., :1, :].expand_as(a) if a.shape[-2] else a
    eb = b[:1].expand_as(b) if b.dim() == 3 and b.shape[0] else b[:, :1].expand_as(b)
    assert 0 in ea.stride() or 0 in eb.stride()
    _close(grouped_mm(ea, eb, offs=offs), ref_packed(ea, eb, offs))


def test_strided_offs():
    a, b, _ = make_packed("2d3d", **FORM_DIMS["2d3d"], seed=5)
    buf = torch.tensor([2, -7, 2, -7, 9, -7], dtype=I32)
    offs = buf[::2]
    assert offs.stride() == (2,)
    _close(grouped_mm(a, b, offs=offs), ref_packed(a, b, offs.contiguous()))


def test_list_strided_inputs_and_grads():
    dims = [(3, 4, 5), (0, 2, 3), (4, 1, 0), (2, 5, 2)]
    As, Bs = make_list(dims, seed=6)
    sAs = [_strided_copy(a, "sliced") for a in As]
    sBs = [_strided_copy(b, "transposed") for b in Bs]
    for x, y in zip(grouped_mm(sAs, sBs), grouped_mm(As, Bs)):
        _close(x, y)
    for t in (*sAs, *sBs):
        t.requires_grad_(True)
    outs = grouped_mm(sAs, sBs)
    sum(o.sum() for o in outs).backward()  # expanded gradients again
    for a, b, sa, sb in zip(As, Bs, sAs, sBs):
        _close(sa.grad, torch.ones(a.shape[0], b.shape[1], dtype=F64) @ b.mT)
        _close(sb.grad, a.mT @ torch.ones(a.shape[0], b.shape[1], dtype=F64))


def test_lazily_negated_inputs():
    """``torch._neg_view`` tensors carry a pending negation that raw memory does not."""
    a, b, offs = make_packed("2d3d", **FORM_DIMS["2d3d"], seed=7)
    na = torch._neg_view(a)
    assert na.is_neg()
    _close(grouped_mm(na, b, offs=offs), ref_packed(-a, b, offs))
    leaf = b.clone().requires_grad_(True)
    out = grouped_mm(a, torch._neg_view(leaf), offs=offs)
    _close(out, ref_packed(a, -b, offs))
    out.sum().backward()
    ref = ref_packed(a, -b.requires_grad_(True), offs)
    (rb,) = torch.autograd.grad(ref.sum(), b)
    _close(leaf.grad, rb)
    As, Bs = make_list([(3, 4, 5)], seed=8)
    _close(grouped_mm([torch._neg_view(As[0])], Bs)[0], -As[0] @ Bs[0])


# ------------------------------------------------------- gradients follow the operand layout


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_gradients_follow_operand_layout(dtype: torch.dtype) -> None:
    """A transposed-view operand (``[E, N, K]`` weights used as ``w.transpose(-2, -1)``,
    or a transposed activation) gets its gradient in its own layout, with the values of
    the float64 reference; a leaf parameter then keeps that very tensor (no layout copy)."""
    torch.manual_seed(11)
    offs = torch.tensor([3, 3, 8, 12], dtype=torch.int32)
    cases = [
        # (a, b) before the transpose of the flagged operand
        (torch.randn(14, 5), torch.randn(4, 6, 5), "b"),  # [T,K] x [G,N,K]^T
        (torch.randn(5, 14), torch.randn(4, 5, 6), "a"),  # [K,T]^T x [G,K,N]
        (torch.randn(14, 7), torch.randn(9, 14), "ab"),  # [T,M]^T x [N,T]^T -> [G,M,N]
        (torch.randn(4, 7, 5), torch.randn(14, 7), "ab"),  # [G,K,M]^T x [T,K]^T -> [M,T]
        (torch.randn(4, 6, 5), torch.randn(4, 7, 6), "ab"),  # batched, both transposed
    ]
    for a0, b0, which in cases:
        a0 = a0.to(dtype).requires_grad_()
        b0 = b0.to(dtype).requires_grad_()
        a = a0.transpose(-2, -1) if "a" in which else a0
        b = b0.transpose(-2, -1) if "b" in which else b0
        o = offs if a.dim() + b.dim() < 6 else None
        y = grouped_mm(a, b, offs=o)
        gy = torch.randn_like(y)
        seen: dict = {}
        a.register_hook(lambda g, s=seen: s.__setitem__("a", g))
        b.register_hook(lambda g, s=seen: s.__setitem__("b", g))
        y.backward(gy)
        ar = a.detach().double().requires_grad_()
        br = b.detach().double().requires_grad_()
        ref_packed(ar, br, o).backward(gy.double())
        for name, x, ref in (("a", a, ar), ("b", b, br)):
            g = seen[name]
            assert g.stride() == x.stride(), (name, which, g.stride(), x.stride())
            assert_close_rel(g, ref.grad, dtype, f"grad {name} ({which})")
        # the leaves' gradients: the transposed gradient, stolen by autograd, is contiguous
        assert a0.grad.is_contiguous() and b0.grad.is_contiguous()
