"""CUDA: the boundaries of groupmm's own sm_90a varlen kernels (cuda/kernels/varlen/),
which serve the fine-grained packed forms on Hopper: x [T, K] @ w [G, K, N] (forward, and dX
through a transposed weight view) and x.T @ dy grouped along T (dW).

Against a float64 reference: group sizes at every residue modulo the 128-row tile, K and T
not multiples of 64, empty groups first/last/all, one group holding every row, G = 4096,
both weight majors, strided activations, outputs poisoned with NaN (every element written),
bad offs (clamped, reported at the next call), CUDA-graph replays with new offs, bitwise
determinism. On a Hopper GPU the profiler must show the varlen kernel doing the work.

Skipped without a GPU or a CUDA build of groupmm.
"""

import groupmm
import pytest
import torch
from conftest import CUDA_ONLY, dev_override

pytestmark = CUDA_ONLY

DEV = "cuda"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def hopper():
    archs = groupmm.build_info()["cuda_archs"]
    return torch.cuda.get_device_capability() == (9, 0) and "90a" in archs


def ends(counts):
    return torch.tensor(counts, device=DEV).cumsum(0).to(torch.int32)


def clamp_spans(offs, extent):
    """shape::clamp_spans: running max of offs clamped to [0, extent]."""
    spans, end = [], 0
    for v in offs:
        start = end
        end = max(end, min(max(int(v), 0), extent))
        spans.append((start, end))
    return spans


def ref_m(x, w, offs):
    x, w = x.double(), w.double()
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64, device=x.device)
    for g, (s, e) in enumerate(clamp_spans(offs.tolist(), x.shape[0])):
        out[s:e] = x[s:e] @ w[g]
    return out


def ref_k(xt, dy, offs):
    xt, dy = xt.double(), dy.double()
    spans = clamp_spans(offs.tolist(), xt.shape[1])
    out = torch.zeros(len(spans), xt.shape[0], dy.shape[1], dtype=torch.float64, device=xt.device)
    for g, (s, e) in enumerate(spans):
        out[g] = xt[:, s:e] @ dy[s:e]
    return out


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den > 0 else (x - ref).norm().item()


def check(out, ref, dtype, zero_rows=None):
    assert not torch.isnan(out).any(), "an output element was not written"
    assert rel_err(out, ref) < TOL[dtype]
    if zero_rows is not None and zero_rows.any():
        assert (out[zero_rows] == 0).all(), "rows outside every group must be exact zeros"


def check_fwd_and_dw(x, w, offs, tail=None):
    """x @ w grouped by offs (varlen-M) and x.T @ dy (varlen-K) against float64."""
    check(groupmm.grouped_mm(x, w, offs=offs), ref_m(x, w, offs), x.dtype, tail)
    dy = torch.randn(x.shape[0], w.shape[2], device=DEV, dtype=x.dtype)
    check(groupmm.grouped_mm(x.t(), dy, offs=offs), ref_k(x.t(), dy, offs), x.dtype)


def kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_varlen_kernels_serve_fine_grained_shapes_on_hopper():
    if not hopper():
        pytest.skip("the varlen kernels are sm_90a only")
    if dev_override("GROUPMM_SM90_VARLEN") == "0":
        pytest.skip("GROUPMM_SM90_VARLEN=0 sends every call to the ptr-array kernels")
    G, K, N = 16, 256, 192
    offs = ends([100] * G)
    x = torch.randn(1600, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(1600, N, device=DEV, dtype=torch.bfloat16)
    for fn in (
        lambda: groupmm.grouped_mm(x, w, offs=offs),
        lambda: groupmm.grouped_mm(dy, w.transpose(1, 2), offs=offs),
        lambda: groupmm.grouped_mm(x.t(), dy, offs=offs),
    ):
        names = kernel_names(fn)
        assert any("varlen_kernel" in n for n in names), names
        # one launch: no argument builder, no ptr-array kernel
        assert not any("build_packed_args" in n or "GemmUniversal" in n for n in names), names


RESIDUES = [0, 1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_major", [False, True])
def test_forward_residues_both_weight_majors(dtype, k_major):
    torch.manual_seed(1)
    sizes = RESIDUES + [0, 5]
    G, K, N = len(sizes), 136, 264  # K, N: not multiples of 64
    T = sum(sizes) + 7  # rows past the last group
    offs = ends(sizes)
    x = torch.randn(T, K, device=DEV, dtype=dtype)
    if k_major:  # weights stored [G, N, K], used through a transposed view (the dX case)
        w = torch.randn(G, N, K, device=DEV, dtype=dtype).transpose(1, 2)
    else:
        w = torch.randn(G, K, N, device=DEV, dtype=dtype)
    out = torch.full((T, N), float("nan"), device=DEV, dtype=dtype)
    groupmm.grouped_mm(x, w, offs=offs, out=out)
    tail = torch.zeros(T, dtype=torch.bool, device=DEV)
    tail[sum(sizes) :] = True
    check(out, ref_m(x, w, offs), dtype, tail)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_gradient_residues(dtype):
    torch.manual_seed(2)
    sizes = RESIDUES + [0, 33]
    G, M, N = len(sizes), 200, 136
    T = sum(sizes) + 3  # tokens past the last group count for nothing
    offs = ends(sizes)
    x = torch.randn(T, M, device=DEV, dtype=dtype)
    dy = torch.randn(T, N, device=DEV, dtype=dtype)
    out = torch.full((G, M, N), float("nan"), device=DEV, dtype=dtype)
    groupmm.grouped_mm(x.t(), dy, offs=offs, out=out)
    ref = ref_k(x.t(), dy, offs)
    check(out, ref, dtype)
    for g, n in enumerate(sizes):
        if n == 0:
            assert (out[g] == 0).all(), f"empty group {g} must give exact zeros"


@pytest.mark.parametrize(
    "sizes",
    [[0, 0, 0, 0], [0, 37, 500, 0], [640], [0, 0, 1], [1, 0, 0]],
    ids=["all-empty", "empty-first-last", "one-group", "last-only", "first-only"],
)
def test_empty_groups_and_one_group(sizes):
    torch.manual_seed(3)
    G, K, N = len(sizes), 64, 128
    T = max(sum(sizes), 1) + 9
    offs = ends(sizes)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device=DEV, dtype=torch.bfloat16)
    tail = torch.zeros(T, dtype=torch.bool, device=DEV)
    tail[sum(sizes) :] = True
    check_fwd_and_dw(x, w, offs, tail)


def test_4096_groups():
    torch.manual_seed(4)
    sizes = [(g * 37) % 11 for g in range(4096)]
    T, K, N = sum(sizes), 64, 128
    offs = ends(sizes)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(4096, K, N, device=DEV, dtype=torch.bfloat16) / 8
    check_fwd_and_dw(x, w, offs)


def test_strided_activations_and_gradients():
    """A slice of a wider buffer (row stride > K) and a weight slice of a larger expert bank."""
    torch.manual_seed(5)
    sizes = [70, 0, 130, 41]
    G, K, N = len(sizes), 128, 64
    T = sum(sizes)
    offs = ends(sizes)
    xb = torch.randn(T, K + 64, device=DEV, dtype=torch.bfloat16)
    x = xb[:, 32 : 32 + K]  # row stride K + 64, 64-byte offset: still 16-byte aligned
    wb = torch.randn(G + 2, K, N, device=DEV, dtype=torch.bfloat16)
    w = wb[1 : 1 + G]
    check_fwd_and_dw(x, w, offs)


def test_autograd_through_the_varlen_kernels():
    torch.manual_seed(6)
    sizes = [90, 0, 200, 17]
    G, K, N = len(sizes), 64, 128
    T = sum(sizes) + 4
    offs = ends(sizes)
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(G, K, N, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    groupmm.grouped_mm(x, w, offs=offs).backward(gy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref_m(xd, wd, offs).backward(gy.double())
    assert rel_err(x.grad, xd.grad) < 1e-2 and rel_err(w.grad, wd.grad) < 1e-2
    assert (x.grad[sum(sizes) :] == 0).all() and (w.grad[1] == 0).all()


def test_bad_offs_are_clamped_and_reported():
    torch.manual_seed(7)
    T, K, N = 100, 64, 64
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, K, N, device=DEV, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
    for bad in ([50, 20, 90], [-5, 20, 90], [10, 20, 1000]):
        offs = torch.tensor(bad, device=DEV, dtype=torch.int32)
        y = groupmm.grouped_mm(x, w, offs=offs)
        check(y, ref_m(x, w, offs), torch.bfloat16)
        torch.cuda.synchronize()
        with pytest.raises(ValueError, match="offs"):
            groupmm.grouped_mm(x, w, offs=offs)  # the report of the previous call
        dw = groupmm.grouped_mm(x.t(), dy, offs=offs)
        check(dw, ref_k(x.t(), dy, offs), torch.bfloat16)
        torch.cuda.synchronize()
        assert groupmm._native.take_offs_error(torch.cuda.current_device())


def test_graph_replay_sees_new_offs_and_is_deterministic():
    torch.manual_seed(8)
    G, K, N, T = 8, 128, 128, 1000
    x = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device=DEV, dtype=torch.bfloat16)
    offs = ends([125] * G)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        groupmm.grouped_mm(x, w, offs=offs)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = groupmm.grouped_mm(x, w, offs=offs)
    for sizes in ([125] * G, [0, 300, 1, 0, 250, 99, 0, 2], [1000] + [0] * (G - 1)):
        offs.copy_(ends(sizes))
        g.replay()
        torch.cuda.synchronize()
        check(y, ref_m(x, w, offs), torch.bfloat16)
        first = y.clone()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, y), "replays must be bitwise identical"
