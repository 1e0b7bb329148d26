"""groupmm.fused.expert_block, expert_up and expert_down against an independent float64
reference (a loop over tokens and their experts), their gradients (gradcheck,
gradgradcheck), the custom ops (opcheck, torch.compile), the native fused functions'
wiring (stand-ins on the CPU, the kernels on Hopper), the block's memory contract,
MoELayer(fused=True) against the unfused layer, and errors."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, F64, HAS_CUDA, TOL, assert_close_rel, rel_err
from groupmm._glue import routes
from groupmm.fused import expert_block, expert_down, expert_up
from groupmm.moe import MoELayer
from torch._dynamo.testing import AotEagerAndRecordGraphs


def _setup(T=7, D=5, Fh=3, E=4, k=2, seed=0, device="cpu", dtype=F64, empty=(1,)):
    """Tokens, expert ids (experts in ``empty`` never chosen), weights and routes."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    pick = torch.stack([torch.randperm(len(allowed), generator=gen)[:k] for _ in range(T)])
    ids = allowed[pick]
    x = torch.randn(T, D, generator=gen, dtype=F64).to(device, dtype)
    w_in = torch.randn(E, D, 2 * Fh, generator=gen, dtype=F64).to(device, dtype)
    w_out = torch.randn(E, Fh, D, generator=gen, dtype=F64).to(device, dtype)
    weights = torch.rand(T, k, generator=gen, dtype=F64).to(device, dtype)
    r = routes(ids.to(device), E)
    return x, ids.to(device), w_in, w_out, weights, r


def _reference(x, ids, w_in, w_out, weights):
    """out[t] = sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), float64, token by token."""
    x, w_in, w_out = x.double(), w_in.double(), w_out.double()
    out = torch.zeros(x.shape[0], w_out.shape[-1], dtype=F64, device=x.device)
    Fh = w_out.shape[1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            pre = x[t] @ w_in[e]
            act = F.silu(pre[:Fh]) * pre[Fh:]
            w = 1.0 if weights is None else weights[t, j].double()
            out[t] += w * (act @ w_out[e])
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [True, False])
def test_expert_up_down_equal_reference(device, weighted):
    x, ids, w_in, w_out, weights, r = _setup(device=device)
    weights = weights if weighted else None
    h = expert_up(x, w_in, r.offs, r.src, r.inverse)
    assert h.shape == (r.src.shape[0], w_in.shape[-1] // 2)
    out = expert_down(h, w_out, r.offs, r.inverse, weights)
    torch.testing.assert_close(out, _reference(x, ids, w_in, w_out, weights))


@pytest.mark.parametrize("device", DEVICES)
def test_expert_up_down_gradcheck(device):
    x, ids, w_in, w_out, weights, r = _setup(T=5, D=3, Fh=2, E=3, k=2, device=device)
    inputs = [t.clone().requires_grad_() for t in (x, w_in, w_out, weights)]

    def f(x, w_in, w_out, weights):
        h = expert_up(x, w_in, r.offs, r.src, r.inverse)
        return expert_down(h, w_out, r.offs, r.inverse, weights)

    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_expert_gradients_equal_reference():
    x, ids, w_in, w_out, weights, r = _setup(seed=3)
    ins = [t.clone().requires_grad_() for t in (x, w_in, w_out, weights)]
    refs = [t.clone().requires_grad_() for t in (x, w_in, w_out, weights)]
    go = torch.randn(x.shape[0], x.shape[1], dtype=F64)
    h = expert_up(ins[0], ins[1], r.offs, r.src, r.inverse)
    expert_down(h, ins[2], r.offs, r.inverse, ins[3]).backward(go)
    _reference(refs[0], ids, refs[1], refs[2], refs[3]).backward(go)
    for got, ref in zip(ins, refs):
        torch.testing.assert_close(got.grad, ref.grad)


@pytest.mark.parametrize("fused_dtype", [F64, torch.bfloat16])
def test_moe_layer_fused_equals_unfused(fused_dtype):
    """The fused layer (the default: ``expert_block``) against the unfused one
    (``fused=False``: permute, ``GroupedExperts``, unpermute) with the same weights: the
    output, the aux loss and every gradient equal in float64; in bf16, where the two paths
    round ``pre`` and ``act`` at different points, within twice the suite's bf16 tolerance
    of each other (each is within it of the exact result; relative Frobenius error)."""
    torch.manual_seed(4)
    a = MoELayer(6, 4, 5, 2, aux_loss_coef=0.01, fused=False, dtype=fused_dtype)
    b = MoELayer(6, 4, 5, 2, aux_loss_coef=0.01, dtype=fused_dtype)
    assert not a.fused and b.fused
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4, 6, dtype=fused_dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, auxa = a(xa, return_aux_loss=True)
    yb, auxb = b(xb, return_aux_loss=True)
    go = torch.randn_like(ya)
    (ya * go).sum().add(auxa).backward()
    (yb * go).sum().add(auxb).backward()
    # the router is the same code on the same input: the same experts and the same loss
    torch.testing.assert_close(auxb, auxa, rtol=0, atol=0)
    pairs = [("out", yb, ya), ("x.grad", xb.grad, xa.grad)]
    pairs += [(n, pb.grad, pa.grad) for (n, pa), pb in zip(a.named_parameters(), b.parameters())]
    for name, got, want in pairs:
        assert got is not None and want is not None, name
        if fused_dtype == F64:
            torch.testing.assert_close(got, want, msg=name)
        else:
            err = rel_err(got, want)
            assert err <= 2 * TOL[fused_dtype], f"{name}: relative error {err:.2e}"


def test_moe_layer_fused_is_deterministic():
    torch.manual_seed(5)
    layer = MoELayer(8, 6, 4, 2, fused=True, dtype=torch.float32)
    x = torch.randn(20, 8)
    grads = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        layer(xi).square().sum().backward()
        grads.append((xi.grad, layer.experts.w_in.grad, layer.router.gate.weight.grad))
    for g0, g1 in zip(*grads):
        assert torch.equal(g0, g1)


def test_opcheck_expert_ops():
    x, ids, w_in, w_out, weights, r = _setup(T=4, D=3, Fh=2, E=3, k=2)
    x.requires_grad_()
    w_in.requires_grad_()
    torch.library.opcheck(torch.ops.groupmm.expert_up.default, (x, w_in, r.offs, r.src, r.inverse))
    h = torch.randn(r.src.shape[0], 2, dtype=F64, requires_grad=True)
    w_out = w_out.requires_grad_()
    for wts in (weights.requires_grad_(), None):
        torch.library.opcheck(
            torch.ops.groupmm.expert_down.default, (h, w_out, r.offs, r.inverse, wts)
        )


def test_moe_layer_fused_compiles_fullgraph():
    torch._dynamo.reset()
    torch.manual_seed(6)
    layer = MoELayer(8, 6, 4, 2, fused=True, dtype=torch.float32)
    x = torch.randn(10, 8, requires_grad=True)
    eager = layer(x, return_aux_loss=True)[0]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(x, return_aux_loss=True)[0]
    torch.testing.assert_close(got, eager)
    got.sum().backward()
    assert layer.experts.w_in.grad is not None


def test_fused_bad_arguments():
    x, ids, w_in, w_out, weights, r = _setup()
    with pytest.raises(ValueError, match="w: expected an even last dimension"):
        expert_up(x, w_in[..., :-1], r.offs, r.src, r.inverse)
    with pytest.raises(ValueError, match="inverse: expected shape"):
        expert_up(x, w_in, r.offs, r.src, r.inverse[:-1])
    with pytest.raises(TypeError, match="src: expected an integer dtype"):
        expert_up(x, w_in, r.offs, r.src.double(), r.inverse)
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        expert_up(None, w_in, r.offs, r.src, r.inverse)
    with pytest.raises(ValueError, match="weights: expected shape"):
        expert_down(
            torch.randn(r.src.shape[0], 3, dtype=F64), w_out, r.offs, r.inverse, weights.t()
        )
    with pytest.raises(ValueError, match="fused: needs activation='swiglu'"):
        MoELayer(4, 4, 2, 1, activation="gelu", fused=True)
    with pytest.raises(ValueError, match="fused: needs"):
        MoELayer(4, 4, 2, 1, pad_to=8, fused=True)
    with pytest.raises(TypeError, match="fused: expected a bool"):
        MoELayer(4, 4, 2, 1, fused=1)


def test_moe_layer_fuses_by_default_when_it_can():
    assert MoELayer(4, 4, 2, 1).fused is True
    assert MoELayer(4, 4, 2, 1, fused=False).fused is False
    assert MoELayer(4, 4, 2, 1, activation="gelu").fused is False
    assert MoELayer(4, 4, 2, 1, bias=True).fused is False
    assert MoELayer(4, 4, 2, 1, pad_to=8).fused is False


# --------------------------------------------------------------------------- expert_block


def _block_case(T=7, D=5, Fh=3, E=5, k=3, seed=0, device="cpu", dtype=F64, empty=(1, 3)):
    """A routed block with empty experts and T*k = 21 rows (a multiple of nothing the
    kernels tile by); leaf inputs requiring grad."""
    x, ids, w_in, w_out, weights, r = _setup(T, D, Fh, E, k, seed, device, dtype, empty)
    leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out, weights)]
    return leaves, ids, r


