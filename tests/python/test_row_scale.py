"""groupmm.fused.row_scaled_mm (the RowScale epilogue, the proof of the one-file
epilogue): values against a float64 loop over the groups, every gradient (gradcheck,
gradgradcheck), the op (opcheck, torch.compile), errors; on CUDA the kernel itself (the
native call answers, bitwise repeatable) against the same reference."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, F64, HAS_CUDA, assert_close_rel
from groupmm import _native
from groupmm.fused import row_scaled_mm
from torch.library import opcheck


def _problem(sizes, K, N, tail=3, device="cpu", dtype=F64, seed=0):
    """x [R, K] with R = sum(sizes) + tail rows past the last group, w [E, K, N], offs,
    a signed per-row scale."""
    gen = torch.Generator().manual_seed(seed)
    R = sum(sizes) + tail
    x = torch.randn(R, K, generator=gen, dtype=F64).to(device, dtype)
    w = torch.randn(len(sizes), K, N, generator=gen, dtype=F64).to(device, dtype)
    scale = torch.randn(R, generator=gen, dtype=F64).to(device)
    offs = torch.tensor(sizes).cumsum(0).to(device=device, dtype=torch.int32)
    return x, w, offs, scale


def _reference(x, w, offs, scale):
    """float64, group by group; rows past offs[-1] zero."""
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=F64, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = scale[start:end, None].double() * (x[start:end].double() @ w[g].double())
        start = end
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", [[2, 0, 4], [0, 0], [5]])
def test_values_and_gradients_equal_reference(device, sizes):
    x, w, offs, scale = _problem(sizes, 5, 4, device=device)
    x, w, scale = (t.requires_grad_() for t in (x, w, scale))
    out = row_scaled_mm(x, w, offs, scale)
    ref = _reference(x, w, offs, scale)
    assert out.grad_fn is not None and out.dtype == F64
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, (x, w, scale), go)
    want = torch.autograd.grad(ref, (x, w, scale), go)
    for g, r, name in zip(got, want, "x w scale".split()):
        torch.testing.assert_close(g, r, msg=name)


def test_gradcheck_and_gradgradcheck_float64_cpu():
    x, w, offs, scale = _problem([2, 0, 3], 3, 4, tail=2)
    inputs = tuple(t.requires_grad_() for t in (x, w, scale))

    def f(a, b, s):
        return row_scaled_mm(a, b, offs, s)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_and_compile(device):
    x, w, offs, scale = _problem([3, 1], 8, 8, device=device, dtype=torch.float32)
    opcheck(torch.ops.groupmm.row_scaled_mm.default, (x, w, offs, scale.float()))
    xs, ws, ss = (t.clone().requires_grad_() for t in (x, w, scale.float()))
    f = torch.compile(lambda a, b, s: row_scaled_mm(a, b, offs, s), fullgraph=True)
    out = f(xs, ws, ss)
    out.sum().backward()
    assert_close_rel(out, _reference(x, w, offs, scale), torch.float32, "out")
    assert ss.grad is not None and ws.grad is not None and xs.grad is not None


def test_scale_of_another_dtype_is_applied_in_float32_and_differentiable():
    x, w, offs, scale = _problem([3, 2], 4, 4, dtype=torch.float32)
    s16 = scale.to(torch.bfloat16).requires_grad_()
    out = row_scaled_mm(x, w, offs, s16)
    assert_close_rel(out, _reference(x, w, offs, s16), torch.float32, "out")
    out.sum().backward()
    assert s16.grad is not None and s16.grad.dtype == torch.bfloat16


def test_errors_name_the_argument():
    x, w, offs, scale = _problem([2, 1], 4, 4, dtype=torch.float32)
    scale = scale.float()
    with pytest.raises(ValueError, match=r"^scale: expected shape \[6\]"):
        row_scaled_mm(x, w, offs, scale[:2])
    with pytest.raises(TypeError, match=r"^scale: expected a floating dtype"):
        row_scaled_mm(x, w, offs, torch.ones(6, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^x: expected shape \[R, K\]"):
        row_scaled_mm(x[0], w, offs, scale)
    with pytest.raises(ValueError, match=r"^w: expected 3-D weights \[G, K=4, N\]"):
        row_scaled_mm(x, w[:, :3], offs, scale)
    # the native rule: scale float32, one per row
    with pytest.raises(
        TypeError, match=r"^scale: expected dtype torch.float32 \(the scale of each row\)"
    ):
        _native.product("row_scale", x, w, offs, (scale.double(),))
    with pytest.raises(
        ValueError, match=r"^scale: expected shape \[6\] \(one scale per row of x\)"
    ):
        _native.product("row_scale", x, w, offs, (scale[:5],))
    # the CPU has no kernel for it: None, nothing computed
    assert _native.product("row_scale", x, w, offs, (scale,)) is None
    # the one native entry: the epilogue by name, its rule's operands by position
    with pytest.raises(TypeError, match=r"^epilogue: expected one of swiglu, dgated, row_scale"):
        _native.product("row_scaled", x, w, offs, (scale,))
    with pytest.raises(TypeError, match=r"^operands: the row_scale epilogue needs scale"):
        _native.product("row_scale", x, w, offs)
    with pytest.raises(TypeError, match=r"^operands: the row_scale epilogue takes \(scale\)"):
        _native.product("row_scale", x, w, offs, (scale, scale))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "sizes,K,N",
    [
        ([0, 1, 127, 128, 129, 0, 200], 64, 128),
        ([300, 5], 200, 72),
        ([64], 16, 8),
        ([0, 0], 32, 16),
    ],
)
def test_cuda_kernel_equals_reference(dtype, sizes, K, N):
    x, w, offs, scale = _problem(sizes, K, N, tail=5, device="cuda", dtype=dtype)
    s32 = scale.float()
    ref = _reference(x, w, offs, s32)
    out = _native.product("row_scale", x, w, offs, (s32,))[0]
    if torch.cuda.get_device_capability()[0] == 9:
        assert out is not None, "sm_90: the RowScale kernel runs"
    if out is not None:
        assert_close_rel(out, ref, dtype, "kernel")
        again = _native.product("row_scale", x, w, offs, (s32,))[0]
        assert torch.equal(out, again), "bitwise repeatable"
        assert torch.all(out[offs[-1].item() :] == 0), "rows past offs[-1] are zeros"
    xs, ws, ss = (t.clone().requires_grad_() for t in (x, w, s32))
    y = row_scaled_mm(xs, ws, offs, ss)
    assert_close_rel(y, ref, dtype, "op")
    go = torch.randn_like(y)
    y.backward(go)
    xr, wr, sr = (t.double().requires_grad_() for t in (x, w, s32))
    torch.autograd.backward(_reference(xr, wr, offs, sr), go.double())
    for g, r, name in (
        (xs.grad, xr.grad, "x"),
        (ws.grad, wr.grad, "w"),
        (ss.grad, sr.grad, "scale"),
    ):
        assert_close_rel(g, r, dtype, name)
