"""``torch.library.opcheck`` on every registered op (schema, fake kernel, autograd
registration, aot_dispatch static and dynamic)."""

from __future__ import annotations

import groupmm  # noqa: F401  (registers torch.ops.groupmm.*)
import pytest
import torch
from conftest import make_list, make_packed

BF16 = torch.bfloat16


def _packed(form, rg=(False, False), dtype=torch.float64, **kw):
    dims = dict(groups=3, m=4, n=5, k=6, extent=9, offs=None if form == "3d3d" else [2, 2, 7])
    dims.update(kw)
    a, b, offs = make_packed(form, **dims, dtype=dtype, seed=1)
    return a.requires_grad_(rg[0]), b.requires_grad_(rg[1]), offs


MM_SAMPLES = {
    "2d3d": (*_packed("2d3d"), None),
    "2d3d-grad": (*_packed("2d3d", (True, True)), None),
    "2d2d-grad-a": (*_packed("2d2d", (True, False)), None),
    "3d2d-grad-b": (*_packed("3d2d", (False, True)), None),
    "3d3d-grad": (*_packed("3d3d", (True, True)), None),
    "2d3d-k0": (*_packed("2d3d", (True, True), k=0), None),
    "bf16-out-f32": (*_packed("2d3d", (True, True), dtype=BF16), torch.float32),
}


@pytest.mark.parametrize("name", list(MM_SAMPLES))
def test_opcheck_grouped_mm(name):
    torch.library.opcheck(torch.ops.groupmm.grouped_mm.default, MM_SAMPLES[name])


@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("form", ["2d3d", "3d2d"])
def test_opcheck_grouped_mm_backward(form, need):
    a, b, offs = _packed(form, (True, True))
    out_shape = torch.ops.groupmm.grouped_mm(a.detach(), b.detach(), offs, None).shape
    grad = torch.randn(out_shape, dtype=a.dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.groupmm.grouped_mm_backward.default, (grad, a, b, offs, *need))


@pytest.mark.parametrize("form", ["2d3d", "2d2d", "3d3d"])
def test_opcheck_grouped_mm_out(form):
    a, b, offs = _packed(form)
    shape = torch.ops.groupmm.grouped_mm(a, b, offs, None).shape
    out = torch.full(shape, 5.0, dtype=a.dtype)
    torch.library.opcheck(torch.ops.groupmm.grouped_mm_out.default, (a, b, offs, None, out))


DIMS = [(2, 3, 4), (0, 2, 5), (3, 1, 0)]


@pytest.mark.parametrize("rg", ["none", "all", "As", "Bs"])
def test_opcheck_grouped_mm_list(rg):
    As, Bs = make_list(DIMS, seed=2)
    for t in {"none": [], "all": As + Bs, "As": As, "Bs": Bs}[rg]:
        t.requires_grad_(True)
    torch.library.opcheck(torch.ops.groupmm.grouped_mm_list.default, (As, Bs, None))


def test_opcheck_grouped_mm_list_bf16_out_f32():
    As, Bs = make_list(DIMS, dtype=BF16, seed=3)
    torch.library.opcheck(torch.ops.groupmm.grouped_mm_list.default, (As, Bs, torch.float32))


@pytest.mark.parametrize("need", [(True, True), (False, True), (True, False)])
def test_opcheck_grouped_mm_list_backward(need):
    As, Bs = make_list(DIMS, seed=4)
    for t in (*As, *Bs):
        t.requires_grad_(True)
    grads = [torch.randn(m, n, dtype=torch.float64, requires_grad=True) for m, n, k in DIMS]
    torch.library.opcheck(
        torch.ops.groupmm.grouped_mm_list_backward.default, (grads, As, Bs, *need)
    )


def test_opcheck_grouped_mm_list_out():
    As, Bs = make_list(DIMS, seed=5)
    outs = [torch.full((m, n), 2.0, dtype=torch.float64) for m, n, k in DIMS]
    torch.library.opcheck(torch.ops.groupmm.grouped_mm_list_out.default, (As, Bs, None, outs))


@pytest.mark.parametrize("need", [(True, True), (False, True), (True, False)])
def test_opcheck_grouped_mm_backward_transposed_operands(need):
    """Gradients in a column-major operand's own layout: the fake kernel gives the same
    strides as the real one (opcheck compares them)."""
    torch.manual_seed(3)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    a = torch.randn(5, 9, dtype=torch.float64).t()  # [T=9, K=5], column-major
    b = torch.randn(3, 4, 5, dtype=torch.float64).transpose(-2, -1)  # [G, K=5, N=4]
    grad = torch.randn(9, 4, dtype=torch.float64)
    torch.library.opcheck(torch.ops.groupmm.grouped_mm_backward.default, (grad, a, b, offs, *need))