def _block_grads(out, inputs, go):
    return torch.autograd.grad(out, inputs, go)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("weighted", [True, False])
def test_expert_block_equals_reference(device, dtype, weighted):
    """Output and the gradients of x, w_in, w_out and the router weights against the
    token-by-token float64 loop (weights=None: a plain sum, no weight gradient)."""
    (x, w_in, w_out, weights), ids, r = _block_case(device=device, dtype=dtype)
    wts = weights if weighted else None
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, wts)
    assert out.shape == x.shape and out.dtype == dtype
    refs = [t.detach().double().requires_grad_() for t in (x, w_in, w_out, weights)]
    ref = _reference(refs[0], ids, refs[1], refs[2], refs[3] if weighted else None)
    go = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(9))
    inputs = [x, w_in, w_out, weights] if weighted else [x, w_in, w_out]
    got = _block_grads(out, inputs, go.to(device, dtype))
    want = _block_grads(ref, refs[: len(inputs)], go.to(device))
    if dtype == F64:
        torch.testing.assert_close(out, ref)
        for name, g, w in zip(("x", "w_in", "w_out", "weights"), got, want):
            torch.testing.assert_close(g, w, msg=name)
    else:
        assert_close_rel(out, ref, dtype, "out")
        for name, g, w in zip(("x", "w_in", "w_out", "weights"), got, want):
            assert g.dtype == dtype
            assert_close_rel(g, w, dtype, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("column_major", [False, True])
def test_expert_block_wide_tokens_and_a_retained_graph(device, dtype, column_major):
    """D = 200: dw_in from x gathered one column slab at a time (two slabs, split at 128),
    into both layouts of w_in (a column-major w_in, transformers' [E, 2F, D] storage,
    gets its gradient in its own layout); and a retained graph: the backward that writes
    pre's gradient over pre must not do so when autograd keeps the graph, so a second
    backward gets the same gradients."""
    from groupmm._fused_ops import _slabs

    assert _slabs(200) == [(0, 128), (128, 200)] and _slabs(127) == [(0, 127)]
    assert _slabs(2880) == [(0, 1472), (1472, 2880)] and _slabs(2048) == [(0, 1024), (1024, 2048)]
    (x, w_in, w_out, weights), ids, r = _block_case(D=200, Fh=4, device=device, dtype=dtype)
    if column_major:
        w_in = w_in.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    refs = [t.detach().double().requires_grad_() for t in (x, w_in, w_out, weights)]
    ref = _reference(refs[0], ids, *refs[1:])
    go = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    want = _block_grads(ref, refs, go.to(device))
    inputs = [x, w_in, w_out, weights]
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    first = torch.autograd.grad(out, inputs, go.to(device, dtype), retain_graph=True)
    second = torch.autograd.grad(out, inputs, go.to(device, dtype))
    for name, g1, g2, w in zip(("x", "w_in", "w_out", "weights"), first, second, want):
        assert torch.equal(g1, g2), f"{name}: the second backward differs"
        assert_close_rel(g1, w, dtype, name)
    assert first[1].stride() == w_in.stride(), "w_in's gradient in w_in's own layout"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [True, False])
