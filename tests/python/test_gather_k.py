"""The GroupedK product with gathered rows, ``_native.gather_k_mm(a, b, offs, src,
gathered_b, transposed)``: ``out[g] = Σ a_rᵀ @ b_r`` over the routed rows ``r`` of group
``g``, each routed row reading ``a[src[r]]`` and ``b[r]`` (or ``a[r]`` and ``b[src[r]]``)
— the weight gradients of a routed expert layer on tokens kept in token order, with no
``[R, d]`` copy of them. On Hopper a GroupedK request reads the rows through ``src``
where a kernel does; elsewhere, and on the CPU, the rows are gathered first. Both
against a float64 reference written with torch indexing and ``einsum``, group by group:
empty groups, rows past the last group, both gathered operands, both output layouts
(``transposed``: the view of a fresh ``[G, N, K]``), int32 and int64 ``src``, strided
operands, the empty cases, out-of-range indices (an error: at once on the CPU, at the
next call on CUDA) and the argument errors. Also ``_native.product("dgated")``'s ``src``
(``dy`` in token order): None on the CPU, the same as ``dy[src]`` on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICES, F64, HAS_CUDA, TOL
from groupmm import _native

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")


def ends(counts, device):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def rows_of(t, idx):
    """float64 ``t[idx]``, a zero row where ``idx`` is out of range."""
    out = torch.zeros(idx.shape[0], t.shape[1], dtype=F64, device=t.device)
    ok = (idx >= 0) & (idx < t.shape[0])
    out[ok] = t[idx[ok].long()].double()
    return out


def ref(a, b, offs, src, gathered_b=False):
    """float64 ``[G, K, N]``: group g sums ``a_rᵀ b_r`` over its routed rows; rows past
    the last group belong to no group."""
    ar = a.double() if gathered_b else rows_of(a, src)
    br = rows_of(b, src) if gathered_b else b.double()
    out = torch.zeros(offs.shape[0], a.shape[1], b.shape[1], dtype=F64, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = torch.einsum("rk,rn->kn", ar[start:end], br[start:end])
        start = end
    return out


def check(out, expect, dtype, sizes):
    assert out.shape == expect.shape
    assert not torch.isnan(out).any(), "an output element was not written"
    err = (out.double() - expect).norm() / max(expect.norm().item(), 1e-30)
    assert err <= TOL[dtype], f"relative error {err:.2e} ({dtype})"
    for g, n in enumerate(sizes):
        if n == 0:
            assert (out[g] == 0).all(), f"group {g} is empty: exact zeros"


def operands(Ts, R, K, N, gathered_b, device, dtype, gen):
    """``a`` and ``b``: the gathered one with ``Ts`` rows, the other with ``R``."""
    ta, tb = (R, Ts) if gathered_b else (Ts, R)
    a = torch.randn(ta, K, generator=gen, dtype=F64).to(device, dtype)
    b = torch.randn(tb, N, generator=gen, dtype=F64).to(device, dtype)
    return a, b


def routing(T, R, device, gen):
    """src [R]: source rows (repeats allowed), int32."""
    return torch.randint(0, T, (R,), generator=gen, dtype=torch.int32).to(device)


def run(a, b, offs, src, gathered_b, transposed):
    out = _native.gather_k_mm(a, b, offs, src, gathered_b=gathered_b, transposed=transposed)
    if transposed:
        assert out.transpose(-2, -1).is_contiguous(), "a view of a fresh [G, N, K]"
    else:
        assert out.is_contiguous()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, F64])
@pytest.mark.parametrize("gathered_b", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("src_dtype", [torch.int32, torch.int64])
def test_matches_reference(device, dtype, gathered_b, transposed, src_dtype):
    gen = torch.Generator().manual_seed(3)
    sizes, past = [3, 0, 17, 9, 0, 1], 4
    T, K, N = 11, 24, 16
    R = sum(sizes) + past
    a, b = operands(T, R, K, N, gathered_b, device, dtype, gen)
    src = routing(T, R, device, gen)
    offs = ends(sizes, device)
    out = run(a, b, offs, src.to(src_dtype), gathered_b, transposed)
    assert out.dtype == dtype and out.device == a.device
    check(out, ref(a, b, offs, src, gathered_b), dtype, sizes)
    # the two layouts hold the same values, bit for bit on the CPU
    other = run(a, b, offs, src, gathered_b, not transposed)
    if device == "cpu":
        assert torch.equal(out, other)
    else:
        check(other, ref(a, b, offs, src, gathered_b), dtype, sizes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gathered_b", [False, True])
def test_strided_operands_and_src(device, gathered_b):
    """Operands of any strides (copied where a kernel cannot read them), a
    non-contiguous ``src``: the same values as contiguous ones."""
    gen = torch.Generator().manual_seed(4)
    sizes = [5, 12, 0, 7]
    T, K, N = 9, 32, 24
    R = sum(sizes)
    a, b = operands(T, R, K, N, gathered_b, device, torch.float32, gen)
    src = routing(T, R, device, gen)
    offs = ends(sizes, device)
    expect = _native.gather_k_mm(a, b, offs, src, gathered_b)
    check(expect, ref(a, b, offs, src, gathered_b), torch.float32, sizes)
    wide_a = torch.zeros(a.shape[0], K + 8, device=device)
    wide_a[:, 3 : 3 + K] = a
    col_b = b.t().contiguous().t()  # column-major
    wide = torch.stack([src, torch.zeros_like(src)], 1)[:, 0]
    for transposed in (False, True):
        got = _native.gather_k_mm(wide_a[:, 3 : 3 + K], col_b, offs, wide, gathered_b, transposed)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gathered_b", [False, True])
def test_empty_cases(device, gathered_b):
    K, N = 8, 5
    none = torch.zeros(0, dtype=torch.int32, device=device)
    a, b = (torch.randn(0, K, device=device), torch.randn(4, N, device=device))
    if not gathered_b:
        a, b = torch.randn(4, K, device=device), torch.randn(0, N, device=device)
    # nothing routed: every group empty
    for transposed in (False, True):
        out = _native.gather_k_mm(a, b, ends([0, 0, 0], device), none, gathered_b, transposed)
        assert out.shape == (3, K, N) and torch.equal(out, torch.zeros(3, K, N, device=device))
    # no groups
    no_groups = torch.zeros(0, dtype=torch.int32, device=device)
    assert _native.gather_k_mm(a, b, no_groups, none, gathered_b).shape == (0, K, N)
    # rows routed, but no group owns one
    src = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    x, y = torch.randn(4, K, device=device), torch.randn(3, N, device=device)
    if gathered_b:
        x, y = torch.randn(3, K, device=device), torch.randn(4, N, device=device)
    out = _native.gather_k_mm(x, y, ends([0, 0], device), src, gathered_b)
    assert torch.equal(out, torch.zeros(2, K, N, device=device))


def test_numpy_arrays():
    """numpy arrays in, numpy arrays out (the extension's other kind)."""
    rng = np.random.default_rng(0)
    sizes = [2, 0, 3]
    a, b = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    src = np.array([5, 0, 0, 2, 1, 4], dtype=np.int64)
    offs = np.cumsum(sizes).astype(np.int32)
    out = _native.gather_k_mm(a, b, offs, src)
    assert isinstance(out, np.ndarray) and out.shape == (3, 4, 3)
    expect = ref(
        torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(offs), torch.from_numpy(src)
    )
    np.testing.assert_allclose(out, expect.numpy(), rtol=1e-12, atol=1e-12)
    out_t = _native.gather_k_mm(a, b, offs, src, transposed=True)
    np.testing.assert_allclose(out_t, expect.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gathered_b", [False, True])
def test_out_of_range_src_is_an_error(device, gathered_b):
    """An out-of-range routing index is never read and never silently a zero row: the
    CPU raises at once; CUDA reads zeros for it and raises at the device's next call (no
    host sync)."""
    gen = torch.Generator().manual_seed(5)
    sizes = [3, 0, 17, 9]
    T, K, N = 11, 24, 16
    R = sum(sizes) + 2
    a, b = operands(T, R, K, N, gathered_b, device, torch.bfloat16, gen)
    offs = ends(sizes, device)
    for bad in (-3, T, T + 5):
        src = routing(T, R, device, gen)
        src[7] = bad
        if device == "cpu":
            with pytest.raises(ValueError, match=rf"routing index {bad} at position 7"):
                _native.gather_k_mm(a, b, offs, src, gathered_b)
            continue
        out = _native.gather_k_mm(a, b, offs, src, gathered_b)
        check(out, ref(a, b, offs, src, gathered_b), torch.bfloat16, sizes)  # zeros read
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="routing index out of range"):
            _native.gather_k_mm(a, b, offs, src.clamp(0, T - 1), gathered_b)
        assert not _native.take_offs_error(torch.cuda.current_device())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, F64])
