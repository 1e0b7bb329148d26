"""The MoE glue's row ops (``groupmm._rows``: Rust on the CPU, CUDA kernels on the GPU)
against independent float64 references written with loops and torch indexing: every
dtype, vectorised and scalar column counts, padding rows, out-of-range indices, strided
inputs, empty inputs, the custom ops (opcheck, torch.compile) and errors."""

from __future__ import annotations

import groupmm
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, F64, TOL
from groupmm import _rows

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _close(out, ref, dtype):
    assert out.dtype == dtype
    err = (out.double() - ref).norm() / max(ref.norm().item(), 1e-30)
    assert err <= 2 * TOL[dtype], f"relative error {err:.2e}"


def _routing(T, k, rows, device, gen):
    """inverse [T, k]: distinct rows of [0, rows) (rows >= T*k: the rest is padding)."""
    perm = torch.randperm(rows, generator=gen)[: T * k]
    return perm.view(T, k).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 8, 24, 40])
def test_swiglu_and_backward(device, dtype, cols):
    gen = torch.Generator().manual_seed(cols)
    pre = (3 * torch.randn(37, 2 * cols, generator=gen, dtype=F64)).to(device, dtype)
    grad = torch.randn(37, cols, generator=gen, dtype=F64).to(device, dtype)
    p = pre.double().requires_grad_()
    gate, up = p.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    (d_ref,) = torch.autograd.grad(ref, p, grad.double())
    _close(_rows.swiglu(pre), ref.detach(), dtype)
    _close(_rows.swiglu_backward(grad, pre), d_ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [None, "same", "float32"])