def test_expert_block_gradcheck_and_gradgradcheck(device, weighted):
    (x, w_in, w_out, weights), ids, r = _block_case(
        T=5, D=3, Fh=2, E=4, k=2, device=device, empty=(2,)
    )

    def f(x, w_in, w_out, *wts):
        return expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, *wts)

    inputs = (x, w_in, w_out, weights) if weighted else (x, w_in, w_out)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def test_expert_block_equals_its_halves():
    """The one op gives what expert_up then expert_down give, values and gradients."""
    (x, w_in, w_out, weights), ids, r = _block_case(seed=2)
    go = torch.randn(x.shape, dtype=F64)
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    got = _block_grads(out, [x, w_in, w_out, weights], go)
    h = expert_up(x, w_in, r.offs, r.src, r.inverse)
    halves = expert_down(h, w_out, r.offs, r.inverse, weights)
    want = _block_grads(halves, [x, w_in, w_out, weights], go)
    torch.testing.assert_close(out, halves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_expert_block_int32_indices_and_no_tokens():
    (x, w_in, w_out, weights), ids, r = _block_case(seed=4)
    args = (r.offs, r.src.int(), r.inverse.int(), weights)
    out = expert_block(x, w_in, w_out, *args)
    torch.testing.assert_close(out, _reference(x, ids, w_in, w_out, weights))
    out.sum().backward()
    assert x.grad is not None and weights.grad is not None
    # no tokens at all: zero rows, zero weight gradients
    e = routes(ids[:0], 5)
    x0 = x.detach()[:0].requires_grad_()
    w0 = weights.detach()[:0].requires_grad_()
    out = expert_block(x0, w_in, w_out, e.offs, e.src, e.inverse, w0)
    assert out.shape == (0, x.shape[1])
    gx, gw_in, gw_out = torch.autograd.grad(out.sum(), (x0, w_in, w_out))
    assert gx.shape == (0, x.shape[1])
    assert torch.count_nonzero(gw_in) == 0 and torch.count_nonzero(gw_out) == 0


def test_expert_block_rows_past_offs_contribute_nothing():
    """Expert-parallel placeholders (ids outside [0, E), sorted past offs[-1]) with zero
    weights: the same output and gradients as the loop without them, and no router
    gradient for them."""
    x, ids, w_in, w_out, weights, _ = _setup(T=6, D=4, Fh=3, E=4, k=2, seed=5, empty=())
    ids[0, 1], ids[3, 0] = 4, -1
    r = routes(ids, 4, placeholders=True)
    keep = (ids >= 0) & (ids < 4)
    weights = weights.where(keep, 0).requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (x, w_in, w_out)]
    out = expert_block(*leaves, r.offs, r.src, r.inverse, weights)
    assert int(r.offs[-1]) == 10
    refs = [t.detach().clone().requires_grad_() for t in (x, w_in, w_out, weights)]
    ref = _reference(refs[0], ids.where(keep, 0), refs[1], refs[2], refs[3] * keep)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(ref)
    got = _block_grads(out, [*leaves, weights], go)
    want = _block_grads(ref, refs, go)
    for g, w in zip(got[:3], want[:3]):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(got[3] * keep, want[3] * keep)
    assert got[3][0, 1] == 0 and got[3][3, 0] == 0


def test_expert_block_weight_gradients_keep_a_transposed_layout():
    """Weights stored [E, 2F, D] and [E, D, F] (transformers' layout), passed as
    transposed views: the op's gradients come out in the views' own layout (the
    parameters' storage order: no transposed copy), and equal the reference."""
    (x, w_in, w_out, weights), ids, r = _block_case(seed=6)
    p_in = w_in.detach().transpose(-2, -1).contiguous().requires_grad_()
    p_out = w_out.detach().transpose(-2, -1).contiguous().requires_grad_()
    v_in, v_out = p_in.transpose(-2, -1), p_out.transpose(-2, -1)
    out = expert_block(x, v_in, v_out, r.offs, r.src, r.inverse, weights)
    go = torch.randn(x.shape, dtype=F64)
    g_in, g_out = torch.autograd.grad(out, (v_in, v_out), go, retain_graph=True)
    assert g_in.stride() == v_in.stride() and g_out.stride() == v_out.stride()
    out.backward(go)
    ref = _reference(x, ids, w_in, w_out, weights)
    r_in, r_out = torch.autograd.grad(ref, (w_in, w_out), go)
    torch.testing.assert_close(p_in.grad, r_in.transpose(-2, -1))
    torch.testing.assert_close(p_out.grad, r_out.transpose(-2, -1))


def _skewed_case(device="cpu", dtype=F64, major="row", seed=16):
    """Skewed routing (every token's first copy to expert 0, most second copies to
    expert 2, one to expert 5; experts 1 and 4 empty: T*k = 26 rows) with the weights
    stored row-major, or (``major="column"``) as transformers stores them, ``[E, 2F, D]``
    and ``[E, D, F]``, passed as transposed views. Returns the views the block takes and
    their float64 row-major references, all requiring grad."""
    T, D, Fh, E = 13, 6, 4, 6
    gen = torch.Generator().manual_seed(seed)
    second = torch.tensor([2 if t % 4 else 3 for t in range(T)])
    second[-1] = 5
    ids = torch.stack([torch.zeros(T, dtype=torch.long), second], 1)
    x = torch.randn(T, D, generator=gen, dtype=F64)
    w_in = torch.randn(E, D, 2 * Fh, generator=gen, dtype=F64) / D**0.5
    w_out = torch.randn(E, Fh, D, generator=gen, dtype=F64) / Fh**0.5
    weights = torch.rand(T, 2, generator=gen, dtype=F64)
    refs = [t.clone().requires_grad_() for t in (x, w_in, w_out, weights)]
    if major == "column":
        stored = [w.transpose(-2, -1).contiguous().to(device, dtype) for w in (w_in, w_out)]
        stored = [w.requires_grad_() for w in stored]
        w_in, w_out = (w.transpose(-2, -1) for w in stored)
    else:
        w_in, w_out = (w.to(device, dtype).requires_grad_() for w in (w_in, w_out))
    x, weights = (t.to(device, dtype).requires_grad_() for t in (x, weights))
    return [x, w_in, w_out, weights], refs, ids, routes(ids.to(device), E)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
