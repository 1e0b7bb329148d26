"""The GroupedM product with gathered rows, ``_native.gather_mm(x, w, offs, src)``:
``out[r] = x[src[r]] @ w[g]`` for the rows ``r`` of group ``g`` — the MoE forward on
tokens in token order (``groupmm.fused.expert_up``). groupmm's varlen kernel can read the
rows through ``src`` with cp.async (cuda/kernels/varlen/), on Hopper by default; elsewhere,
on the CPU (and in a development build with GROUPMM_SM90_GATHER=0), the rows are gathered
first. Both against a
float64 reference written with torch indexing: group sizes at every residue modulo the
128-row tile, K not a multiple of 64 (and not of 8: the gathering fallback), empty groups,
rows past the last group, out-of-range indices (an error: at once on the CPU, at the next
call on CUDA), repeated indices,
strided activations, both weight majors, G = 1024, float32 output, outputs poisoned with
NaN, CUDA-graph replays with new routing, bitwise determinism, and the errors."""

from __future__ import annotations

import groupmm
import pytest
import torch
from conftest import DEVICES, HAS_CUDA, TOL, dev_override
from groupmm import _native
from groupmm._fused_ops import reads_in_gemm

F64 = torch.float64
RESIDUES = [0, 1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257]


def ends(counts, device):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def ref(x, w, offs, src):
    """float64: rows of group g gather x through src; rows whose src is out of range
    and rows past the last group are zero."""
    x, w = x.double(), w.double()
    R, N = src.shape[0], w.shape[2]
    a = torch.zeros(R, x.shape[1], dtype=F64, device=x.device)
    ok = (src >= 0) & (src < x.shape[0])
    a[ok] = x[src[ok].long()]
    out = torch.zeros(R, N, dtype=F64, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        end = min(max(end, start), R)
        out[start:end] = a[start:end] @ w[g]
        start = end
    return out


def check(out, expect, dtype, past=0):
    assert not torch.isnan(out).any(), "an output element was not written"
    err = (out.double() - expect).norm() / max(expect.norm().item(), 1e-30)
    assert err <= 2 * TOL[dtype], f"relative error {err:.2e}"
    if past:
        assert (out[-past:] == 0).all(), "rows past the last group must be exact zeros"


def routing(T, sizes, past, device, gen, bad=0):
    """src [R]: token ids (repeats allowed), `bad` of them out of range."""
    R = sum(sizes) + past
    src = torch.randint(0, T, (R,), generator=gen, dtype=torch.int32)
    if bad:
        pos = torch.randperm(R, generator=gen)[:bad]
        src[pos[: bad // 2]] = -3
        src[pos[bad // 2 :]] = T + 5
    return src.to(device)


def hopper():
    return (
        HAS_CUDA
        and torch.cuda.get_device_capability() == (9, 0)
        and "90a" in groupmm.build_info()["cuda_archs"]
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, F64])
def test_every_dtype(device, dtype):
    gen = torch.Generator().manual_seed(1)
    sizes = [3, 0, 17, 9, 0]
    T, K, N = 11, 24, 16
    x = torch.randn(T, K, generator=gen, dtype=F64).to(device, dtype)
    w = torch.randn(len(sizes), K, N, generator=gen, dtype=F64).to(device, dtype)
    src = routing(T, sizes, 4, device, gen)
    offs = ends(sizes, device)
    out = _native.gather_mm(x, w, offs, src)
    assert out.shape == (src.shape[0], N) and out.dtype == dtype
    check(out, ref(x, w, offs, src), dtype, past=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [24, 20])
def test_out_of_range_src_is_an_error(device, K):
    """An out-of-range routing index is never read and never silently a zero row: the
    CPU raises at once; CUDA reads zeros for it and raises at the device's next call (no
    host sync), once, whether the rows are gathered first or inside the GEMM (K = 20: rows
    of 40 bytes, which no kernel reads through src, so the call gathers them itself and
    runs again; that gather's error too waits for the next call)."""
    gen = torch.Generator().manual_seed(5)
    sizes = [3, 0, 17, 9]
    T, N = 11, 16
    x = torch.randn(T, K, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(len(sizes), K, N, generator=gen).to(device, torch.bfloat16)
    offs = ends(sizes, device)
    for bad in (-3, T, T + 5):
        src = routing(T, sizes, 2, device, gen)
        src[7] = bad
        if device == "cpu":
            with pytest.raises(ValueError, match=rf"routing index {bad} at position 7"):
                _native.gather_mm(x, w, offs, src)
            continue
        out = _native.gather_mm(x, w, offs, src)
        check(out, ref(x, w, offs, src), torch.bfloat16, past=2)  # the bad row reads zeros
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="routing index out of range"):
            _native.gather_mm(x, w, offs, src.clamp(0, T - 1))
        assert not _native.take_offs_error(torch.cuda.current_device())


@pytest.mark.parametrize("device", DEVICES)
def test_float32_output_strided_x_and_transposed_weights(device):
    gen = torch.Generator().manual_seed(2)
    sizes = [5, 12, 0, 7]
    T, K, N = 9, 32, 24
    base = torch.randn(T, K + 8, generator=gen, dtype=F64).to(device, torch.bfloat16)
    x = base[:, 3 : 3 + K]  # row stride K + 8, unaligned start
    w = torch.randn(len(sizes), N, K, generator=gen, dtype=F64).to(device, torch.bfloat16)
    w = w.transpose(1, 2)
    src = routing(T, sizes, 0, device, gen)
    offs = ends(sizes, device)
    out = _native.gather_mm(x, w, offs, src, torch.float32)
    assert out.dtype == torch.float32
    check(out, ref(x, w, offs, src), torch.bfloat16)
    # a non-contiguous src, and an int64 one, read the same rows (converted once)
    wide = torch.stack([src, torch.zeros_like(src)], 1)[:, 0]
    assert torch.equal(_native.gather_mm(x, w, offs, wide, torch.float32), out)
    assert torch.equal(_native.gather_mm(x, w, offs, src.long(), torch.float32), out)
    assert torch.equal(_native.gather_mm(x, w, offs, wide.long(), torch.float32), out)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_cases(device):
    x = torch.randn(4, 8, device=device)
    w = torch.randn(3, 8, 5, device=device)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    assert _native.gather_mm(x, w, ends([0, 0, 0], device), none).shape == (0, 5)
    src = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    out = _native.gather_mm(x, w, ends([0, 0, 0], device), src)
    assert torch.equal(out, torch.zeros(3, 5, device=device))  # no group owns a row


def test_errors():
    x = torch.randn(4, 8)
    w = torch.randn(2, 8, 5)
    offs = ends([1, 2], "cpu")
    src = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="x: expected a 2-D tensor"):
        _native.gather_mm(x[None], w, offs, src)
    with pytest.raises(ValueError, match=r"w: expected 3-D weights \[G, K=8, N\]"):
        _native.gather_mm(x, torch.randn(2, 7, 5), offs, src)
    with pytest.raises(ValueError, match="src: expected a 1-D tensor"):
        _native.gather_mm(x, w, offs, src[None])
    with pytest.raises(TypeError, match="src: expected an integer dtype"):
        _native.gather_mm(x, w, offs, src.float())
    with pytest.raises(TypeError, match="w: expected dtype torch.float32"):
        _native.gather_mm(x, w.double(), offs, src)
    with pytest.raises(ValueError, match="offs"):
        _native.gather_mm(x, w, ends([1, 2, 3], "cpu"), src)


# ------------------------------------------------------------------------ CUDA boundaries

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("K", [136, 200, 100])  # 100: rows not 16-byte aligned (fallback)
def test_residues_on_the_gpu(dtype, k_major, K):
    gen = torch.Generator().manual_seed(K)
    sizes = RESIDUES + [0, 5]
    T, N, past = 301, 264, 7
    x = torch.randn(T, K, generator=gen, dtype=F64).to("cuda", dtype)
    if k_major:
        w = torch.randn(len(sizes), N, K, generator=gen, dtype=F64).to("cuda", dtype)
        w = w.transpose(1, 2)
    else:
        w = torch.randn(len(sizes), K, N, generator=gen, dtype=F64).to("cuda", dtype)
    src = routing(T, sizes, past, "cuda", gen)
    offs = ends(sizes, "cuda")
    out = _native.gather_mm(x, w, offs, src)
    check(out, ref(x, w, offs, src), dtype, past=past)
    assert torch.equal(out, _native.gather_mm(x, w, offs, src)), "not deterministic"


@pytest.mark.cuda
@needs_cuda
def test_many_groups_and_one_group():
    gen = torch.Generator().manual_seed(5)
    T, K, N = 257, 64, 128
    x = torch.randn(T, K, generator=gen, dtype=F64).to("cuda", torch.bfloat16)
    for sizes in ([int(v) for v in torch.randint(0, 9, (1024,), generator=gen)], [0, 0, 777, 0]):
        w = torch.randn(len(sizes), K, N, generator=gen, dtype=F64).to("cuda", torch.bfloat16)
        src = routing(T, sizes, 3, "cuda", gen)
        offs = ends(sizes, "cuda")
        check(_native.gather_mm(x, w, offs, src), ref(x, w, offs, src), torch.bfloat16, past=3)


@pytest.mark.cuda
@needs_cuda
def test_which_kernels_run_and_graph_replay():
    """The gathering varlen kernel alone (no gather_sum) on Hopper, the default;
    gather-then-GEMM elsewhere and, in a development build, with GROUPMM_SM90_GATHER=0."""
    gen = torch.Generator().manual_seed(6)
    G, T, K, N, R = 8, 300, 128, 256, 1000
    x = torch.randn(T, K, generator=gen, dtype=F64).to("cuda", torch.bfloat16)
    w = torch.randn(G, K, N, generator=gen, dtype=F64).to("cuda", torch.bfloat16)
    src = routing(T, [R], 0, "cuda", gen)
    offs = ends([125] * G, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _native.gather_mm(x, w, offs, src)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    in_gemm = hopper() and dev_override("GROUPMM_SM90_GATHER") != "0"
    assert any("gather_sum" in n for n in names) != in_gemm, names
    if in_gemm:
        assert any("varlen_kernel" in n for n in names), names
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _native.gather_mm(x, w, offs, src)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _native.gather_mm(x, w, offs, src)
    for sizes in ([125] * G, [0, 300, 1, 0, 250, 99, 0, 350], [R] + [0] * (G - 1)):
        offs.copy_(ends(sizes, "cuda"))
        src.copy_(routing(T, [R], 0, "cuda", gen))
        g.replay()
        torch.cuda.synchronize()
        check(y, ref(x, w, offs, src), torch.bfloat16)
        first = y.clone()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, y), "replays must be bitwise identical"


def test_gathers_in_gemm_by_device_and_dtype():
    """``_native.gathers_in_gemm``, which the fused layer asks before handing ``src`` to
    both products that read ``dY[src]`` (``_fused_ops.reads_in_gemm``): a dtype name it
    does not know is a TypeError naming the argument; without a GPU a RuntimeError; on a
    GPU True exactly for the 16-bit dtypes on Hopper (unless a development build's
    GROUPMM_SM90_GATHER=0)."""
    with pytest.raises(TypeError, match="dtype"):
        _native.gathers_in_gemm(0, "torch.int8")
    assert not reads_in_gemm(torch.zeros(2, dtype=torch.bfloat16))  # CPU tensors: never
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            _native.gathers_in_gemm(0, "torch.bfloat16")
        return
    on = hopper() and dev_override("GROUPMM_SM90_GATHER") != "0"
    dev = torch.cuda.current_device()
    for dt in (torch.bfloat16, torch.float16):
        assert _native.gathers_in_gemm(dev, str(dt)) == on
        assert reads_in_gemm(torch.zeros(2, device="cuda", dtype=dt)) == on
    for dt in (torch.float32, torch.float64):
        assert not _native.gathers_in_gemm(dev, str(dt))
