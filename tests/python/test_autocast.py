"""Autocast: under ``torch.autocast(device, dtype)`` float32 inputs run in the autocast
dtype (like ``torch.mm``); gradients come back in the inputs' dtypes."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, assert_close_rel, make_list, make_packed, ref_grads, ref_packed
from groupmm import grouped_mm

DIMS = {
    "2d3d": dict(groups=3, m=0, n=24, k=40, extent=50, offs=[10, 10, 44]),
    "2d2d": dict(groups=3, m=12, n=24, k=0, extent=50, offs=[10, 10, 44]),
    "3d2d": dict(groups=3, m=12, n=0, k=40, extent=50, offs=[10, 10, 44]),
    "3d3d": dict(groups=3, m=12, n=24, k=40, extent=0),
}


def _cases(device):
    dtypes = [torch.bfloat16] if device == "cpu" else [torch.bfloat16, torch.float16]
    return [(d, f) for d in dtypes for f in DIMS]


def _params():
    out = []
    for dev in DEVICES:
        name = dev if isinstance(dev, str) else dev.values[0]
        marks = () if isinstance(dev, str) else dev.marks
        for dt, form in _cases(name):
            out.append(pytest.param(name, dt, form, marks=marks, id=f"{name}-{dt}-{form}"))
    return out


@pytest.mark.parametrize("device,dtype,form", _params())
def test_autocast_packed(device, dtype, form):
    a, b, offs = make_packed(form, **DIMS[form], dtype=torch.float32, seed=1, device=device)
    a.requires_grad_(True)
    b.requires_grad_(True)
    with torch.autocast(device, dtype=dtype):
        out = grouped_mm(a, b, offs=offs)
        ones = torch.ones(2, 2, device=device)
        mm = torch.mm(ones, ones)
    assert out.dtype == dtype == mm.dtype  # like torch.mm
    # exactly what the same call on inputs cast by hand gives
    want = grouped_mm(a.detach().to(dtype), b.detach().to(dtype), offs=offs)
    assert torch.equal(out, want)
    go = torch.randn_like(out)
    out.backward(go)
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    ra = a.detach().to(dtype).double().cpu().requires_grad_(True)
    rb = b.detach().to(dtype).double().cpu().requires_grad_(True)
    ref = ref_packed(ra, rb, offs)
    assert_close_rel(out, ref, dtype, "out")
    ga, gb = ref_grads(ref, (ra, rb), go.double().cpu())
    assert_close_rel(a.grad, ga, dtype, "da")
    assert_close_rel(b.grad, gb, dtype, "db")


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_list_and_torch_ops(device):
    As, Bs = make_list([(5, 6, 7), (0, 3, 4), (3, 2, 0)], dtype=torch.float32, device=device)
    for t in (*As, *Bs):
        t.requires_grad_(True)
    with torch.autocast(device, dtype=torch.bfloat16):
        outs = grouped_mm(As, Bs)
        via_op = torch.ops.groupmm.grouped_mm_list(As, Bs, None)
    low = grouped_mm([a.detach().bfloat16() for a in As], [b.detach().bfloat16() for b in Bs])
    for o, p, w in zip(outs, via_op, low):
        assert o.dtype == p.dtype == torch.bfloat16
        assert torch.equal(o, w) and torch.equal(p, w)
    sum(o.float().sum() for o in outs).backward()
    for t in (*As, *Bs):
        assert t.grad.dtype == torch.float32 and t.grad.shape == t.shape
    a, b, offs = make_packed("2d3d", **DIMS["2d3d"], dtype=torch.float32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = torch.ops.groupmm.grouped_mm(a, b, offs, None)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs))


def test_autocast_rules_like_torch_mm():
    a, b, offs = make_packed("2d3d", **DIMS["2d3d"], dtype=torch.float64, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # float64 is not cast (torch.mm leaves it too)
        assert grouped_mm(a, b, offs=offs).dtype == torch.float64
        assert torch.mm(a[:2], b[0]).dtype == torch.float64
        # out_dtype=float32 still applies after the cast
        a32, b32 = a.float(), b.float()
        y = grouped_mm(a32, b32, offs=offs, out_dtype=torch.float32)
        assert y.dtype == torch.float32
        assert torch.equal(
            y, grouped_mm(a32.bfloat16(), b32.bfloat16(), offs=offs, out_dtype=y.dtype)
        )
        # mixed float32/bfloat16 inputs are both cast, so they are accepted
        assert grouped_mm(a32, b32.bfloat16(), offs=offs).dtype == torch.bfloat16
        with torch.autocast("cpu", enabled=False):
            assert grouped_mm(a32, b32, offs=offs).dtype == torch.float32
        # out= is not autocast (like torch.mm(out=)): computed in float32
        out = torch.empty(a.shape[0], b.shape[2])
        grouped_mm(a32, b32, offs=offs, out=out)
    assert torch.equal(out, grouped_mm(a32, b32, offs=offs))