@pytest.mark.parametrize("major", ["row", "column"])
def test_expert_block_gradients_skewed_routing_both_majors(device, dtype, major):
    """The gradients of x, w_in, w_out and the router weights against the float64 loop,
    with skewed routing, empty experts and either weight layout (a column-major weight's
    gradient in its own layout)."""
    (x, w_in, w_out, weights), refs, ids, r = _skewed_case(device, dtype, major)
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    ref = _reference(refs[0], ids, *refs[1:])
    go = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(17))
    got = _block_grads(out, [x, w_in, w_out, weights], go.to(device, dtype))
    want = _block_grads(ref, refs, go)
    assert got[1].stride() == w_in.stride() and got[2].stride() == w_out.stride()
    for name, g, w in zip(("x", "w_in", "w_out", "weights"), got, want):
        assert g.dtype == dtype
        if dtype == F64:
            torch.testing.assert_close(g.cpu(), w, msg=name)
        else:
            assert_close_rel(g.cpu(), w, dtype, name)


def test_expert_block_gradgradcheck_column_major_weights():
    """Double backward through the differentiable compositions with column-major weights
    (transposed views) and skewed routing, against gradcheck's finite differences."""
    (x, w_in, w_out, weights), refs, ids, r = _skewed_case(major="column")
    x, weights = x[:5].detach().requires_grad_(), weights[:5].detach().requires_grad_()
    r = routes(ids[:5], 6)

    def f(x, w_in, w_out, weights):
        return expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)

    inputs = (x, w_in, w_out, weights)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)


def _graph_nodes(root):
    """Every autograd node reachable from ``root``."""
    seen, todo = [], [root]
    while todo:
        node = todo.pop()
        if node is None or any(node is n for n in seen):
            continue
        seen.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return seen


