"""groupmm.fused.expert_up / expert_down against an independent float64 reference (a loop
over tokens and their experts), their gradients (gradcheck, gradgradcheck), the custom
ops (opcheck, torch.compile), MoELayer(fused=True) against the unfused layer, and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, F64
from groupmm._glue import routes
from groupmm.fused import expert_down, expert_up
from groupmm.moe import MoELayer


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
    torch.manual_seed(4)
    a = MoELayer(6, 4, 5, 2, aux_loss_coef=0.01, dtype=fused_dtype)
    b = MoELayer(6, 4, 5, 2, aux_loss_coef=0.01, fused=True, dtype=fused_dtype)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 4, 6, dtype=fused_dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, auxa = a(xa, return_aux_loss=True)
    yb, auxb = b(xb, return_aux_loss=True)
    go = torch.randn_like(ya)
    (ya * go).sum().add(auxa).backward()
    (yb * go).sum().add(auxb).backward()
    tol = {} if fused_dtype == F64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(yb, ya, **tol)
    torch.testing.assert_close(xb.grad, xa.grad, **tol)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, **tol, msg=name)


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
    torch.library.opcheck(torch.ops.groupmm.gather_mm.default, (x, w_in, r.offs, r.src, r.inverse))
    pre = torch.randn(r.src.shape[0], 4, dtype=F64, requires_grad=True)
    torch.library.opcheck(torch.ops.groupmm.swiglu_act.default, (pre,))
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
