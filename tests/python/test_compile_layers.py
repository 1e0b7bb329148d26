"""``torch.compile(fullgraph=True)`` of the MoE layer's entry points on the device users
run them on, forward and backward, equal to eager: ``MoELayer`` (fused and unfused),
``expert_block`` and a transformers model on groupmm, on CUDA (bf16, Inductor); and, on
every machine, the guard that would have caught a CUDA-only break on the CPU: every
device decision on the traced path traces for every device kind (module constants and
tensor metadata only, never a call into the extension while tracing)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import HAS_CUDA, rel_err
from groupmm import _fused_ops, _rows
from groupmm._glue import routes
from groupmm.fused import expert_block
from groupmm.moe import MoELayer

KINDS = ["cpu", "cuda", "meta"]
DTYPES = [torch.float32, torch.bfloat16]


def _no_breaks(fn, *args):
    """``fn(*args)`` compiled with ``fullgraph=True`` (no graph may break) and eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(fn, fullgraph=True, backend="eager")(*args)
    assert dict(counters["graph_break"]) == {}
    return got, fn(*args)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_decision_traces_for_every_device(kind, dtype):
    """The router's choice between the native top-k and ``torch.topk`` for a tensor on
    ``kind``, traced on this machine's CPU: ``_rows.topk_ids_takes`` reads constants and
    metadata only (it once called into the extension on CUDA alone, which broke
    ``fullgraph=True`` there and nowhere else)."""
    x = torch.ones(3, 8, dtype=dtype)

    def f(x):
        if _rows.topk_ids_takes(kind, x.dtype, x.dim(), x.shape[-1]):
            return x + 1
        return x - 1

    got, want = _no_breaks(f, x)
    assert torch.equal(got, want)
    expect = kind == "cpu" or (kind == "cuda" and _rows.CUDA_BUILD)
    assert torch.equal(got, x + 1 if expect else x - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_decision_traces_for_every_device(kind):
    """The backward's choice of where routed rows are gathered
    (``_fused_ops.gathers_in_gemm``), traced for every device kind: a constant of the
    device and dtype, taken at trace time (compiled autograd traces the backward)."""
    x = torch.ones(4, dtype=torch.bfloat16)

    def f(x):
        if _fused_ops.gathers_in_gemm(kind, 0, x.dtype):
            return x + 1
        return x - 1

    got, want = _no_breaks(f, x)
    assert torch.equal(got, want)
    if kind != "cuda":
        assert torch.equal(got, x - 1)


def test_traced_decisions_never_call_the_extension(monkeypatch):
    """The decisions on the traced path answer for a CUDA tensor's description without
    calling the extension (every ``_native`` attribute replaced by one that raises)."""

    class NoNative:
        def __getattr__(self, name):
            raise AssertionError(f"_native.{name} called on the traced path")

    monkeypatch.setattr(_rows, "_native", NoNative())
    for kind in KINDS:
        for dtype in DTYPES:
            _rows.topk_ids_takes(kind, dtype, 2, 64)


# --------------------------------------------------------------------------- CUDA


def _layer_grads(layer, x, go):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out, aux = layer(x, return_aux_loss=True)
    ((out.float() * go).sum() + aux).backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
@pytest.mark.parametrize("fused", [True, False])
def test_moe_layer_compiles_on_cuda(fused):
    """``MoELayer`` (fused: the default; unfused: ``fused=False``) compiled with
    ``fullgraph=True`` through Inductor on CUDA in bf16: no graph break, the output and
    every gradient equal to eager within bf16 rounding, and both within bf16 error of a
    float32 reference."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    E, T = 8, 200
    layer = MoELayer(64, 96, E, 2, fused=fused, device="cuda", dtype=torch.bfloat16)
    # routing no rounding can change (bf16 logits tie often): gate row e reads input
    # column e, and each token's first E columns rank the experts one apart
    with torch.no_grad():
        gate = layer.router.gate.weight
        gate.normal_(0.0, 0.002)
        gate[:, :E] = 4.0 * torch.eye(E)
    ref = copy.deepcopy(layer).float()
    x = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16)
    levels = torch.rand(T, E, device="cuda").argsort(1).float() + 1.0
    x[:, :E] = (levels / 4.0).bfloat16()  # multiples of 1/4: exact
    go = torch.randn(T, 64, device="cuda")
    eager = _layer_grads(layer, x, go)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True)
    got = _layer_grads(compiled, x, go)
    assert dict(counters["graph_break"]) == {}
    want = _layer_grads(ref, x.float(), go)
    assert rel_err(got[0], eager[0]) < 1e-2 and rel_err(got[1], eager[1]) < 1e-2
    assert rel_err(got[0], want[0]) < 2e-2 and rel_err(got[1], want[1]) < 2e-2
    for name, g in got[2].items():
        key = name.removeprefix("_orig_mod.")
        assert rel_err(g, eager[2][key]) < 2e-2, name
        assert rel_err(g, want[2][key]) < 3e-2, name


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
@pytest.mark.parametrize("dynamic", [False, True])
def test_expert_block_compiles_on_cuda(dynamic):
    """``expert_block`` (the fused kernels: SwiGLU and DGated epilogues, rows read
    through ``src``) under Inductor on CUDA: equal to eager (forward bitwise: the same
    kernels), gradients within rounding; a second token count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    E, D, Fh, k = 8, 128, 128, 2

    def weights(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-2] ** 0.5).cuda().bfloat16()

    w_in = weights(E, D, 2 * Fh).requires_grad_()
    w_out = weights(E, Fh, D).requires_grad_()

    def f(x, w_in, w_out, weights, ids):
        r = routes(ids, E)
        return expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for T in (256, 320):
        x = torch.randn(T, D, generator=gen).cuda().bfloat16().requires_grad_()
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
        wts = torch.rand(T, k, generator=gen).cuda().bfloat16().requires_grad_()
        go = torch.randn(T, D, generator=gen).cuda().bfloat16()
        inputs = [x, w_in, w_out, wts]
        got = compiled(*inputs, ids)
        got_grads = torch.autograd.grad(got, inputs, go)
        want = f(*inputs, ids)
        want_grads = torch.autograd.grad(want, inputs, go)
        assert torch.equal(got, want)
        for g, w in zip(got_grads, want_grads):
            assert rel_err(g, w) < 1e-2
    assert dict(counters["graph_break"]) == {}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_transformers_model_compiles_on_cuda(family):
    """A transformers model with groupmm as its experts implementation, compiled whole
    with ``fullgraph=True`` on CUDA in bf16: one graph, logits and gradients equal to
    eager groupmm within bf16 rounding."""
    pytest.importorskip("transformers")
    import groupmm.integrations.transformers as gt
    from test_integration_transformers import _ids, _model
    from torch._dynamo.utils import counters

    model = _model(family).to("cuda", torch.bfloat16)
    gt.enable(model)
    ids = _ids().cuda()

    def step(m):
        model.zero_grad(set_to_none=True)
        logits = m(ids).logits
        logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = step(model)
    torch._dynamo.reset()
    counters.clear()
    got = step(torch.compile(model, fullgraph=True))
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert rel_err(got[0], eager[0]) < 2e-2
    for name, g in got[1].items():
        assert rel_err(g, eager[1][name]) < 5e-2, name
    torch._dynamo.reset()