def test_expert_block_saves_no_routed_rows_and_frees_pre_before_the_up_backward():
    """The block's memory contract: its ops save nothing of size [R, D] or [R, F] and
    [R, 2F] once (pre); pre is alive when the down projection's backward starts and
    already released when the up projection's backward starts (its storage gone: only
    gated_down kept it)."""
    (x, w_in, w_out, weights), ids, r = _block_case(seed=15)
    R, D, Fh = r.src.shape[0], x.shape[1], w_out.shape[1]
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), weakref.ref(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    shapes = [shape for shape, _ in saved]
    assert (R, D) not in shapes and (R, Fh) not in shapes
    pre = [ref for shape, ref in saved if shape == (R, 2 * Fh)]
    assert len(pre) == 1 and pre[0]() is not None
    nodes = _graph_nodes(out.grad_fn)
    # eager: the ops' autograd.Function twins (_fused_ops._GatedDownFn, _SwigluUpFn)
    down = [n for n in nodes if "gateddown" in n.name().lower().replace("_", "")]
    up = [n for n in nodes if "swigluup" in n.name().lower().replace("_", "")]
    assert len(down) == 1 and len(up) == 1 and down[0] is out.grad_fn
    alive = {}
    down[0].register_prehook(lambda grads: alive.__setitem__("down", pre[0]() is not None))
    up[0].register_prehook(lambda grads: alive.__setitem__("up", pre[0]() is not None))
    go = torch.randn(x.shape, dtype=F64)
    out.backward(go)
    assert alive == {"down": True, "up": False}
    ref = [t.detach().clone().requires_grad_() for t in (x, w_in, w_out, weights)]
    _reference(ref[0], ids, *ref[1:]).backward(go)
    for name, got, want in zip(("x", "w_in", "w_out", "weights"), (x, w_in, w_out, weights), ref):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


@pytest.mark.filterwarnings("ignore:Your compiler for AOTAutograd")
def test_expert_block_compiled_graphs_keep_the_memory_contract():
    """Under torch.compile(fullgraph=True) the forward graph runs the two ops and saves
    nothing of size [R, D] or [R, F] (pre once); the backward graph runs dgated and
    dw_in's gathered weight gradient, and gathers no rows with torch ops (a 1-D gather of
    per-row scalars at most)."""
    torch._dynamo.reset()
    (x, w_in, w_out, weights), ids, r = _block_case(dtype=torch.float32, seed=18)
    R, D, Fh = r.src.shape[0], x.shape[1], w_out.shape[1]
    backend = AotEagerAndRecordGraphs()

    def f(x, w_in, w_out, weights):
        return expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    out = compiled(x, w_in, w_out, weights)
    go = torch.randn(out.shape)
    got = _block_grads(out, [x, w_in, w_out, weights], go)
    want_out = f(x, w_in, w_out, weights)
    want = _block_grads(want_out, [x, w_in, w_out, weights], go)
    torch.testing.assert_close(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    (fw,), (bw,) = backend.fw_graphs, backend.bw_graphs
    fw_ops = [str(n.target) for n in fw.graph.nodes if n.op == "call_function"]
    assert "groupmm.swiglu_up.default" in fw_ops and "groupmm.gated_down.default" in fw_ops
    (result,) = [n for n in fw.graph.nodes if n.op == "output"]
    shapes = [tuple(v.meta["val"].shape) for v in result.args[0][1:] if hasattr(v, "meta")]
    assert (R, D) not in shapes and (R, Fh) not in shapes
    assert shapes.count((R, 2 * Fh)) == 1
    bw_ops = [str(n.target) for n in bw.graph.nodes if n.op == "call_function"]
    assert bw_ops.count("groupmm.dgated.default") == 1
    assert bw_ops.count("groupmm.gather_k_mm.default") == 1
    # no row gathered by torch ops: an index_select only of per-row scalars (the router
    # weights' gradient, row_grad[inverse])
    gathered = [
        n.args[0].meta["val"].dim()
        for n in bw.graph.nodes
        if n.op == "call_function" and str(n.target) == "aten.index_select.default"
    ]
    assert all(d == 1 for d in gathered), gathered


def _saved_sizes(fn):
    """Shapes of every tensor autograd saves while ``fn`` runs."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, shapes


def test_moe_layer_fused_saves_no_routed_row_copies():
    """The memory contract: the fused layer's backward keeps neither an [R, D] tensor
    (x[src], the expert outputs) nor an [R, F] one (the activation), R = T*k; the
    unfused layer (the control) keeps both."""
    T, D, Fh, E, k = 10, 8, 6, 4, 2
    R = T * k
    torch.manual_seed(8)
    fused = MoELayer(D, Fh, E, k, fused=True, aux_loss_coef=0.0, dtype=F64)
    plain = MoELayer(D, Fh, E, k, fused=False, aux_loss_coef=0.0, dtype=F64)
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(T, D, dtype=F64, requires_grad=True)
    out, shapes = _saved_sizes(lambda: fused(x))
    assert shapes and (R, D) not in shapes and (R, Fh) not in shapes
    assert (R, 2 * Fh) in shapes  # the pre-activation, the one [R, *] tensor kept
    assert not [s for s in shapes if len(s) == 2 and s[0] == R and s != (R, 2 * Fh)]
    ref, plain_shapes = _saved_sizes(lambda: plain(x))
    assert (R, D) in plain_shapes
    torch.testing.assert_close(out, ref)
    out.sum().backward()  # the saved tensors suffice


def test_expert_block_is_deterministic():
    (x, w_in, w_out, weights), ids, r = _block_case(T=40, D=16, Fh=8, E=6, k=3, dtype=torch.float32)
    go = torch.randn(x.shape)
    runs = []
    for _ in range(2):
        out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
        runs.append((out, *_block_grads(out, [x, w_in, w_out, weights], go)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dynamic", [False, True])
def test_expert_block_compiles_fullgraph(dynamic):
    torch._dynamo.reset()
    (x, w_in, w_out, weights), ids, r = _block_case(dtype=torch.float32, seed=7)

    def f(x, w_in, w_out, weights, offs, src, inverse):
        return expert_block(x, w_in, w_out, offs, src, inverse, weights).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    inputs = [x, w_in, w_out, weights]
    got = compiled(*inputs, r.offs, r.src, r.inverse)
    got_grads = torch.autograd.grad(got, inputs)
    want = f(*inputs, r.offs, r.src, r.inverse)
    want_grads = torch.autograd.grad(want, inputs)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_opcheck_expert_block():
    """The block's two ops (swiglu_up, gated_down), with and without gradients, and the
    backward's arithmetic ops (dgated, gather_k_mm: no autograd formulas)."""
    (x, w_in, w_out, weights), ids, r = _block_case(T=4, D=3, Fh=2, E=3, k=2, empty=())
    up = torch.ops.groupmm.swiglu_up.default
    down = torch.ops.groupmm.gated_down.default
    no_grad = [t.detach() for t in (x, w_in, w_out)]
    for xs, wi in ((x, w_in), tuple(no_grad[:2])):
        torch.library.opcheck(up, (xs, wi, r.offs, r.src, r.inverse))
    pre, act = up(*no_grad[:2], r.offs, r.src, r.inverse)
    assert pre.shape == (8, 4) and act.shape == (8, 2)
    pre = pre.requires_grad_()  # act: non-differentiable (a cache of swiglu(pre))
    for wts in (weights, None):
        args = (pre, act, w_out, r.offs, r.src, r.inverse, wts)
        torch.library.opcheck(down, args)
    torch.library.opcheck(down, (pre.detach(), act, no_grad[2], *args[3:]))
    # the backward's "dgated" op
    R = r.src.shape[0]
    dy, pre = torch.randn(R, 3, dtype=F64), torch.randn(R, 4, dtype=F64)
    scale = torch.rand(R, dtype=F64)
    dgated = torch.ops.groupmm.dgated.default
    torch.library.opcheck(dgated, (dy, no_grad[2], r.offs, pre, scale, None))
    # with src: dy in token order, row r reading dy[src[r]]
    d_out = torch.randn(x.shape[0], 3, dtype=F64)
    torch.library.opcheck(dgated, (d_out, no_grad[2], r.offs, pre, scale, r.src))
    got = dgated(d_out, no_grad[2], r.offs, pre, scale, r.src)
    want = dgated(d_out.index_select(0, r.src.long()), no_grad[2], r.offs, pre, scale, None)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    # the weight gradients on gathered rows, both layouts
    gather_k = torch.ops.groupmm.gather_k_mm.default
    for transposed in (False, True):
        torch.library.opcheck(gather_k, (no_grad[0], pre, r.offs, r.src, False, transposed))
        torch.library.opcheck(gather_k, (pre, no_grad[0], r.offs, r.src, True, transposed))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weighted", [True, False])
def test_expert_block_eager_path_equals_its_ops(device, weighted):
    """Eager calls run the ops' autograd.Function twins (no dispatcher round trip): the
    output and every gradient are bitwise those of the two ops called through
    torch.ops, also with int64 indices (converted once), and double backward works on
    both."""
    dtype = F64 if device == "cpu" else torch.bfloat16
    (x, w_in, w_out, weights), ids, r = _block_case(device=device, dtype=dtype, seed=21)
    wts = weights if weighted else None
    go = torch.randn(x.shape, dtype=F64).to(device, dtype)
    inputs = (x, w_in, w_out) + ((weights,) if weighted else ())
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, wts)
    assert "Fn" in out.grad_fn.name()  # the eager twin ran
    grads = torch.autograd.grad(out, inputs, go)
    src, inv = r.src.to(torch.int32), r.inverse.to(torch.int32)
    pre, act = torch.ops.groupmm.swiglu_up(x, w_in, r.offs, src, inv)
    ref = torch.ops.groupmm.gated_down(pre, act, w_out, r.offs, src, inv, wts, True)
    assert "gated_down" in ref.grad_fn.name()
    ref_grads = torch.autograd.grad(ref, inputs, go)
    assert torch.equal(out, ref)
    for name, g, w in zip(("x", "w_in", "w_out", "weights"), grads, ref_grads):
        assert torch.equal(g, w), name
    if device == "cpu":  # double backward through the twins
        out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, wts)
        (gx,) = torch.autograd.grad(out, x, go, create_graph=True)
        (ggw,) = torch.autograd.grad(gx.sum(), w_in)
        out = torch.ops.groupmm.gated_down(
            *torch.ops.groupmm.swiglu_up(x, w_in, r.offs, src, inv), w_out, r.offs, src, inv, wts
        )
        (gx_ref,) = torch.autograd.grad(out, x, go, create_graph=True)
        (ggw_ref,) = torch.autograd.grad(gx_ref.sum(), w_in)
        torch.testing.assert_close(ggw, ggw_ref)