@pytest.mark.parametrize("gathered_b", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_out_a_slab_of_a_larger_gradient(device, dtype, gathered_b, transposed):
    """``out=``: written in place where the kernels can (here a slab of columns of
    ``a``'s side of a larger gradient, in both layouts: what the MoE backward does, one
    slab of x's columns at a time), returned as the same object; the rest of the larger
    tensor is untouched."""
    gen = torch.Generator().manual_seed(8)
    sizes, T, K, N = [5, 0, 9, 3], 7, 128, 64
    R = sum(sizes)
    a, b = operands(T, R, K, N, gathered_b, device, dtype, gen)
    src, offs = routing(T, R, device, gen), ends(sizes, device)
    whole = ref(a, b, offs, src, gathered_b)
    big = torch.full((len(sizes), K + 64, N), 7.0, dtype=dtype, device=device)
    if transposed:  # a column-major gradient: the transposed view of [G, N, K + 64]
        big = big.transpose(-2, -1).contiguous().transpose(-2, -1)
    c0, c1 = 64, 64 + K // 2
    for lo, hi in ((c0, c1), (c1, c0 + K)):
        slab = big[:, lo:hi]
        got = _native.gather_k_mm(
            a[:, lo - c0 : hi - c0], b, offs, src, gathered_b, transposed, slab
        )
        assert got is slab
    check(big[:, c0:], whole, dtype, sizes)
    assert (big[:, :c0] == 7).all(), "outside the slabs: untouched"
    # every other column: on CUDA no kernel writes it as it is (through a fresh output)
    odd = torch.zeros(len(sizes), K, 2 * N, dtype=dtype, device=device)[:, :, ::2]
    got = _native.gather_k_mm(a, b, offs, src, gathered_b, transposed, odd)
    assert got is odd
    check(odd, whole, dtype, sizes)


def test_errors():
    a, b = torch.randn(4, 8), torch.randn(3, 5)
    offs = ends([1, 2], "cpu")
    src = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^a: expected a 2-D tensor \[Ta, K\]"):
        _native.gather_k_mm(a[None], b, offs, src)
    with pytest.raises(ValueError, match=r"^a: expected a 2-D tensor \[R, K\]"):
        _native.gather_k_mm(a[0], b, offs, src, gathered_b=True)
    with pytest.raises(ValueError, match=r"^b: expected a 2-D tensor \[R, N\]"):
        _native.gather_k_mm(a, b[0], offs, src)
    with pytest.raises(ValueError, match=r"^b: expected a 2-D tensor \[Tb, N\]"):
        _native.gather_k_mm(torch.randn(3, 8), b[None], offs, src, gathered_b=True)
    with pytest.raises(ValueError, match=r"^src: expected a 1-D tensor \[R\]"):
        _native.gather_k_mm(a, b, offs, src[None])
    with pytest.raises(ValueError, match=r"^b: expected shape \[R=3, N\] \(R = len\(src\)"):
        _native.gather_k_mm(a, torch.randn(4, 5), offs, src)
    with pytest.raises(ValueError, match=r"^a: expected shape \[R=3, K\] \(R = len\(src\)"):
        _native.gather_k_mm(a, b, offs, src, gathered_b=True)
    with pytest.raises(TypeError, match=r"^src: expected an integer dtype"):
        _native.gather_k_mm(a, b, offs, src.float())
    with pytest.raises(TypeError, match=r"^b: expected dtype torch.float32 \(the dtype of a\)"):
        _native.gather_k_mm(a, b.double(), offs, src)
    with pytest.raises(ValueError, match=r"^offs: expected a 1-D tensor"):
        _native.gather_k_mm(a, b, offs[None], src)
    with pytest.raises(ValueError, match=r"^offs"):
        _native.gather_k_mm(a, b, ends([1, 2, 3], "cpu"), src)  # ends past R
    with pytest.raises(TypeError, match=r"^a: expected a torch.Tensor or numpy.ndarray"):
        _native.gather_k_mm(None, b, offs, src)
    # out: shape, dtype, memory shared with an input
    with pytest.raises(ValueError, match=r"^out: expected shape \[2, 8, 5\], found \[2, 5, 8\]"):
        _native.gather_k_mm(a, b, offs, src, out=torch.empty(2, 5, 8))
    with pytest.raises(TypeError, match=r"^out: expected dtype torch.float32"):
        _native.gather_k_mm(a, b, offs, src, out=torch.empty(2, 8, 5, dtype=F64))
    shared = torch.empty(2 * 8 * 5 + 32)
    with pytest.raises(ValueError, match=r"^out: must not share memory with the input a"):
        _native.gather_k_mm(shared[:32].view(4, 8), b, offs, src, out=shared[:80].view(2, 8, 5))


@pytest.mark.cuda
@needs_cuda
def test_device_mismatch_names_the_argument():
    a, b = torch.randn(4, 8, device="cuda"), torch.randn(3, 5, device="cuda")
    offs = ends([1, 2], "cuda")
    src = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match=r"^b: expected a tensor on cuda:0"):
        _native.gather_k_mm(a, b.cpu(), offs, src)
    with pytest.raises(RuntimeError, match=r"^src: expected a tensor on cuda:0"):
        _native.gather_k_mm(a, b, offs, src.cpu())