@pytest.mark.parametrize("cols", [3, 16, 64])
def test_gather_scatter_dots(device, dtype, weighted, cols):
    T, k, rows = 29, 3, 29 * 3 + 5  # five padding rows
    gen = torch.Generator().manual_seed(cols + k)
    inv = _routing(T, k, rows, device, gen)
    y = torch.randn(rows, cols, generator=gen, dtype=F64).to(device, dtype)
    grad = torch.randn(T, cols, generator=gen, dtype=F64).to(device, dtype)
    w = None
    if weighted:
        w = torch.rand(T, k, generator=gen, dtype=F64).to(device)
        w = w.to(dtype if weighted == "same" else torch.float32)
    wd = torch.ones(T, k, dtype=F64, device=device) if w is None else w.double()

    ref = torch.zeros(T, cols, dtype=F64, device=device)
    for j in range(k):
        ref += wd[:, j : j + 1] * y.double()[inv[:, j]]
    _close(_rows.gather_sum(y, inv, w), ref, dtype)

    ref_dy = torch.zeros(rows, cols, dtype=F64, device=device)
    ref_dy[inv.reshape(-1)] = (wd.unsqueeze(2) * grad.double().unsqueeze(1)).reshape(-1, cols)
    dy = _rows.scatter_rows(grad, inv, w, rows)
    _close(dy, ref_dy, dtype)
    named = torch.zeros(rows, dtype=torch.bool, device=device)
    named[inv.reshape(-1)] = True
    assert (dy[~named] == 0).all(), "padding rows must be exact zeros"

    dot_dtype = torch.float32 if w is None else w.dtype
    ref_dots = (grad.double().unsqueeze(1) * y.double()[inv]).sum(-1)
    _close(_rows.row_dots(grad, y, inv, dot_dtype), ref_dots, dot_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("size", ["small", "large"])
def test_gather_sum_every_top_k(device, dtype, k, size):
    """GatherSum over every shape of work the CUDA kernel splits by (rows.cu: k = 1 copied
    or scaled, k = 2, 3..4, wider k in chunks; problems under and over one wave of
    resident threads; 16-byte vectors and single elements), against a float64 loop,
    weighted and not, with out-of-range indices that must add nothing, and the same bits
    on a second call (no order-dependent reduction)."""
    T, cols = (37, 24) if size == "small" else (2500, 520)
    rows = T * k + 3
    gen = torch.Generator().manual_seed(k * 7 + cols)
    inv = _routing(T, k, rows, "cpu", gen)
    if device != "cpu":  # CUDA: bad indices skipped and flagged (the CPU raises instead)
        inv[1, k - 1] = rows
        inv[T - 1, 0] = -1
    inv = inv.to(device)
    y = torch.randn(rows, cols, generator=gen, dtype=F64).to(device, dtype)
    for w in (None, torch.rand(T, k, generator=gen).to(device)):
        wd = torch.ones(T, k, dtype=F64, device=device) if w is None else w.double()
        ref = torch.zeros(T, cols, dtype=F64, device=device)
        for j in range(k):
            ok = (inv[:, j] >= 0) & (inv[:, j] < rows)
            rowsj = y.double()[inv[:, j].clamp(0, rows - 1)] * ok.unsqueeze(1)
            ref += wd[:, j : j + 1] * rowsj
        out = _rows.gather_sum(y, inv, w)
        _close(out, ref, dtype)
        assert torch.equal(out, _rows.gather_sum(y, inv, w)), "not bitwise repeatable"
        if k == 1 and w is None and device == "cpu":
            assert torch.equal(out, y[inv[:, 0]]), "a one-row gather is a copy"
    if device != "cpu":
        torch.cuda.synchronize()
        assert groupmm._native.take_offs_error(torch.cuda.current_device())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_take_rows_is_the_row_gather(device, dtype):
    """``_glue.take_rows(x, src)`` is ``x[src]`` exactly (the fused block's dY), also on
    strided and int64 indices, and differentiable while autograd records."""
    from groupmm._glue import take_rows

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(41, 72, generator=gen, dtype=F64).to(device, dtype)
    src = torch.randint(0, 41, (300,), generator=gen).to(device)
    assert torch.equal(take_rows(x, src), x[src])
    assert torch.equal(take_rows(x[:, ::2], src.int()), x[:, ::2][src])
    assert torch.equal(take_rows(x, src[::3].int()), x[src[::3]])  # a strided index
    xg = x.double().requires_grad_()
    take_rows(xg, src).sum().backward()
    assert torch.equal(
        xg.grad,
        torch.bincount(src.cpu(), minlength=41).to(xg).unsqueeze(1).expand(41, 72).to(device),
    )


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_indices_are_reported_and_read_nothing(device):
    """An index outside [0, rows) is never read and never silently a zero row: on the CPU
    the op raises, naming the index; on CUDA the kernel skips it (reads and writes
    nothing for it) and the device's next grouped GEMM call raises, without a host sync."""
    y = torch.arange(12.0, device=device).view(4, 3)
    inv = torch.tensor([[0, 7], [-1, 2]], device=device)
    grad = torch.ones(2, 3, device=device)
    calls = [
        lambda: _rows.gather_sum(y, inv),
        lambda: _rows.scatter_rows(grad, inv, None, 4),
        lambda: _rows.row_dots(grad, y, inv, torch.float32),
    ]
    if device == "cpu":
        for call in calls:
            with pytest.raises(ValueError, match=r"routing index (7|-1) at position \d"):
                call()
        return
    dev = torch.cuda.current_device()
    w = torch.randn(2, 3, 5, device=device)
    offs = torch.tensor([2, 4], dtype=torch.int32, device=device)
    out = [call() for call in calls]
    torch.testing.assert_close(out[0], torch.stack([y[0], y[2]]), rtol=0, atol=0)
    assert out[1].sum().item() == 6 and (out[1][0] == 1).all() and (out[1][2] == 1).all()
    torch.testing.assert_close(out[2], torch.tensor([[3.0, 0.0], [0.0, 21.0]], device=device))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="routing index out of range"):
        groupmm.grouped_mm(y, w, offs=offs)
    assert not groupmm._native.take_offs_error(dev), "the error is reported once"
    groupmm.grouped_mm(y, w, offs=offs)  # and the next call runs


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_int32_index(device):
    base = torch.randn(10, 16, dtype=F64, device=device)
    y = base[:, ::2]  # strided: copied to contiguous by the wrapper
    inv = torch.tensor([[1, 3], [5, 7], [9, 0]], dtype=torch.int32, device=device)
    ref = y[inv[:, 0].long()] + y[inv[:, 1].long()]
    torch.testing.assert_close(_rows.gather_sum(y, inv), ref)
    pre = base.t()  # [16, 10]
    gate, up = pre.chunk(2, dim=-1)
    torch.testing.assert_close(_rows.swiglu(pre), F.silu(gate) * up)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    y = torch.randn(0, 4, device=device)
    inv = torch.zeros(0, 2, dtype=torch.long, device=device)
    assert _rows.gather_sum(y, inv).shape == (0, 4)
    assert _rows.scatter_rows(torch.zeros(0, 4, device=device), inv, None, 3).abs().sum() == 0
    assert _rows.row_dots(torch.zeros(0, 4, device=device), y, inv, torch.float32).shape == (0, 2)
    assert _rows.swiglu(torch.randn(0, 6, device=device)).shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    pre = torch.randn(6, 8, generator=gen).to(device)
    grad = torch.randn(6, 4, generator=gen).to(device)
    inv = torch.randperm(6, generator=gen).view(3, 2).to(device)
    w = torch.rand(3, 2, generator=gen).to(device)
    y = torch.randn(6, 4, generator=gen).to(device)
    g = torch.randn(3, 4, generator=gen).to(device)
    ops = torch.ops.groupmm
    cases = [
        (ops.swiglu, (pre,)),
        (ops.swiglu_backward, (grad, pre)),
        (ops.gather_sum, (y, inv, w)),
        (ops.gather_sum, (y, inv, None)),
        (ops.scatter_rows, (g, inv, w, 7)),
        (ops.row_dots, (g, y, inv, torch.float32)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(8, 4, generator=gen).to(device)
    inv = torch.randperm(8, generator=gen).view(4, 2).to(device)
    w = torch.rand(4, 2, generator=gen).to(device)

    def f(y, inv, w):
        out = _rows.gather_sum(y, inv, w)
        return _rows.scatter_rows(out, inv, w, 8) + _rows.swiglu(torch.cat([y, y], 1))

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(y, inv, w), f(y, inv, w))


def test_errors_name_the_argument():
    from groupmm import _native

    y = torch.randn(4, 3)
    inv = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"grad: expected shape \[2, 3\] \(\[rows of inverse"):
        _native.scatter_rows(torch.randn(3, 3), inv, None, 4)
    with pytest.raises(TypeError, match="inverse: expected an integer dtype"):
        _native.gather_sum(y, inv.float())
    with pytest.raises(TypeError, match="weights: expected dtype torch.float32"):
        _native.gather_sum(y, inv, torch.ones(2, 2, dtype=F64))
    with pytest.raises(ValueError, match="weights: expected shape"):
        _native.gather_sum(y, inv, torch.ones(2, 3))
    with pytest.raises(ValueError, match="pre: expected an even last dimension"):
        _native.swiglu(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"pre: expected shape \[4, 2\]"):
        _native.swiglu_backward(torch.randn(4, 1), torch.randn(4, 3))
    with pytest.raises(TypeError, match=r"pre: expected dtype torch.float32 \(the dtype of grad\)"):
        _native.swiglu_backward(torch.randn(4, 1), torch.randn(4, 2, dtype=F64))
    wide = "out_dtype: expected None or the input dtype torch.float64 or torch.float32"
    with pytest.raises(TypeError, match=wide):
        _native.row_dots(torch.randn(2, 3, dtype=F64), y.double(), inv, torch.float16)
    with pytest.raises(TypeError, match="inverse: expected a torch.Tensor like y"):
        _native.gather_sum(y, inv.numpy())


def test_operands_normalised_by_the_extension():
    """Strided rows are copied and any integer index converted to int32 once, in Rust;
    numpy arrays take the same path."""
    import numpy as np
    from groupmm import _native

    base = torch.randn(4, 6)
    y = base[:, ::2]
    for inv in (torch.tensor([[0, 3], [2, 2]]), torch.tensor([[0, 2], [3, 2]]).t().to(torch.int16)):
        ref = y[inv[:, 0].long()] + y[inv[:, 1].long()]
        torch.testing.assert_close(_native.gather_sum(y, inv), ref, rtol=0, atol=1e-6)
        out = _native.gather_sum(y.numpy(), inv.numpy())
        assert isinstance(out, np.ndarray)
        np.testing.assert_allclose(out, ref.numpy(), rtol=0, atol=1e-6)
    pre = base.t()  # [6, 4], column-major
    gate, up = pre.chunk(2, dim=-1)
    torch.testing.assert_close(_native.swiglu(pre), F.silu(gate) * up)
    inv = torch.tensor([[1], [0], [3], [2]])
    dots = _native.row_dots(y, y, inv)
    assert dots.dtype == torch.float32
    torch.testing.assert_close(dots, (y * y[inv[:, 0]]).sum(1, keepdim=True))