def test_dgated_composition_against_its_formula():
    """The backward's composed "dgated" parts against the formulas written out: p = dy
    w_out[g]^T, dpre = [s p u sig (1 + g (1 - sig)) | s p g sig], act_s = s silu(g) u,
    row_grad = sum_f p silu(g) u; rows past offs[-1] zero."""
    from groupmm._fused_ops import _dgated

    gen = torch.Generator().manual_seed(11)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    R, D, Fh = 9, 5, 4
    dy = torch.randn(R, D, generator=gen, dtype=F64)
    w_out = torch.randn(3, Fh, D, generator=gen, dtype=F64)
    pre = torch.randn(R, 2 * Fh, generator=gen, dtype=F64)
    scale = torch.rand(R, generator=gen, dtype=F64)
    dpre, act_s, row_grad = _dgated(dy, w_out, offs, pre, scale, None)
    group = [0, 0, 0, 2, 2, 2, 2]
    p = torch.zeros(R, Fh, dtype=F64)
    for row, g in enumerate(group):
        p[row] = dy[row] @ w_out[g].t()
    gate, up = pre[:, :Fh], pre[:, Fh:]
    sig, s = torch.sigmoid(gate), scale[:, None]
    want_dpre = torch.cat([s * p * up * sig * (1 + gate * (1 - sig)), s * p * gate * sig], 1)
    torch.testing.assert_close(dpre, want_dpre)
    torch.testing.assert_close(act_s, s * F.silu(gate) * up)
    torch.testing.assert_close(row_grad, (p * F.silu(gate) * up).sum(1))
    assert torch.count_nonzero(dpre[7:]) == 0 and torch.count_nonzero(row_grad[7:]) == 0


def _stub_swiglu_mm(calls):
    """A stand-in for the native fused up projection (what a Hopper kernel returns),
    written from the contract with torch: pre = x[src] @ w[g] (w = [gate | up], or the
    gate with up given), act from pre."""

    def swiglu_mm(x, w, offs, src=None, up=None):
        calls.append("swiglu_mm")
        w = w if up is None else torch.cat([w, up], -1)
        rows = x if src is None else x[src.long()]
        pre = torch.zeros(rows.shape[0], w.shape[-1], dtype=torch.float32)
        start = 0
        for g, end in enumerate(offs.tolist()):
            pre[start:end] = rows[start:end].float() @ w[g].float()
            start = end
        gate, up = pre.chunk(2, dim=-1)
        return pre.to(x.dtype), (F.silu(gate) * up).to(x.dtype)

    return swiglu_mm


def _stub_dgated_mm(calls):
    """A stand-in for the native "dgated" product, from its contract, with the router
    weight gradient split over two column tiles as the kernel's partial sums are."""

    def dgated_mm(dy, w_out, offs, pre, scale, src=None, out=None):
        calls.append(
            "dgated_mm" if out is None else ("dgated_mm", "over pre" if out is pre else "out")
        )
        if src is not None:  # dy [T, D]: row r of the product reads dy[src[r]]
            dy = dy[src.long()]
        assert scale.dtype == torch.float32 and scale.shape == (dy.shape[0],)
        Fh = w_out.shape[1]
        p = torch.zeros(dy.shape[0], Fh, dtype=torch.float32)
        start = 0
        for g, end in enumerate(offs.tolist()):
            p[start:end] = dy[start:end].float() @ w_out[g].float().t()
            start = end
        gate, up = pre.float().chunk(2, dim=-1)
        sig, s = torch.sigmoid(gate), scale[:, None]
        dpre = torch.cat([s * p * up * sig * (1 + gate * (1 - sig)), s * p * gate * sig], 1)
        act = F.silu(gate) * up
        dots = p * act
        partial = torch.stack([dots[:, :1].sum(1), dots[:, 1:].sum(1)])
        if out is not None:  # the contract: dpre written into out, out returned
            dpre = out.copy_(dpre)
        return dpre.to(dy.dtype), (s * act).to(dy.dtype), partial

    return dgated_mm


def _stub_product(calls):
    """A stand-in for ``_native.product``: the epilogues' stand-ins above by name."""
    swiglu_mm, dgated_mm = _stub_swiglu_mm(calls), _stub_dgated_mm(calls)

    def product(epilogue, x, w, offs, operands=(), src=None, out=None):
        if epilogue == "swiglu":
            return swiglu_mm(x, w, offs, src, *operands)
        assert epilogue == "dgated", epilogue
        return dgated_mm(x, w, offs, *operands, src=src, out=out)

    return product