# ------------------------------------------------------------------------ CUDA boundaries

#: group sizes (routed rows, the reduction) at residues of the 64-row k-block, with empties
K_RESIDUES = [0, 1, 63, 64, 65, 127, 128, 129, 0, 5, 200]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gathered_b", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K,N", [(64, 128), (200, 72), (72, 200), (136, 264)])
def test_residues_on_the_gpu(dtype, gathered_b, transposed, K, N):
    """M = K and N multiples of 8 (not all of 64 or 128), group lengths at every residue
    of the k-block, total rows not a multiple of 64, rows past the last group."""
    gen = torch.Generator().manual_seed(K * 1000 + N)
    T, past = 301, 7
    R = sum(K_RESIDUES) + past
    a, b = operands(T, R, K, N, gathered_b, "cuda", dtype, gen)
    for t in (a, b):
        t.div_(4)
    src = routing(T, R, "cuda", gen)
    offs = ends(K_RESIDUES, "cuda")
    out = run(a, b, offs, src, gathered_b, transposed)
    check(out, ref(a, b, offs, src, gathered_b), dtype, K_RESIDUES)
    again = _native.gather_k_mm(a, b, offs, src, gathered_b, transposed)
    assert torch.equal(out, again), "not deterministic"


@pytest.mark.cuda
@needs_cuda
def test_weight_gradients_of_the_layer_without_a_copy_of_x():
    """The MoE backward's two weight gradients: ``x[src]ᵀ·d_pre`` reads x through src,
    ``act_sᵀ·dy[src]``-style with the gathered B; both match torch's grouped product of
    the gathered rows."""
    gen = torch.Generator().manual_seed(9)
    sizes = [40, 0, 77, 131, 3, 0, 64]
    T, D, F2 = 200, 256, 192
    R = sum(sizes)
    x = torch.randn(T, D, generator=gen, dtype=F64).to("cuda", torch.bfloat16)
    d_pre = torch.randn(R, F2, generator=gen, dtype=F64).to("cuda", torch.bfloat16)
    src = routing(T, R, "cuda", gen)
    offs = ends(sizes, "cuda")
    dw = _native.gather_k_mm(x, d_pre, offs, src)
    plain = _native.grouped_mm(x[src.long()].t(), d_pre, offs)
    check(dw, ref(x, d_pre, offs, src), torch.bfloat16, sizes)
    check(plain, ref(x, d_pre, offs, src), torch.bfloat16, sizes)
    dw_t = _native.gather_k_mm(d_pre, x, offs, src, gathered_b=True)
    check(dw_t, ref(d_pre, x, offs, src, True), torch.bfloat16, sizes)


