"""The router's top-k row op (``groupmm._rows.topk_ids``: Rust on the CPU, one warp per row
on CUDA) against ``torch.topk`` on rows of distinct values and against an independent
reference of the contract's order elsewhere (ties to the lower column, NaN above every
number): every dtype, widths around the CUDA kernel's values-per-lane steps, empty and
strided inputs, numpy, errors, the custom op (opcheck, torch.compile), CUDA graphs, and
``TopKRouter`` unchanged against the ``probs.topk`` it replaced."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICES, F64, HAS_CUDA
from groupmm import _native, _rows
from groupmm.moe import TopKRouter, load_balancing_loss

WIDTHS = [1, 7, 32, 33, 128, 200, 256, 1024]
TOKENS = [0, 1, 5, 1000]


def _ks(e):
    return sorted({k for k in (1, 2, 8, e) if k <= e})


def _distinct(t, e, dtype, device, seed):
    """``[t, e]`` rows of distinct values: a random permutation per row of numbers spread
    around a random offset (16-bit dtypes: of the integers around 0, exact there)."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.rand(t, e, generator=gen).argsort(dim=1).to(F64) - e // 2
    if dtype.itemsize >= 4:
        perm = perm * 0.375 + torch.randn(t, 1, generator=gen, dtype=F64)
    return perm.to(dtype).to(device)


def _reference(scores, k):
    """The contract's order, written independently of groupmm: NaN first, then greater
    values, equal values (and NaNs among themselves) lower column first."""
    rows = scores.double().cpu().tolist()

    def key(c, row):
        v = row[c]
        return (0, 0.0, c) if math.isnan(v) else (1, -v, c)

    return torch.tensor(
        [sorted(range(len(row)), key=lambda c, row=row: key(c, row))[:k] for row in rows],
        dtype=torch.int64,
    ).reshape(len(rows), k)


def _poisoned_topk(scores, k):
    """``topk_ids`` into memory that held -1s: on CUDA, blocks of the output's size are
    filled with -1 and freed first, so the caching allocator hands one back (an id the
    kernel did not write stays -1 instead of a stale right answer)."""
    if scores.device.type == "cuda":
        blocks = [scores.new_full((scores.shape[0], k), -1, dtype=torch.int64) for _ in range(4)]
        del blocks
    return _rows.topk_ids(scores, k)


def _check_ids(ids, scores, k):
    assert ids.dtype == torch.int64
    assert ids.shape == (scores.shape[0], k)
    assert ids.device == scores.device
    assert ids.is_contiguous()


