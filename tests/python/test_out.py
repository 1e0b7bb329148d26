"""``out=`` for the list and packed forms (no input requiring grad, like
``torch.mm(out=)``): the given buffer is filled, whatever its strides, including the
zero parts (tails, empty groups, K = 0), and nothing around it is touched."""

from __future__ import annotations

import pytest
import torch
from conftest import PACKED_CASES, make_list, make_packed, packed_case_ids, ref_packed
from groupmm import grouped_mm

SENTINEL = 777.0


def _layouts(shape, dtype):
    """``(view, backing)`` pairs: a contiguous buffer, a transposed one and a strided
    slice of a larger buffer; the view is filled with SENTINEL and so is the backing."""
    c = torch.full(shape, SENTINEL, dtype=dtype)
    yield "contiguous", c, c
    t = torch.full(shape[::-1], SENTINEL, dtype=dtype)
    yield "reversed-dims", t.permute(*reversed(range(len(shape)))), t
    big = torch.full([2 * s + 1 for s in shape], SENTINEL, dtype=dtype)
    yield "strided-slice", big[tuple(slice(1, None, 2) for _ in shape)], big


@pytest.mark.parametrize("form,i", packed_case_ids())
def test_packed_out(form, i):
    a, b, offs = make_packed(form, **PACKED_CASES[form][i], seed=i)
    want = grouped_mm(a, b, offs=offs)
    torch.testing.assert_close(want, ref_packed(a, b, offs), rtol=1e-12, atol=1e-12)
    for name, view, backing in _layouts(list(want.shape), want.dtype):
        outside = backing.clone()
        res = grouped_mm(a, b, offs=offs, out=view)
        assert res is view, name
        assert torch.equal(view, want), name  # tails and empty groups are zeroed
        mask = torch.ones_like(backing, dtype=torch.bool)
        if view.numel():
            mask.as_strided(view.shape, view.stride(), view.storage_offset())[...] = False
        assert torch.equal(backing[mask], outside[mask]), f"{name}: wrote outside out"


def test_out_with_requires_grad_inputs_under_no_grad():
    a, b, offs = make_packed("2d3d", 3, 0, 4, 5, 9, seed=1)
    a.requires_grad_(True)
    out = torch.full((9, 4), SENTINEL, dtype=a.dtype)
    with torch.no_grad():
        res = grouped_mm(a, b, offs=offs, out=out)
    assert res is out and out.grad_fn is None
    assert torch.equal(out, grouped_mm(a.detach(), b, offs=offs))
    with pytest.raises(RuntimeError, match="out"):
        grouped_mm(a, b, offs=offs, out=out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_out_with_out_dtype(dtype):
    a, b, offs = make_packed("3d2d", 3, 5, 0, 7, 12, dtype=dtype, seed=2)
    out = torch.full((5, 12), SENTINEL).t().contiguous().t()
    grouped_mm(a, b, offs=offs, out_dtype=torch.float32, out=out)
    assert torch.equal(out, grouped_mm(a, b, offs=offs, out_dtype=torch.float32))


def test_list_out():
    dims = [(3, 4, 5), (0, 2, 3), (2, 3, 0), (4, 1, 2)]
    As, Bs = make_list(dims, seed=3)
    want = grouped_mm(As, Bs)
    big = torch.full((40, 40), SENTINEL, dtype=torch.float64)
    outs = [
        torch.full((3, 4), SENTINEL, dtype=torch.float64),
        torch.full((0, 2), SENTINEL, dtype=torch.float64),
        big[:2, :6:2],  # strided view, K = 0: must become zeros
        big[10:14, 10:11].t().contiguous().t(),
    ]
    before = big.clone()
    res = grouped_mm(As, Bs, out=outs)
    assert len(res) == 4 and all(r is o for r, o in zip(res, outs))
    for o, w in zip(outs, want):
        assert torch.equal(o, w)
    assert torch.count_nonzero(outs[2]) == 0
    before[:2, :6:2] = 0.0
    assert torch.equal(big, before), "wrote outside out[2]"


def test_out_is_rejected_when_the_call_needs_grad_even_if_only_one_needs_it():
    As, Bs = make_list([(2, 2, 2), (3, 3, 3)], seed=4)
    Bs[1].requires_grad_(True)
    outs = [torch.full((n, n), SENTINEL, dtype=torch.float64) for n in (2, 3)]
    with pytest.raises(RuntimeError, match="out"):
        grouped_mm(As, Bs, out=outs)
    assert all((o == SENTINEL).all() for o in outs)


@pytest.mark.parametrize("form", ["packed", "list", "op"])
def test_out_bumps_the_version_counter(form):
    """Like any in-place op: a graph that saved ``out`` must notice it was overwritten
    (instead of silently computing a stale gradient)."""
    a, b, offs = make_packed("2d3d", 3, 0, 4, 5, 9, seed=5)
    out = torch.randn(9, 4, dtype=a.dtype)
    w = torch.randn(3, dtype=a.dtype, requires_grad=True)
    y = (w[:, None, None] * out).sum()  # saves out for backward
    v0 = out._version
    if form == "packed":
        grouped_mm(a, b, offs=offs, out=out)
    elif form == "list":
        grouped_mm([a[:5]], [b[0]], out=[out[:5]])
    else:
        torch.ops.groupmm.grouped_mm_out(a, b, offs, None, out)
    assert out._version > v0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_out_inference_tensor_inside_inference_mode():
    a, b, offs = make_packed("3d3d", 2, 3, 4, 5, 0, seed=6)
    with torch.inference_mode():
        out = torch.full((2, 3, 4), SENTINEL, dtype=a.dtype)
        assert grouped_mm(a, b, offs=offs, out=out) is out
    assert torch.equal(out, grouped_mm(a, b))