# ------------------------------------------------------------------------ dgated_mm's src


def _dgated_case(device, dtype, T=50, D=64, Fh=72, sizes=(30, 0, 41, 9), seed=6):
    gen = torch.Generator().manual_seed(seed)
    R = sum(sizes) + 3
    d_out = torch.randn(T, D, generator=gen, dtype=F64).to(device, dtype)
    w = (torch.randn(len(sizes), Fh, D, generator=gen, dtype=F64) / D**0.5).to(device, dtype)
    pre = torch.randn(R, 2 * Fh, generator=gen, dtype=F64).to(device, dtype)
    scale = torch.rand(R, generator=gen).to(device)
    src = routing(T, R, device, gen)
    return d_out, w, ends(list(sizes), device), pre, scale, src


def test_dgated_mm_with_src_answers_none_on_cpu():
    d_out, w, offs, pre, scale, src = _dgated_case("cpu", torch.bfloat16)
    assert _native.product("dgated", d_out, w, offs, (pre, scale), src) is None
    assert _native.product("dgated", d_out, w, offs, (pre, scale), src=src.long()) is None
    assert _native.product("dgated", d_out[src.long()], w, offs, (pre, scale)) is None


def test_dgated_mm_with_src_errors():
    d_out, w, offs, pre, scale, src = _dgated_case("cpu", torch.bfloat16)
    with pytest.raises(ValueError, match=r"^src: expected a 1-D tensor \[R\]"):
        _native.product("dgated", d_out, w, offs, (pre, scale), src[None])
    with pytest.raises(
        ValueError, match=r"^pre: expected shape \[\d+, 144\] \(\[R, 2F\]: R = len\(src\)"
    ):
        _native.product("dgated", d_out, w, offs, (pre[1:], scale), src)
    with pytest.raises(
        ValueError, match=r"^scale: expected shape \[\d+\] \(one router weight per routed row"
    ):
        _native.product("dgated", d_out, w, offs, (pre, scale[1:]), src)
    with pytest.raises(ValueError, match=r"^dy: expected a 2-D tensor \[T, D\]"):
        _native.product("dgated", d_out[0], w, offs, (pre, scale), src)
    with pytest.raises(TypeError, match=r"^src: expected an integer dtype"):
        _native.product("dgated", d_out, w, offs, (pre, scale), src.float())


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dgated_mm_with_src_equals_gathered_rows(dtype):
    """``dgated_mm(d_out, …, src)`` is ``dgated_mm(d_out[src], …)``: both None (no fused
    kernel here) or the same outputs."""
    d_out, w, offs, pre, scale, src = _dgated_case("cuda", dtype)
    got = _native.product("dgated", d_out, w, offs, (pre, scale), src)
    want = _native.product("dgated", d_out[src.long()].contiguous(), w, offs, (pre, scale))
    assert (got is None) == (want is None)
    if got is None:
        return
    for name, g, e in zip(("dpre", "act", "partial"), got, want):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        err = (g.double() - e.double()).norm() / max(e.double().norm().item(), 1e-30)
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e}"
