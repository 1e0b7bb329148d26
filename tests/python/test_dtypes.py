"""float32 / float16 / bfloat16 against the float64 reference of the same (rounded)
inputs, with the tolerances of ``conftest.TOL`` (relative Frobenius error: f32 <= 1e-5,
f16 <= 2e-3, bf16 <= 1e-2); ``out_dtype=torch.float32`` from 16-bit inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DEVICES,
    assert_close_rel,
    make_list,
    make_packed,
    ref_grads,
    ref_list,
    ref_packed,
)
from groupmm import grouped_mm

LOW = [torch.float32, torch.float16, torch.bfloat16]
DIMS = {
    "2d3d": dict(groups=5, m=0, n=48, k=96, extent=200, offs=[30, 30, 90, 150, 190]),
    "2d2d": dict(groups=4, m=40, n=24, k=0, extent=300, offs=[0, 120, 120, 280]),
    "3d2d": dict(groups=4, m=33, n=0, k=64, extent=100, offs=[10, 10, 60, 95]),
    "3d3d": dict(groups=3, m=20, n=30, k=130, extent=0),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("form", list(DIMS))
def test_low_precision_vs_float64(form, dtype, device):
    a, b, offs = make_packed(form, **DIMS[form], dtype=dtype, seed=7, device=device)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = grouped_mm(a, b, offs=offs)
    assert out.dtype == dtype and out.device == a.device
    ra = a.detach().double().cpu().requires_grad_(True)
    rb = b.detach().double().cpu().requires_grad_(True)
    ref = ref_packed(ra, rb, offs)
    assert_close_rel(out, ref, dtype, "out")
    go = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    out.backward(go.to(device))
    assert a.grad.dtype == dtype and b.grad.dtype == dtype
    ga, gb = ref_grads(ref, (ra, rb), go.double())
    assert_close_rel(a.grad, ga, dtype, "da")
    assert_close_rel(b.grad, gb, dtype, "db")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", list(DIMS))
def test_out_dtype_float32_from_16bit(form, dtype, device):
    a, b, offs = make_packed(form, **DIMS[form], dtype=dtype, seed=8, device=device)
    out = grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = ref_packed(a, b, offs)
    # no 16-bit output rounding: the float32 bound applies (accumulation is in f32)
    assert_close_rel(out, ref, torch.float32, "out_dtype=float32")
    if device == "cpu":
        # the CPU kernel accumulates 16-bit products in f32 and rounds once
        assert torch.equal(out.to(dtype), grouped_mm(a, b, offs=offs))


@pytest.mark.parametrize("dtype", [*LOW, torch.float64], ids=str)
def test_list_dtypes(dtype):
    As, Bs = make_list([(17, 9, 40), (0, 3, 5), (6, 11, 0), (33, 21, 70)], dtype=dtype, seed=9)
    outs = grouped_mm(As, Bs)
    for o, r in zip(outs, ref_list(As, Bs)):
        assert o.dtype == dtype
        assert_close_rel(o, r, dtype)
    if dtype in (torch.float16, torch.bfloat16):
        for o, r in zip(grouped_mm(As, Bs, out_dtype=torch.float32), ref_list(As, Bs)):
            assert o.dtype == torch.float32
            assert_close_rel(o, r, torch.float32)