def _stub_gather_k_mm(calls):
    """A stand-in for the native weight gradient on gathered rows, from its contract:
    ``out[g] = sum_r a_r^T b_r`` with ``a_r = a[src[r]]`` (``b_r = b[src[r]]`` with
    ``gathered_b``), in float64, laid out as asked."""

    def gather_k_mm(a, b, offs, src, gathered_b=False, transposed=False, out=None):
        calls.append(("gather_k_mm", "gathered_b" if gathered_b else "gathered_a"))
        idx = src.long()
        a_rows, b_rows = (a, b[idx]) if gathered_b else (a[idx], b)
        into = out
        got = torch.zeros(offs.shape[0], a.shape[1], b.shape[1], dtype=F64)
        start = 0
        for g, end in enumerate(offs.tolist()):
            got[g] = a_rows[start:end].double().t() @ b_rows[start:end].double()
            start = end
        got = got.to(a.dtype)
        if into is not None:
            return into.copy_(got)
        return got.transpose(-2, -1).contiguous().transpose(-2, -1) if transposed else got

    return gather_k_mm


def test_expert_block_uses_the_native_fused_functions(monkeypatch):
    """Where the extension answers with a fused kernel's results (here stand-ins written
    from the contract), the block uses them, forward and backward, and gets the
    reference's results; where it answers None it composes."""
    import groupmm._native as native

    calls: list = []
    monkeypatch.setattr(native, "product", _stub_product(calls))
    monkeypatch.setattr(native, "gather_k_mm", _stub_gather_k_mm(calls))
    (x, w_in, w_out, weights), ids, r = _block_case(dtype=torch.float32, seed=12)
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    go = torch.randn(x.shape)
    got = _block_grads(out, [x, w_in, w_out, weights], go)
    # dgated reads dy, the rows' copy of the upstream gradient, made once for it and
    # dw_out (no src: the kernels that read through src are slower than the copy); dw_in
    # reads x's rows through src
    # (autograd frees the graph after this backward: dpre is written over the block's pre)
    assert calls == ["swiglu_mm", ("dgated_mm", "over pre"), ("gather_k_mm", "gathered_a")]
    refs = [t.detach().double().requires_grad_() for t in (x, w_in, w_out, weights)]
    ref = _reference(refs[0], ids, *refs[1:])
    assert_close_rel(out, ref, torch.float32, "out")
    want = _block_grads(ref, refs, go.double())
    for name, g, w in zip("x w_in w_out weights".split(), got, want):
        assert_close_rel(g, w, torch.float32, name)
    # expert_up takes the same fused up projection
    calls.clear()
    expert_up(x, w_in, r.offs, r.src, r.inverse)
    assert calls == ["swiglu_mm"]
    # float64: the kernels' scale is float32, the native dgated is not asked
    calls.clear()
    (x, w_in, w_out, weights), ids, r = _block_case(seed=12)
    expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights).sum().backward()
    assert calls == ["swiglu_mm", ("gather_k_mm", "gathered_a")]
    # answers of None: composed
    monkeypatch.setattr(native, "product", lambda *a, **kw: None)
    (x, w_in, w_out, weights), ids, r = _block_case(dtype=torch.float32, seed=12)
    again = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    assert_close_rel(again, ref, torch.float32, "composed out")
    got = _block_grads(again, [x, w_in, w_out, weights], go)
    for name, g, w in zip("x w_in w_out weights".split(), got, want):
        assert_close_rel(g, w, torch.float32, "composed " + name)