# --------------------------------------------------------------------------- values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("e", WIDTHS)
def test_equals_torch_topk_on_distinct_values(device, dtype, e):
    """On rows of distinct values the ids are ``torch.topk``'s indices, exactly, for every
    k in {1, 2, 8, E} and T in {0, 1, 5, 1000}."""
    for t in TOKENS:
        scores = _distinct(t, e, dtype, device, seed=e * 31 + t)
        for k in _ks(e):
            ids = _poisoned_topk(scores, k)
            _check_ids(ids, scores, k)
            want = torch.topk(scores, k, dim=-1).indices
            assert torch.equal(ids, want), f"T={t} E={e} k={k}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_torch_topk_on_random_normal(device, dtype):
    """Softmax-like inputs as the router makes them: the selected values are torch.topk's
    (so the ids are a correct top-k even where two values tie), and on rows without ties
    the ids themselves."""
    gen = torch.Generator().manual_seed(1)
    for e in (8, 64, 160, 256):
        scores = torch.randn(300, e, generator=gen, dtype=F64).softmax(-1).to(dtype).to(device)
        for k in _ks(e):
            ids = _rows.topk_ids(scores, k)
            top = torch.topk(scores, k, dim=-1)
            assert torch.equal(scores.gather(1, ids), top.values)
            distinct = torch.tensor(
                [len(set(r)) == e for r in scores.cpu().tolist()], device=device
            )
            assert torch.equal(ids[distinct], top.indices[distinct])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_scores(device, dtype):
    """float16 and bfloat16 scores are compared exactly (the kernel widens them)."""
    for e in (7, 33, 200, 256):
        scores = _distinct(50, e, dtype, device, seed=e)
        assert len(set(scores[0].float().tolist())) == e, "the values must stay distinct"
        for k in _ks(e):
            ids = _rows.topk_ids(scores, k)
            _check_ids(ids, scores, k)
            assert torch.equal(ids.cpu(), _reference(scores, k))
            assert torch.equal(ids.cpu(), torch.topk(scores.cpu().double(), k).indices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_ties_go_to_the_lower_column(device, dtype):
    for e in (1, 7, 32, 33, 200):
        equal = torch.full((3, e), 0.5, dtype=dtype, device=device)
        for k in _ks(e):
            want = torch.arange(k, device=device).expand(3, k)
            assert torch.equal(_rows.topk_ids(equal, k), want), f"E={e} k={k}"
    # duplicated maxima (and duplicated runners-up) in columns far apart: lanes disagree
    row = torch.zeros(70, dtype=F64)
    row[[69, 3, 40, 35]] = 2.0
    row[[1, 64]] = 1.0
    scores = torch.stack([row, row.flip(0)]).to(dtype).to(device)
    ids = _rows.topk_ids(scores, 8)
    assert ids[0].tolist() == [3, 35, 40, 69, 1, 64, 0, 2]
    assert ids[1].tolist() == [0, 29, 34, 66, 5, 68, 1, 2]
    assert torch.equal(ids.cpu(), _reference(scores, 8))
    # many ties everywhere: small integers
    gen = torch.Generator().manual_seed(5)
    for e in (7, 33, 128, 256, 1000):
        scores = torch.randint(-3, 4, (40, e), generator=gen).to(dtype).to(device)
        for k in _ks(e):
            assert torch.equal(_rows.topk_ids(scores, k).cpu(), _reference(scores, k))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_infinities_and_signed_zeros(device, dtype):
    inf = math.inf
    scores = torch.tensor(
        [
            [-inf, 1.0, inf, -2.0, inf, 0.0, -inf],
            [-inf] * 7,
            [inf] * 7,
            [-0.0, 0.0, -0.0, -1.0, 0.0, -inf, -0.0],
            [0.0, -0.0, 0.0, 0.0, -0.0, -0.0, 0.0],
        ],
        dtype=dtype,
        device=device,
    )
    ids = _rows.topk_ids(scores, 7)
    assert ids.tolist() == [
        [2, 4, 1, 5, 3, 0, 6],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5, 6],
        [0, 1, 2, 4, 6, 3, 5],  # -0.0 == 0.0: ties by column
        [0, 1, 2, 3, 4, 5, 6],
    ]
    assert torch.equal(ids.cpu(), _reference(scores, 7))
    assert torch.equal(_rows.topk_ids(scores, 2), ids[:, :2])
    # -inf is a real score: a row of -inf and one finite value picks the finite one first
    wide = torch.full((2, 300), -inf, dtype=dtype, device=device)
    wide[0, 250] = -1e30
    wide[1, 17] = 0.0
    assert _rows.topk_ids(wide, 3).tolist() == [[250, 0, 1], [17, 0, 1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_nan_ranks_above_every_number(device, dtype):
    nan, inf = math.nan, math.inf
    scores = torch.tensor(
        [
            [1.0, nan, 2.0, nan, inf, -3.0],
            [nan] * 6,
            [0.5, -1.0, 3.0, -inf, 2.0, nan],
        ],
        dtype=dtype,
        device=device,
    )
    ids = _rows.topk_ids(scores, 6)
    assert ids.tolist() == [[1, 3, 4, 2, 0, 5], [0, 1, 2, 3, 4, 5], [5, 2, 4, 0, 1, 3]]
    for k in (1, 2, 3):
        assert torch.equal(_rows.topk_ids(scores, k), ids[:, :k])
    # NaNs scattered through wide rows: the same values as torch.topk (which ranks NaN
    # first too; it does not order NaNs among themselves), the order of the reference
    gen = torch.Generator().manual_seed(9)
    for e in (33, 200, 1024):
        s = _distinct(20, e, dtype, "cpu", seed=e)
        s[torch.rand(20, e, generator=gen) < 0.05] = nan
        s[3] = nan
        s = s.to(device)
        for k in _ks(e):
            got = _rows.topk_ids(s, k)
            assert torch.equal(got.cpu(), _reference(s, k))
            torch.testing.assert_close(
                s.gather(1, got), torch.topk(s, k).values, rtol=0, atol=0, equal_nan=True
            )


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_expanded_inputs(device):
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(64, 96, generator=gen, dtype=F64).to(device)
    views = {
        "transposed": base.t(),  # [96, 64], column-major
        "column step": base[:, ::3],
        "row step": base[::5],
        "offset": base[7:40, 11:90],
        "expanded": base[:1].expand(9, 96),
    }
    for name, v in views.items():
        assert not v.is_contiguous() or name == "offset"
        for k in (1, 4, v.shape[1]):
            want = torch.topk(v, k).indices if name != "expanded" else _reference(v, k)
            assert torch.equal(_rows.topk_ids(v, k).cpu(), want.cpu()), name


def test_numpy_scores():
    np = pytest.importorskip("numpy")
    scores = _distinct(11, 40, F64, "cpu", seed=3)
    out = _native.topk_ids(scores.numpy(), 5)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64 and out.shape == (11, 5)
    np.testing.assert_array_equal(out, torch.topk(scores, 5).indices.numpy())
    out32 = _native.topk_ids(scores.float().numpy()[:, ::2], 3)
    np.testing.assert_array_equal(out32, torch.topk(scores.float()[:, ::2], 3).indices.numpy())


@pytest.mark.parametrize("device", DEVICES)
def test_repeatable_and_cpu_equals_cuda(device):
    """The same ids on every call; on CUDA the same as the CPU's on tie-heavy rows of every
    dtype (one order, two implementations)."""
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for e in (5, 32, 64, 100, 256, 512, 513, 1024):
            cpu = torch.randint(-4, 5, (97, e), generator=gen).to(dtype)
            cpu[cpu == 4] = math.nan
            k = min(e, 40)
            ids = _poisoned_topk(cpu.to(device), k)
            assert torch.equal(ids, _rows.topk_ids(cpu.to(device), k))
            assert torch.equal(ids.cpu(), _rows.topk_ids(cpu, k)), f"{dtype} E={e}"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_them(device):
    x = torch.randn(4, 6, device=device)
    for k in (0, -1, 7, 100):
        with pytest.raises(ValueError, match=rf"^k: expected an integer in \[1, 6\] .*found {k}$"):
            _rows.topk_ids(x, k)
    with pytest.raises(ValueError, match=r"^scores: expected a 2-D tensor, found 1-D"):
        _rows.topk_ids(x[0], 1)
    with pytest.raises(ValueError, match=r"^scores: expected a 2-D tensor, found 3-D"):
        _rows.topk_ids(x.view(2, 2, 6), 1)
    with pytest.raises(ValueError, match=r"^scores: expected at least one column \(E >= 1\)"):
        _rows.topk_ids(x[:, :0], 1)
    for dtype in (torch.int64, torch.int32, torch.bool, torch.uint8):
        with pytest.raises(TypeError, match=r"^scores: expected dtype torch.float16, .* found"):
            _rows.topk_ids(x.to(dtype), 1)
    with pytest.raises(TypeError, match="^scores: expected a torch.Tensor or numpy.ndarray"):
        _rows.topk_ids([[1.0, 2.0]], 1)
    with pytest.raises(TypeError):
        _rows.topk_ids(x, 2.0)
    if device == "cuda":
        wide = torch.zeros(2, _rows.TOPK_CUDA_MAX_COLS + 1, device=device)
        with pytest.raises(ValueError, match=r"^scores: expected at most 1024 columns on CUDA"):
            _rows.topk_ids(wide, 2)
        assert _rows.topk_ids(wide[:, 1:], 2).tolist() == [[0, 1], [0, 1]]


def test_applies():
    assert _rows.TOPK_CUDA_MAX_COLS == _native.TOPK_CUDA_MAX_COLS == 1024
    assert _rows.topk_ids_applies(torch.zeros(3, 5000))
    for dtype in _rows.TOPK_DTYPES:
        assert _rows.topk_ids_applies(torch.zeros(3, 4, dtype=dtype))
    assert not _rows.topk_ids_applies(torch.zeros(3, 4, dtype=torch.int64))
    assert not _rows.topk_ids_applies(torch.zeros(3, 4, 2))
    assert not _rows.topk_ids_applies(torch.zeros(3, 4, device="meta"))
    if HAS_CUDA:
        assert _rows.topk_ids_applies(torch.zeros(3, 1024, device="cuda"))
        assert not _rows.topk_ids_applies(torch.zeros(3, 1025, device="cuda"))


# --------------------------------------------------------------------------- custom op


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    scores = _distinct(9, 12, torch.float32, device, seed=6)
    op = torch.ops.groupmm.topk_ids.default
    for args in ((scores, 3), (scores, 12), (scores[:0], 2), (scores.double().t(), 1)):
        torch.library.opcheck(op, args)
    torch.library.opcheck(op, (scores.clone().requires_grad_(), 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, dynamic):
    def f(scores, k: int):
        probs = scores.softmax(-1)
        ids = _rows.topk_ids(probs.detach(), k)
        return ids, probs.gather(-1, ids)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for t in (16, 23):
        scores = _distinct(t, 24, torch.float32, device, seed=t).requires_grad_()
        ids, w = compiled(scores, 4)
        want = torch.topk(scores.softmax(-1), 4)
        assert torch.equal(ids, want.indices)
        torch.testing.assert_close(w, want.values)
        w.sum().backward()
        assert scores.grad is not None


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
def test_cuda_current_stream_graph_capture_and_no_sync():
    """On the current stream, no host sync (sync debug mode "error"), capturable in a CUDA
    graph whose replay recomputes from new scores."""
    scores = _distinct(4096, 128, torch.float32, "cuda", seed=7)
    want = torch.topk(scores, 8).indices
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            ids = _rows.topk_ids(scores, 8)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(ids, want)

    static = scores.clone()
    _rows.topk_ids(static, 8)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _rows.topk_ids(static, 8)
    fresh = _distinct(4096, 128, torch.float32, "cuda", seed=8)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, torch.topk(fresh, 8).indices)


# --------------------------------------------------------------------------- router


def _old_router(r, x):
    """TopKRouter.forward as it was, with ``probs.topk``: the reference the router's
    outputs and gradients must still equal."""
    logits = r.gate(x)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
    top_p, ids = probs.topk(r.top_k, dim=-1)
    if r.normalize:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    if r.aux_loss_coef > 0:
        aux = r.aux_loss_coef * load_balancing_loss(probs, ids)
    else:
        aux = probs.new_zeros(())
    return top_p.to(x.dtype), ids, probs, aux


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("experts", "top_k"), [(4, 1), (8, 2), (64, 8), (128, 8), (6, 6)])
@pytest.mark.parametrize("normalize", [None, False])
def test_router_unchanged(device, dtype, experts, top_k, normalize):
    """Weights, ids, probs, aux loss and the gradients to the gate weight and to x are those
    of the ``probs.topk`` path the router used before, bit for bit, wherever that path's
    answer is unique: rows whose k + 1 best probabilities tie (bfloat16 logits do) have
    ``torch.topk``'s unspecified order there, and the native op's lower id first; their
    weights still agree, and the rest is compared where no row ties."""
    torch.manual_seed(experts * 10 + top_k)
    r = TopKRouter(
        32, experts, top_k, normalize=normalize, aux_loss_coef=0.1, device=device, dtype=dtype
    )
    x = torch.randn(257, 32, device=device, dtype=dtype, requires_grad=True)
    got = r(x)
    go = torch.randn_like(got.weights)
    (got.weights * go).sum().add(got.aux_loss).backward()
    g_gate, g_x = r.gate.weight.grad.clone(), x.grad.clone()
    r.zero_grad()
    x.grad = None
    weights, ids, probs, aux = _old_router(r, x)
    (weights * go).sum().add(aux).backward()
    assert got.expert_ids.dtype == torch.int64
    assert torch.equal(got.weights, weights)
    assert torch.equal(got.probs, probs)
    best = probs.detach().sort(dim=-1, descending=True).values[:, : min(top_k + 1, experts)]
    tie_free = (best[:, 1:] != best[:, :-1]).all(-1)
    if dtype != torch.bfloat16:
        assert tie_free.all(), "float32 and float64 probabilities should not tie here"
    assert tie_free.float().mean() > 0.5
    assert torch.equal(got.expert_ids[tie_free], ids[tie_free])
    if tie_free.all():
        assert torch.equal(got.expert_ids, ids)
        assert torch.equal(got.aux_loss, aux)
        assert torch.equal(g_gate, r.gate.weight.grad)
        assert torch.equal(g_x, x.grad)


def test_router_uses_the_native_op_where_it_applies(monkeypatch):
    calls = []
    native = _native.topk_ids

    def spy(scores, k):
        calls.append(tuple(scores.shape))
        return native(scores, k)

    monkeypatch.setattr(_native, "topk_ids", spy)
    r = TopKRouter(8, 16, 4)
    r(torch.randn(5, 8))
    assert calls == [(5, 16)]
    # meta tensors: torch.topk (the fallback), not the native op
    meta = TopKRouter(8, 16, 4, device="meta")
    out = meta(torch.randn(5, 8, device="meta"))
    assert out.expert_ids.shape == (5, 4) and out.expert_ids.device.type == "meta"
    assert calls == [(5, 16)]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
def test_router_wider_than_the_cuda_bound_falls_back():
    torch.manual_seed(3)
    e = _rows.TOPK_CUDA_MAX_COLS + 1
    r = TopKRouter(16, e, 4, device="cuda")
    x = torch.randn(64, 16, device="cuda")
    out = r(x)
    assert torch.equal(out.expert_ids, _old_router(r, x)[1])


def test_router_compiles_fullgraph():
    """The router inside torch.compile(fullgraph=True): ids and gradients as in eager."""
    torch.manual_seed(13)
    torch._dynamo.reset()
    r = TopKRouter(16, 32, 4, aux_loss_coef=0.1)
    x = torch.randn(40, 16)

    def f(x):
        out = r(x)
        return out.expert_ids, out.weights.square().sum() + out.aux_loss

    ids, loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    (g,) = torch.autograd.grad(loss, r.gate.weight)
    ids_e, loss_e = f(x)
    (g_e,) = torch.autograd.grad(loss_e, r.gate.weight)
    assert torch.equal(ids, ids_e)
    torch.testing.assert_close(loss, loss_e)
    torch.testing.assert_close(g, g_e)


def test_router_weights_twice_differentiable_without_scatter_add():
    """The chosen probabilities' backward scatters (no scatter_add: atomic on GPU), and is
    itself differentiable: gradcheck and gradgradcheck through x and the gate weight."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(14)
    r = TopKRouter(6, 10, 3, aux_loss_coef=0.0, dtype=F64)
    x = torch.randn(7, 6, dtype=F64, requires_grad=True)
    w = r.gate.weight

    def weights(x, w):
        return torch.func.functional_call(r, {"gate.weight": w}, (x,)).weights

    seen: list = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops():
        weights(x, w).square().sum().backward()
    assert "aten.scatter.src" in seen
    assert not [op for op in seen if "scatter_add" in op or "index_put" in op]
    assert torch.autograd.gradcheck(weights, (x, w))
    assert torch.autograd.gradgradcheck(weights, (x, w))
