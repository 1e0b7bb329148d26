"""CUDA tests: every form and dtype against a float64 reference, gradcheck on the GPU,
parity with torch's F.grouped_mm, CUDA graphs, no host sync, bad offs, streams.

Skipped without a GPU or without a CUDA build of groupmm.
"""

import threading

import groupmm
import pytest
import torch
from conftest import CUDA_ONLY

pytestmark = CUDA_ONLY

DEV = "cuda"


@pytest.fixture(autouse=True)
def no_stray_offs_errors(request):
    """Every test but the bad-offs one must leave no invalid-offs report behind."""
    yield
    if "bad_offs" not in request.node.name:
        torch.cuda.synchronize()
        assert not groupmm._native.take_offs_error(torch.cuda.current_device())


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def ends(counts, device=DEV):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def ref_packed(a, b, offs):
    """float64 reference written from ARCHITECTURE.md's table of forms, independent of groupmm."""
    a, b = a.double(), b.double()
    o = [] if offs is None else offs.tolist()
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64, device=a.device)
        s = 0
        for g, e in enumerate(o):
            out[s:e] = a[s:e] @ b[g]
            s = e
        return out
    if a.dim() == 2 and b.dim() == 2:
        out = torch.zeros(len(o), a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
        s = 0
        for g, e in enumerate(o):
            out[g] = a[:, s:e] @ b[s:e]
            s = e
        return out
    if a.dim() == 3 and b.dim() == 2:
        out = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
        s = 0
        for g, e in enumerate(o):
            out[:, s:e] = a[g] @ b[:, s:e]
            s = e
        return out
    return a @ b


def make(form, dtype, G=5, M=37, N=40, K=24, counts=None, device=DEV, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    counts = (
        counts if counts is not None else [int(c) for c in torch.randint(0, 20, (G,), generator=g)]
    )
    if len(counts) > 1:
        counts[1] = 0  # an empty group
    T = sum(counts) + 3  # 3 rows/cols past the last end
    offs = ends(counts, device)

    def r(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dtype)

    if form == "2d3d":
        return r(T, K), r(G, K, N), offs
    if form == "2d2d":
        return r(M, T), r(T, N), offs
    if form == "3d2d":
        return r(G, M, K), r(K, T), offs
    return r(G, M, K), r(G, K, N), None


FORMS = ["2d3d", "2d2d", "3d2d", "3d3d"]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contig", "a_t", "b_t", "both_t"])
def test_forward_backward_all_forms(form, dtype, layout):
    a, b, offs = make(form, dtype)
    if layout in ("a_t", "both_t"):
        a = a.mT.contiguous().mT  # same values, column-major storage
    if layout in ("b_t", "both_t"):
        b = b.mT.contiguous().mT
    a.requires_grad_()
    b.requires_grad_()
    y = groupmm.grouped_mm(a, b, offs=offs)
    assert y.is_contiguous() and y.dtype == dtype
    ref = ref_packed(a.detach(), b.detach(), offs)
    assert rel_err(y, ref) <= TOL[dtype]
    gy = torch.randn_like(y)
    y.backward(gy)
    ad = a.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_()
    ref_packed(ad, bd, offs).backward(gy.double())
    assert rel_err(a.grad, ad.grad) <= TOL[dtype]
    assert rel_err(b.grad, bd.grad) <= TOL[dtype]


@pytest.mark.parametrize("form", FORMS)
def test_tails_and_empty_groups_exact_zero(form):
    a, b, offs = make(form, torch.bfloat16, counts=[8, 0, 16, 0, 5])
    a.requires_grad_()
    b.requires_grad_()
    y = groupmm.grouped_mm(a, b, offs=offs)
    y.backward(torch.randn_like(y))
    if form == "2d3d":
        assert (y[offs[-1].item() :] == 0).all()
        assert (a.grad[offs[-1].item() :] == 0).all()
        assert (b.grad[1] == 0).all() and (b.grad[3] == 0).all()
    if form == "2d2d":
        assert (y[1] == 0).all() and (y[3] == 0).all()
    if form == "3d2d":
        assert (y[:, offs[-1].item() :] == 0).all()
        assert (b.grad[:, offs[-1].item() :] == 0).all()


def test_k_zero_gives_zeros():
    x = torch.randn(10, 0, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, 0, 16, device=DEV, dtype=torch.bfloat16)
    y = groupmm.grouped_mm(x, w, offs=ends([3, 3, 4]))
    assert y.shape == (10, 16) and (y == 0).all()
    As = [torch.randn(5, 0, device=DEV), torch.randn(3, 4, device=DEV)]
    Bs = [torch.randn(0, 7, device=DEV), torch.randn(4, 2, device=DEV)]
    out = groupmm.grouped_mm(As, Bs)
    assert (out[0] == 0).all() and rel_err(out[1], As[1].double() @ Bs[1].double()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_out_dtype_float32(dtype):
    a, b, offs = make("2d3d", dtype)
    y = groupmm.grouped_mm(a, b, offs=offs, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    assert rel_err(y, ref_packed(a, b, offs)) <= 1e-3


def test_tf32_honoured():
    a, b, offs = make("2d3d", torch.float32, G=3, K=512, N=256, counts=[200, 100, 300])
    ref = ref_packed(a, b, offs)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        full = rel_err(groupmm.grouped_mm(a, b, offs=offs), ref)
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = rel_err(groupmm.grouped_mm(a, b, offs=offs), ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert full < 1e-6, full
    assert tf32 < 5e-3


@pytest.mark.parametrize("form", FORMS)
def test_gradcheck_float64_cuda(form):
    a, b, offs = make(form, torch.float64, G=3, M=4, N=3, K=5, counts=[2, 0, 3])
    a.requires_grad_()
    b.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: groupmm.grouped_mm(x, y, offs=offs), (a, b))
    assert torch.autograd.gradgradcheck(lambda x, y: groupmm.grouped_mm(x, y, offs=offs), (a, b))


def test_list_form_random_shapes_and_layouts():
    g = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        shapes = [tuple(int(v) for v in torch.randint(0, 70, (3,), generator=g)) for _ in range(9)]
        shapes[0] = (5, 0, 7)
        As, Bs = [], []
        for i, (m, n, k) in enumerate(shapes):
            a = torch.randn(m, k, device=DEV, dtype=dtype)
            b = torch.randn(k, n, device=DEV, dtype=dtype)
            if i % 3 == 1:
                b = b.mT.contiguous().mT
            As.append(a.requires_grad_())
            Bs.append(b.requires_grad_())
        outs = groupmm.grouped_mm(As, Bs)
        for a, b, o in zip(As, Bs, outs):
            assert rel_err(o, a.detach().double() @ b.detach().double()) <= TOL[dtype]
        sum(o.float().sum() for o in outs).backward()
        for a, b in zip(As, Bs):
            ones = torch.ones(a.shape[0], b.shape[1], device=DEV, dtype=torch.float64)
            assert rel_err(a.grad, ones @ b.detach().double().mT) <= TOL[dtype]


def test_many_groups_over_1024():
    counts = [i % 3 for i in range(2000)]
    a, b, offs = make("2d3d", torch.bfloat16, G=2000, N=16, K=16, counts=counts)
    y = groupmm.grouped_mm(a, b, offs=offs)
    assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2


def test_unaligned_sizes_and_group_starts():
    for K, N in [(13, 7), (8, 9), (31, 33)]:
        for form in FORMS:
            a, b, offs = make(form, torch.bfloat16, K=K, N=N, counts=[3, 5, 1, 9, 2])
            y = groupmm.grouped_mm(a, b, offs=offs)
            assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2, (form, K, N)


def test_parity_with_torch_grouped_mm_bf16():
    f = getattr(torch.nn.functional, "grouped_mm", None)
    if f is None:
        pytest.skip("this torch has no F.grouped_mm")
    x = torch.randn(4096, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(8, 1024, 512, device=DEV, dtype=torch.bfloat16)
    offs = ends([512] * 8)
    ours = groupmm.grouped_mm(x, w, offs=offs)
    theirs = f(x, w, offs=offs)
    assert rel_err(ours, theirs) <= 1e-2


def test_expanded_gradient_layout():
    a, b, offs = make("2d3d", torch.bfloat16)
    a.requires_grad_()
    b.requires_grad_()
    groupmm.grouped_mm(a, b, offs=offs).sum().backward()  # stride-0 gradient
    ad = a.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_()
    ref_packed(ad, bd, offs).sum().backward()
    assert rel_err(a.grad, ad.grad) <= 1e-2 and rel_err(b.grad, bd.grad) <= 1e-2


def test_no_host_sync_packed_forms():
    cases = [make(f, torch.bfloat16) for f in FORMS]
    for a, b, offs in cases:  # warm-up (module load, workspace pools)
        groupmm.grouped_mm(a, b, offs=offs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for a, b, offs in cases:
            a.requires_grad_()
            b.requires_grad_()
            y = groupmm.grouped_mm(a, b, offs=offs)
            y.backward(torch.ones_like(y))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_capture_and_replay_sees_new_offs():
    a, b, offs = make("2d3d", torch.bfloat16, counts=[10, 20, 30, 5, 7])  # T = 55 (counts[1] -> 0)
    groupmm.grouped_mm(a, b, offs=offs)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = groupmm.grouped_mm(a, b, offs=offs)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2
    offs.copy_(ends([20, 0, 10, 20, 4]))  # new routing, same buffers (ends at 54 <= T)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2


@pytest.mark.parametrize("bad", [[5, 3, 20], [-4, 10, 12], [5, 10, 10_000]])
def test_bad_offs_never_out_of_bounds_and_reported(bad):
    x = torch.randn(20, 16, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 8, device=DEV, dtype=torch.bfloat16)
    offs = torch.tensor(bad, dtype=torch.int32, device=DEV)
    y = groupmm.grouped_mm(x, w, offs=offs)  # no sync, no crash: groups clamped
    torch.cuda.synchronize()
    clamped = []
    prev = 0
    for v in bad:
        e = max(min(max(v, 0), 20), prev)
        clamped.append(e)
        prev = e
    assert rel_err(y, ref_packed(x, w, torch.tensor(clamped))) <= 1e-2
    with pytest.raises(ValueError, match="offs"):
        groupmm.grouped_mm(x, w, offs=ends([5, 5, 10]))
    groupmm.grouped_mm(x, w, offs=ends([5, 5, 10]))  # flag cleared


def test_current_stream_and_concurrent_streams():
    cases = [make("2d3d", torch.bfloat16, seed=s) for s in range(4)]
    streams = [torch.cuda.Stream() for _ in cases]
    outs = [None] * len(cases)

    def work(i):
        with torch.cuda.stream(streams[i]):
            a, b, offs = cases[i]
            outs[i] = groupmm.grouped_mm(a, b, offs=offs)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    for (a, b, offs), y in zip(cases, outs):
        assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2


def test_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    a, b, offs = make("2d3d", torch.bfloat16, device="cuda:1")
    y = groupmm.grouped_mm(a, b, offs=offs)
    assert y.device == torch.device("cuda:1")
    assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2


def test_random_group_shapes_property():
    g = torch.Generator().manual_seed(7)
    for trial in range(40):
        form = FORMS[trial % 4]
        dtype = DTYPES[(trial // 4) % 4]
        G = int(torch.randint(1, 9, (1,), generator=g))
        dims = [int(v) for v in torch.randint(0, 80, (3,), generator=g)]
        counts = [int(v) for v in torch.randint(0, 40, (G,), generator=g)]
        a, b, offs = make(
            form, dtype, G=G, M=dims[0], N=dims[1], K=dims[2], counts=counts, seed=trial
        )
        y = groupmm.grouped_mm(a, b, offs=offs)
        assert rel_err(y, ref_packed(a, b, offs)) <= TOL[dtype], (form, dtype, G, dims, counts)


def test_compile_fullgraph_cuda():
    a, b, offs = make("2d3d", torch.bfloat16)
    a.requires_grad_()
    b.requires_grad_()

    def f(x, w):
        return torch.nn.functional.silu(groupmm.grouped_mm(x, w, offs=offs)).sum()

    cf = torch.compile(f, fullgraph=True)
    cf(a, b).backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    f(a, b).backward()
    assert rel_err(ga, a.grad) <= 1e-2 and rel_err(gb, b.grad) <= 1e-2


@pytest.mark.parametrize("form", FORMS)
def test_bitwise_deterministic_run_to_run(form):
    """No split-K or atomics: the same inputs give bitwise-identical outputs and grads."""
    a, b, offs = make(form, torch.bfloat16, M=300, N=256, K=512, counts=[200, 0, 90, 310, 7])
    outs = []
    for _ in range(3):
        x = a.clone().requires_grad_()
        w = b.clone().requires_grad_()
        y = groupmm.grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), x.grad, w.grad))
    for y, ga, gb in outs[1:]:
        assert torch.equal(y, outs[0][0])
        assert torch.equal(ga, outs[0][1]) and torch.equal(gb, outs[0][2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("N", [264, 13])  # 16-byte rows, and short odd rows
def test_zero_fill_overwrites_garbage(dtype, N):
    """Outputs no GEMM writes (empty groups of GroupedK, tails, k = 0) are written as
    zeros into an `out` full of NaN, whatever the row length and alignment."""
    counts = [0, 40, 0, 0, 300, 0, 9, 0]
    for form in FORMS[:3]:
        a, b, offs = make(form, dtype, G=len(counts), M=130, N=N, K=24, counts=list(counts))
        if form == "2d3d":  # a long tail of rows past offs[-1]
            a = torch.cat([a, torch.randn(700, a.shape[1], device=DEV, dtype=dtype)])
        if form == "3d2d":  # a wide tail of columns
            b = torch.cat([b, torch.randn(b.shape[0], 500, device=DEV, dtype=dtype)], dim=1)
        ref = ref_packed(a, b, offs)
        out = torch.full(ref.shape, float("nan"), device=DEV, dtype=dtype)
        groupmm.grouped_mm(a, b, offs=offs, out=out)
        assert not out.isnan().any(), form
        assert rel_err(out, ref) <= TOL[dtype], form
        assert (out[ref == 0] == 0).all(), form
    for form in FORMS:  # k = 0 (for GroupedK: every group empty): every element is zero
        counts = [0, 0, 0] if form == "2d2d" else [5, 0, 70]
        a, b, offs = make(form, dtype, G=3, M=66, N=N, K=0, counts=counts)
        out = torch.full(ref_packed(a, b, offs).shape, float("nan"), device=DEV, dtype=dtype)
        groupmm.grouped_mm(a, b, offs=offs, out=out)
        assert (out == 0).all(), form


def test_workspace_reuse_across_sizes_streams_and_graphs():
    """Back-to-back calls that share the per-stream workspace (growing and shrinking group
    counts, two streams), and eager calls between replays of a captured graph, all
    without a sync in between, each give the reference result."""
    sizes = [4, 300, 4, 1200, 17]
    cases = [
        make(
            "2d3d",
            torch.bfloat16,
            G=G,
            N=24,
            K=16,
            seed=G,
            counts=[(i * 7 + G) % 5 for i in range(G)],
        )
        for G in sizes
    ]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, (a, b, offs) in enumerate(cases):
        with torch.cuda.stream(side if i % 2 else torch.cuda.current_stream()):
            outs.append(groupmm.grouped_mm(a, b, offs=offs))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for (a, b, offs), y in zip(cases, outs):
        assert rel_err(y, ref_packed(a, b, offs)) <= 1e-2

    a, b, offs = make("2d2d", torch.bfloat16, G=6, M=40, N=48, counts=[9, 0, 30, 2, 0, 11])
    groupmm.grouped_mm(a, b, offs=offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = groupmm.grouped_mm(a, b, offs=offs)
    checks = []
    for a2, b2, offs2 in cases:
        graph.replay()
        checks.append((groupmm.grouped_mm(a2, b2, offs=offs2), ref_packed(a2, b2, offs2)))
        checks.append((y.clone(), None))
    torch.cuda.synchronize()
    ref = ref_packed(a, b, offs)
    for got, want in checks:
        assert rel_err(got, ref if want is None else want) <= 1e-2