def test_native_fused_functions_answer_none_on_cpu():
    """On the CPU no fused kernel runs: the extension's functions validate and answer
    None, so groupmm.fused composes."""
    import groupmm._native as native

    x, ids, w_in, w_out, weights, r = _setup(dtype=torch.bfloat16)
    assert native.product("swiglu", x, w_in, r.offs, (), r.src) is None
    R = r.src.shape[0]
    dy = torch.randn(R, x.shape[1], dtype=torch.bfloat16)
    pre = torch.randn(R, w_in.shape[-1], dtype=torch.bfloat16)
    scale = torch.rand(R)
    assert native.product("dgated", dy, w_out, r.offs, (pre, scale)) is None
    assert native.product("dgated", x, w_out, r.offs, (pre, scale), src=r.src) is None
    # out: pre itself or apart from it (checked before the answer)
    assert native.product("dgated", dy, w_out, r.offs, (pre, scale), out=pre) is None
    assert (
        native.product("dgated", dy, w_out, r.offs, (pre, scale), out=torch.empty_like(pre)) is None
    )
    room = torch.empty(R + 1, pre.shape[1], dtype=pre.dtype)
    room[:R] = pre
    with pytest.raises(ValueError, match=r"^out: must be pre itself \(same address"):
        native.product("dgated", dy, w_out, r.offs, (room[:R], scale), out=room[1:])
    n_dy, n_pre = dy.numel(), pre.numel()
    flat = torch.empty(n_dy + n_pre, dtype=dy.dtype)
    with pytest.raises(ValueError, match=r"^out: must not share memory with the input dy"):
        over = flat[n_dy - 2 : n_dy - 2 + n_pre].view(pre.shape)
        native.product("dgated", flat[:n_dy].view(dy.shape), w_out, r.offs, (pre, scale), out=over)
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        native.product("dgated", dy, w_out, r.offs, (pre, scale), out=pre[:, :2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
def test_native_gather_k_mm_equals_reference(device, dtype):
    """``_native.gather_k_mm`` (never None: on the CPU it gathers first): ``out[g] =
    sum_r a_r^T b_r`` over group g's rows with a's (or, gathered_b, b's) rows read
    through src, empty groups zero, both output layouts, against a float64 loop."""
    import groupmm._native as native

    gen = torch.Generator().manual_seed(19)
    T, K, N, k = 9, 5, 6, 2
    offs = torch.tensor([4, 4, 11, 18], dtype=torch.int32)
    src = torch.randint(0, T, (T * k,), generator=gen)
    tokens = torch.randn(T, K, generator=gen, dtype=F64)
    rows = torch.randn(T * k, N, generator=gen, dtype=F64)
    want = torch.zeros(4, K, N, dtype=F64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        for i in range(start, end):
            want[g] += torch.outer(tokens[src[i]], rows[i])
        start = end
    tol = {} if dtype == F64 else dict(rtol=2e-2, atol=2e-2)
    args = [t.to(device) for t in (offs, src)]
    a, b = tokens.to(device, dtype), rows.to(device, dtype)
    for transposed in (False, True):
        got = native.gather_k_mm(a, b, args[0], args[1], transposed=transposed)
        assert got.dtype == dtype and got.shape == (4, K, N)
        assert (got.stride(-2) == 1) == transposed
        torch.testing.assert_close(got.cpu().double(), want, **tol)
        # gathered_b: a_r = b's rows, b_r = tokens[src[r]]: the transposed products
        got = native.gather_k_mm(b, a, args[0], args[1], gathered_b=True, transposed=transposed)
        assert got.shape == (4, N, K)
        torch.testing.assert_close(got.cpu().double(), want.transpose(-2, -1), **tol)


def test_expert_block_bad_arguments():
    x, ids, w_in, w_out, weights, r = _setup()
    ok = (r.offs, r.src, r.inverse, weights)
    with pytest.raises(ValueError, match=r"^w_in: expected an even last dimension"):
        expert_block(x, w_in[..., :-1], w_out, *ok)
    with pytest.raises(ValueError, match=r"^w_in: expected shape \[E=4, D=5, 2F\]"):
        expert_block(x, w_in[:, :-1], w_out, *ok)
    with pytest.raises(ValueError, match=r"^w_out: expected shape \[E=4, F=3, D=5\]"):
        expert_block(x, w_in, w_out[:, :-1], *ok)
    with pytest.raises(ValueError, match=r"^w_out: expected shape \[E, F, D\]"):
        expert_block(x, w_in, w_out[0], *ok)
    with pytest.raises(TypeError, match=r"^w_out: expected dtype torch.float64 \(the dtype of x\)"):
        expert_block(x, w_in, w_out.float(), *ok)
    with pytest.raises(ValueError, match=r"^inverse: expected shape \[T=7, k\] with T\*k"):
        expert_block(x, w_in, w_out, r.offs, r.src, r.inverse[:-1], weights)
    with pytest.raises(TypeError, match=r"^src: expected an integer dtype"):
        expert_block(x, w_in, w_out, r.offs, r.src.double(), r.inverse, weights)
    with pytest.raises(ValueError, match=r"^weights: expected shape \[7, 2\]"):
        expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights.t())
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor"):
        expert_block(None, w_in, w_out, *ok)


# --------------------------------------------------------------------------- GPU


def _hopper() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _gpu_case(T=300, D=256, Fh=128, E=8, k=2, seed=13):
    """bf16 on the GPU at sizes the fused kernels take (16-byte aligned rows), routes
    with an empty expert and T*k = 600 rows."""
    return _block_case(T, D, Fh, E, k, seed, "cuda", torch.bfloat16, empty=(5,))


@pytest.mark.cuda
def test_expert_block_cuda_bf16_equals_reference_without_host_sync():
    (x, w_in, w_out, weights), ids, r = _gpu_case()
    with torch.no_grad():
        for w in (w_in, w_out):
            w.div_(w.shape[1] ** 0.5)
    go = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
        got = _block_grads(out, [x, w_in, w_out, weights], go)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    refs = [t.detach().cpu().double().requires_grad_() for t in (x, w_in, w_out, weights)]
    ref = _reference(refs[0], ids.cpu(), *refs[1:])
    assert_close_rel(out, ref, torch.bfloat16, "out")
    want = _block_grads(ref, refs, go.cpu().double())
    for name, g, w in zip("x w_in w_out weights".split(), got, want):
        assert_close_rel(g, w, torch.bfloat16, name)


@pytest.mark.cuda
def test_native_fused_functions_run_on_hopper_bf16():
    """On sm_90 in bf16 at aligned sizes the fused kernels run: the extension answers
    lists, not None, of the contract's shapes and dtypes."""
    import groupmm._native as native

    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    (x, w_in, w_out, weights), ids, r = _gpu_case()
    R, Fh = r.src.shape[0], w_out.shape[1]
    got = native.product("swiglu", x.detach(), w_in.detach(), r.offs, (), r.src)
    assert isinstance(got, list) and len(got) == 2
    assert got[0].shape == (R, 2 * Fh) and got[1].shape == (R, Fh)
    dy = torch.randn(R, x.shape[1], device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(R, device="cuda")
    got = native.product("dgated", dy, w_out.detach(), r.offs, (got[0], scale))
    assert isinstance(got, list) and len(got) == 3
    dpre, act_s, partial = got
    assert dpre.shape == (R, 2 * Fh) and act_s.shape == (R, Fh)
    assert partial.dtype == torch.float32 and partial.shape == (-(-Fh // 64), R)
    # with src: dy is the tokens' gradient [T, D], row r of the product reads dy[src[r]]
    d_out = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)
    pre = native.product("swiglu", x.detach(), w_in.detach(), r.offs, (), r.src)[0]
    routed = native.product("dgated", d_out, w_out.detach(), r.offs, (pre, scale), src=r.src)
    copied = native.product("dgated", d_out[r.src], w_out.detach(), r.offs, (pre, scale))
    assert isinstance(routed, list) and len(routed) == 3
    for name, a, b in zip(("dpre", "act_s", "partial"), routed, copied):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert_close_rel(a.float(), b.float(), torch.bfloat16, name)


@pytest.mark.cuda
def test_expert_block_cuda_fused_equals_composed(monkeypatch):
    """The fused kernels' path and the composition (native functions answering None)
    agree to bf16 rounding, values and gradients; each is deterministic."""
    import groupmm._native as native

    (x, w_in, w_out, weights), ids, r = _gpu_case(seed=14)
    go = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16)

    def run():
        out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
        return (out, *_block_grads(out, [x, w_in, w_out, weights], go))

    fused = run()
    for a, b in zip(fused, run()):
        assert torch.equal(a, b)
    monkeypatch.setattr(native, "product", lambda *a, **kw: None)
    composed = run()
    for name, a, b in zip("out x w_in w_out weights".split(), fused, composed):
        assert_close_rel(a, b, torch.bfloat16, name)
