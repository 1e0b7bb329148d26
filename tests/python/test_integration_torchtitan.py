"""groupmm in torchtitan's MoE (``groupmm.integrations.torchtitan``).

torchtitan 0.3.0 (PyPI) cannot import its MoE module on a CPU-only test machine without
triton, tyro and spmd_types, so it is not installed in CI. These tests run against
``StandInGroupedExperts``, a minimal stand-in with the same ``_grouped_mm(self, *, A,
B_t, offs)`` contract and the same forward as torchtitan's ``GroupedExperts`` (weights
through ``to_local()`` when they are DTensors, ``.type_as(x)``; its bfloat16 casts are
``compute_dtype``, None by default so that float64 checks are possible), whose default
``_grouped_mm`` is an independent per-group loop. Both paths are tested on it: the seam
(``fused=False``, what ``fused=None`` picks for it) and the fused block (``fused=True``).
The fused block reads ``w1``/``w3`` in place as the pair ``(gate, up)``: tested against
the old ``[w1 | w3]`` concatenation and for saving no weight copy. When
``torchtitan.models.common.moe`` imports, the real ``GroupedExperts`` (fused) and
``GptOssGroupedExperts`` (seam) are tested too, and torchtitan's own expert parallelism
on 2 gloo processes (``torchtitan_ep_worker.py``: the experts path and ``enable_moe``'s
whole layer). The DTensor weights case runs on gloo without torchtitan. The whole-layer
converter's other tests: ``test_torchtitan_moe.py``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import HAS_CUDA
from groupmm.integrations import torchtitan as tt

F64 = torch.float64
HERE = Path(__file__).resolve().parent


def loop_grouped_mm(A, B_t, offs):
    """Reference of ``torch._grouped_mm(A, B_t, offs=offs)``: per-group products, rows
    past ``offs[-1]`` zero."""
    out = A.new_zeros(A.shape[0], B_t.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = A[start:end] @ B_t[g]
        start = end
    return out


def _local(w):
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class StandInGroupedExperts(torch.nn.Module):
    """torchtitan's ``GroupedExperts`` contract: weights ``w1 [E, F, D]``, ``w2 [E, D,
    F]``, ``w3 [E, F, D]``; ``forward(x_RD, num_tokens_per_expert_E)`` with SwiGLU; every
    product through ``self._grouped_mm(A=..., B_t=w.transpose(-2, -1), offs=...)``; the
    weights' local tensors when they are DTensors; operands in ``compute_dtype``
    (torchtitan's forward: bfloat16) and the output in ``x``'s dtype."""

    compute_dtype = None

    def __init__(self, dim, hidden_dim, num_experts, dtype=F64, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.num_experts = num_experts

        def param(*shape):
            w = torch.randn(*shape, generator=gen, dtype=F64) / shape[-1] ** 0.5
            return torch.nn.Parameter(w.to(dtype))

        self.w1_EFD = param(num_experts, hidden_dim, dim)
        self.w2_EDF = param(num_experts, dim, hidden_dim)
        self.w3_EFD = param(num_experts, hidden_dim, dim)

    def forward(self, x_RD, num_tokens_per_expert_E):
        w1, w2, w3 = (_local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        dtype = self.compute_dtype or x_RD.dtype
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        x = x_RD.to(dtype)
        h = F.silu(self._grouped_mm(A=x, B_t=w1.to(dtype).transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x, B_t=w3.to(dtype).transpose(-2, -1), offs=offs)
        y = self._grouped_mm(A=h, B_t=w2.to(dtype).transpose(-2, -1), offs=offs)
        return y.type_as(x_RD)

    def _grouped_mm(self, *, A, B_t, offs):
        return loop_grouped_mm(A, B_t, offs)


def _routed(rows=23, dim=12, counts=(5, 0, 9, 6), dtype=F64, seed=1):
    """Rows sorted by expert (one expert empty) plus 3 padding rows past the last group."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen, dtype=F64).to(dtype).requires_grad_(True)
    assert sum(counts) == rows - 3
    return x, torch.tensor(counts)


def _grads(module, x, counts, go):
    module.zero_grad(set_to_none=True)
    x.grad = None
    out = module(x, counts)
    out.backward(go)
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out.detach(), x.grad.clone(), grads


def test_subclass_matches_the_contract_in_float64():
    ref_module = StandInGroupedExperts(12, 8, 4)
    module = StandInGroupedExperts(12, 8, 4)
    module.__class__ = tt.groupmm_experts_class(StandInGroupedExperts)
    assert isinstance(module, StandInGroupedExperts)
    x, counts = _routed()
    go = torch.randn(23, 12, dtype=F64)
    out, dx, grads = _grads(module, x, counts, go)
    ref, ref_dx, ref_grads = _grads(ref_module, x, counts, go)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-12, msg=name)
        # the weight gradient arrives in the parameter's own layout (no transposed copy)
        assert g.stride() == dict(module.named_parameters())[name].stride(), name
    assert (out[20:] == 0).all() and (dx[20:] == 0).all()  # padding rows
    assert grads["w1_EFD"][1].abs().max() == 0  # the empty expert


def test_gradcheck_through_the_seam():
    module = StandInGroupedExperts(5, 3, 3)
    tt.enable(module)
    names = [n for n, _ in module.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in module.parameters())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 5, generator=gen, dtype=F64, requires_grad=True)
    counts = torch.tensor([3, 0, 4])

    def f(x, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x, counts))

    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params), fast_mode=True)


def test_enable_switches_every_experts_module_and_is_idempotent():
    model = torch.nn.Sequential(StandInGroupedExperts(6, 4, 2), StandInGroupedExperts(6, 4, 2))
    assert tt.enable(model) == 2
    assert tt.enable(model) == 2
    cls = type(model[0])
    assert cls is type(model[1]) and cls.__name__ == "GroupmmStandInGroupedExperts"
    assert tt.groupmm_experts_class(cls) is cls
    assert tt.groupmm_experts_class(StandInGroupedExperts) is cls
    with pytest.raises(ValueError, match="holds no experts module"):
        tt.enable(torch.nn.Linear(3, 3))
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        tt.enable(object())
    with pytest.raises(TypeError, match="parent: expected a class with a _grouped_mm"):
        tt.groupmm_experts_class(torch.nn.Linear)


def test_the_seam_runs_on_groupmm(monkeypatch):
    """The patched seam really calls groupmm (spy on the function it routes to)."""
    import groupmm.integrations as gi

    calls = []
    real = gi.grouped_mm
    monkeypatch.setattr(gi, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    module = StandInGroupedExperts(6, 4, 3)
    tt.enable(module)
    x, _ = _routed(rows=9, dim=6, counts=(2, 3, 1))
    module(x, torch.tensor([2, 3, 1]))
    assert len(calls) == 3


def test_compile_fullgraph_through_the_seam():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = StandInGroupedExperts(12, 8, 4, dtype=torch.float32)
    tt.enable(module)
    x, counts = _routed(dtype=torch.float32)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    out = compiled(x, counts)
    out.sum().backward()
    assert dict(counters["graph_break"]) == {}
    ref = StandInGroupedExperts(12, 8, 4, dtype=torch.float32)
    torch.testing.assert_close(out, ref(x, counts), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_offsets_of_another_integer_dtype_are_accepted():
    gen = torch.Generator().manual_seed(4)
    A = torch.randn(7, 3, generator=gen, dtype=F64)
    B_t = torch.randn(2, 3, 5, generator=gen, dtype=F64)
    offs = torch.tensor([4, 7])
    torch.testing.assert_close(tt.groupmm_grouped_mm(A, B_t, offs), loop_grouped_mm(A, B_t, offs))


# --------------------------------------------------------------------------- the fused block


def _fused(dim=12, hidden=8, experts=4, dtype=F64, compute=None, seed=0):
    """The stand-in on the fused block (``fused=True``: its forward is not torchtitan's
    own, so ``fused=None`` keeps it on the seam), computing in ``compute`` (None: the
    input's dtype)."""
    module = StandInGroupedExperts(dim, hidden, experts, dtype=dtype, seed=seed)
    tt.enable(module, fused=True)
    module.groupmm_dtype = compute
    return module


def test_fused_block_matches_the_reference_in_float64(monkeypatch):
    import groupmm.integrations as gi

    seam_calls, block_calls = [], []
    real_mm, real_block = gi.grouped_mm, tt.expert_compute
    monkeypatch.setattr(gi, "grouped_mm", lambda *a, **k: seam_calls.append(1) or real_mm(*a, **k))
    monkeypatch.setattr(
        tt, "expert_compute", lambda *a, **k: block_calls.append(a) or real_block(*a, **k)
    )
    ref_module = StandInGroupedExperts(12, 8, 4)
    module = _fused()
    assert type(module).__name__ == "GroupmmFusedStandInGroupedExperts"
    x, counts = _routed()  # expert 1 empty, 3 padding rows
    go = torch.randn(23, 12, dtype=F64)
    out, dx, grads = _grads(module, x, counts, go)
    ref, ref_dx, ref_grads = _grads(ref_module, x, counts, go)
    assert len(block_calls) == 1 and not seam_calls  # one fused block, no seam product
    rows, (gate, up), w_out = block_calls[0]
    assert gate.shape == up.shape == (4, 12, 8) and w_out.shape == (4, 8, 12)
    # the pair and w_out: views of the parameters' own storage, no copy
    assert gate.data_ptr() == module.w1_EFD.data_ptr() and gate.stride() == (96, 1, 12)
    assert up.data_ptr() == module.w3_EFD.data_ptr()
    assert w_out.data_ptr() == module.w2_EDF.data_ptr()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    params = dict(module.named_parameters())
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-12, msg=name)
        # each weight's gradient in its parameter's own layout, through the views
        assert g.is_contiguous() and g.stride() == params[name].stride(), name
    assert (out[20:] == 0).all() and (dx[20:] == 0).all()  # padding rows
    for name in grads:
        assert grads[name][1].abs().max() == 0, name  # the empty expert


def test_fused_gradcheck():
    module = _fused(5, 3, 3)
    names = [n for n, _ in module.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for p in module.parameters())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 5, generator=gen, dtype=F64, requires_grad=True)
    counts = torch.tensor([3, 0, 4])  # 2 padding rows

    def f(x, *ps):
        return torch.func.functional_call(module, dict(zip(names, ps)), (x, counts))

    assert torch.autograd.gradcheck(f, (x, *params))
    assert torch.autograd.gradgradcheck(f, (x, *params), fast_mode=True)


@pytest.mark.parametrize(
    "params, compute, tol",
    [
        (torch.float32, torch.bfloat16, 2e-2),  # torchtitan's: fp32 params, bf16 compute
        (torch.bfloat16, torch.bfloat16, 2e-2),  # FSDP mixed precision: bf16 params
        (torch.float32, F64, 1e-6),  # a float64 compute of float32 params
        (torch.float32, None, 1e-5),  # None: the input's dtype
    ],
)
def test_fused_dtypes_follow_torchtitan(monkeypatch, params, compute, tol):
    """Rows and weights are cast to ``groupmm_dtype`` (torchtitan: bfloat16), the output
    comes back in ``x``'s dtype, each gradient in its tensor's dtype."""
    seen = []
    real = tt.expert_compute
    monkeypatch.setattr(tt, "expert_compute", lambda *a, **k: seen.append(a) or real(*a, **k))
    module = _fused(dtype=params, compute=compute)
    ref_module = StandInGroupedExperts(12, 8, 4)
    ref_module.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    x, counts = _routed(dtype=params)
    go = torch.randn(23, 12, dtype=F64)
    out, dx, grads = _grads(module, x, counts, go.to(params))
    xr = x.detach().double().requires_grad_(True)
    ref, ref_dx, ref_grads = _grads(ref_module, xr, counts, go)
    want = params if compute is None else compute
    rows, (gate, up), w_out = seen[0]
    assert all(t.dtype == want for t in (rows, gate, up, w_out))
    assert out.dtype == params and dx.dtype == params
    for got, r in [(out, ref), (dx, ref_dx), *((grads[n], ref_grads[n]) for n in grads)]:
        err = (got.double() - r).norm() / r.norm()
        assert err < tol, err
    for name, g in grads.items():
        assert g.dtype == params and g.is_contiguous(), name
    if compute == torch.bfloat16:  # torchtitan's own forward (bf16 products) agrees
        twin = StandInGroupedExperts(12, 8, 4, dtype=params)
        twin.load_state_dict(module.state_dict())
        twin.compute_dtype = torch.bfloat16
        theirs = twin(x.detach(), counts)
        assert theirs.dtype == params
        assert ((out.double() - theirs.double()).norm() / ref.norm()) < tol


def _recording(fn):
    """Run ``fn`` under saved-tensor hooks that record every tensor autograd keeps for
    the backward: ``(fn(), [(storage data_ptr, storage bytes, shape) of each])``."""
    saved = []

    def pack(t):
        storage = t.untyped_storage()
        saved.append((storage.data_ptr(), storage.nbytes(), tuple(t.shape)))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_no_weight_copy_is_made_or_kept():
    """The pair ``(w1, w3)`` is read in place: every weight-sized tensor the graph keeps
    for the backward is a parameter's own storage (no ``[w1 | w3]`` concatenation), and
    the gradients are right."""
    module = _fused()  # float64 parameters, float64 compute: no cast either
    ref_module = StandInGroupedExperts(12, 8, 4)
    x, counts = _routed()
    go = torch.randn(23, 12, dtype=F64)
    out, saved = _recording(lambda: module(x, counts))
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    weights = [entry for entry in saved if len(entry[2]) == 3]
    assert weights and all(ptr in params for ptr, _, _ in weights), saved
    out.backward(go)
    ref = ref_module(x.detach(), counts)
    ref.backward(go)
    for name, p in module.named_parameters():
        r = dict(ref_module.named_parameters())[name].grad
        torch.testing.assert_close(p.grad, r, rtol=1e-12, atol=1e-12, msg=name)


def test_the_pair_matches_the_concatenated_weights():
    """The fused path on the pair ``(w1ᵀ, w3ᵀ)`` gives what the block gives on the old
    ``[w1 | w3]`` concatenation: output, dx and each weight's gradient (float64)."""
    module = _fused()
    x, counts = _routed()
    go = torch.randn(23, 12, dtype=F64)
    out, dx, grads = _grads(module, x, counts, go)
    ws = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    x2 = x.detach().clone().requires_grad_(True)
    w_in = torch.cat([ws["w1_EFD"], ws["w3_EFD"]], 1).transpose(1, 2)
    cat = tt.expert_compute(x2, w_in, ws["w2_EDF"].transpose(1, 2), counts=counts)
    cat.backward(go)
    torch.testing.assert_close(out, cat.detach(), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dx, x2.grad, rtol=1e-13, atol=1e-13)
    for name, g in grads.items():
        torch.testing.assert_close(g, ws[name].grad, rtol=1e-13, atol=1e-13, msg=name)


def test_changing_the_weights_between_forward_and_backward_raises():
    module = _fused()
    x, counts = _routed()
    out = module(x, counts)
    with torch.no_grad():
        module.w3_EFD.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_fused_block_under_activation_checkpointing():
    """Under torch.utils.checkpoint (non-reentrant) the fused path's saved tensors go to
    checkpoint's hooks (recomputed); same results."""
    from torch.utils.checkpoint import checkpoint

    module = _fused()
    ref_module = StandInGroupedExperts(12, 8, 4)
    x, counts = _routed()
    go = torch.randn(23, 12, dtype=F64)
    ref, ref_dx, ref_grads = _grads(ref_module, x, counts, go)
    x.grad = None
    out = checkpoint(module, x, counts, use_reentrant=False)
    out.backward(go)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_dx, rtol=1e-12, atol=1e-12)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-12, atol=1e-12, msg=name)


def test_compile_fullgraph_fused_saves_only_the_parameters():
    """Under torch.compile: no graph break, same results, and the only weight-sized
    tensors the forward graph keeps for the backward (min-cut partitioner, as
    inductor's) are the parameters (graph inputs) or views of them: no weight copy."""
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch._dynamo.reset()
    counters.clear()
    saved = []

    def fw(gm, example):
        (outputs,) = gm.graph.find_nodes(op="output")[0].args
        for node in outputs:
            if isinstance(node, torch.fx.Node):
                saved.append((node.op, tuple(node.meta["val"].shape), str(node.target)))
        return make_boxed_func(gm)

    def backend(gm, example):
        return aot_module_simplified(
            gm,
            example,
            fw_compiler=fw,
            bw_compiler=lambda gm, example: make_boxed_func(gm),
            partition_fn=min_cut_rematerialization_partition,
        )

    module = _fused(dtype=torch.float32)
    ref_module = StandInGroupedExperts(12, 8, 4, dtype=torch.float32)
    x, counts = _routed(dtype=torch.float32)
    go = torch.randn(23, 12)
    ref, ref_dx, ref_grads = _grads(ref_module, x, counts, go)
    for run in (backend, "aot_eager"):
        compiled = torch.compile(module, fullgraph=True, backend=run)
        out, dx, grads = _grads(compiled, x, counts, go)
        assert dict(counters["graph_break"]) == {}
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)
        for name, g in grads.items():
            name = name.removeprefix("_orig_mod.")
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-5, msg=name)
            assert g.is_contiguous(), name
        torch._dynamo.reset()
        if run is backend:
            # the parameters or their transposed views (the pair, w_out): no copy
            weights = [(op, target) for op, shape, target in saved if len(shape) == 3]
            views = ("placeholder", "aten.transpose.int")
            assert weights and all(op in views or t in views for op, t in weights), saved


class NamedLikeTorchtitan(StandInGroupedExperts):
    """The stand-in, its forward named as torchtitan's ``GroupedExperts.forward`` (what
    ``fused=None`` looks for)."""

    def forward(self, x_RD, num_tokens_per_expert_E):
        return super().forward(x_RD, num_tokens_per_expert_E)

    forward.__module__ = "torchtitan.models.common.moe"
    forward.__qualname__ = "GroupedExperts.forward"


def test_enable_chooses_the_path():
    class NotSwiglu(torch.nn.Module):  # gpt-oss's shape: other weights, the seam only
        num_experts = 2

        def __init__(self):
            super().__init__()
            self.mlp1_weight = torch.nn.Parameter(torch.zeros(2, 3, 4))

        def _grouped_mm(self, *, A, B_t, offs):
            return loop_grouped_mm(A, B_t, offs)

    model = torch.nn.Sequential(StandInGroupedExperts(6, 4, 2), NotSwiglu())
    stand_in = type(model[0])
    with pytest.raises(TypeError, match="fused=True: NotSwiglu has no SwiGLU experts weights"):
        tt.enable(model, fused=True)
    assert type(model[0]) is stand_in and type(model[1]) is NotSwiglu  # nothing changed
    assert tt.enable(model) == 2  # None: the seam for classes that are not torchtitan's
    assert not type(model[0])._groupmm_fused and not type(model[1])._groupmm_fused
    assert tt.enable(model[0], fused=True) == 1
    fused_cls = type(model[0])
    assert fused_cls.__name__ == "GroupmmFusedStandInGroupedExperts" and fused_cls._groupmm_fused
    assert fused_cls.groupmm_dtype is torch.bfloat16
    assert isinstance(model[0], stand_in)
    assert tt.enable(model) == 2 and type(model[0]) is fused_cls  # None keeps the path
    assert tt.groupmm_experts_class(fused_cls) is fused_cls
    assert tt.groupmm_experts_class(stand_in, fused=True) is fused_cls
    assert tt.enable(model, fused=False) == 2  # and back to the seam
    assert type(model[0]).__name__ == "GroupmmStandInGroupedExperts"
    # None: the seam for torchtitan's SwiGLU forward too (the fused block is asked for)
    named = NamedLikeTorchtitan(6, 4, 2)
    assert tt.enable(named) == 1 and not type(named)._groupmm_fused
    assert not tt.groupmm_experts_class(NamedLikeTorchtitan)._groupmm_fused
    with pytest.raises(TypeError, match="fused: expected None, True or False"):
        tt.enable(model, fused=1)
    with pytest.raises(TypeError, match="fused: expected None, True or False"):
        tt.groupmm_experts_class(stand_in, fused="yes")


def _parallelize_wrapper(module, redistributes):
    """What torchtitan's ``Module.parallelize`` leaves on a module: an instance
    ``forward`` calling the forward of its time, and the sharding config."""
    fn = module.forward

    def forward_with_redistribution(*args, **kwargs):
        return fn(*args, **kwargs)

    forward_with_redistribution.__qualname__ = (
        "Module.parallelize.<locals>.forward_with_redistribution"
    )
    module.forward = forward_with_redistribution
    fields = ("in_src_shardings", "in_dst_shardings", "out_src_shardings")
    fields += ("out_dst_shardings", "local_map")
    config = {f: None for f in fields}
    if redistributes:
        config["in_src_shardings"] = {"x_RD": "R"}
    module._sharding_config = SimpleNamespace(state_shardings={"w1_EFD": "S(0)"}, **config)


def test_enable_after_parallelize(monkeypatch):
    """torchtitan's parallelize wraps the experts' forward in an instance attribute; for
    the experts (weights only) enable drops it so that the fused forward runs, and
    keeps any other on the seam."""
    calls = []
    real = tt.grouped_experts_forward
    monkeypatch.setattr(
        tt, "grouped_experts_forward", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    x, counts = _routed()
    module = StandInGroupedExperts(12, 8, 4)
    want = module(x, counts)
    _parallelize_wrapper(module, redistributes=False)
    tt.enable(module, fused=True)
    assert "forward" not in module.__dict__
    module.groupmm_dtype = None
    torch.testing.assert_close(module(x, counts), want)
    assert calls == [1]

    other = NamedLikeTorchtitan(12, 8, 4)
    _parallelize_wrapper(other, redistributes=True)
    with pytest.raises(ValueError, match="fused=True: NamedLikeTorchtitan has a forward"):
        tt.enable(other, fused=True)
    assert type(other) is NamedLikeTorchtitan
    tt.enable(other)  # None: the seam, the instance forward kept
    assert not type(other)._groupmm_fused and "forward" in other.__dict__


def test_weights_of_another_tensor_subclass_take_the_seam(monkeypatch):
    """Weights that are neither plain tensors nor DTensors (e.g. float8 training
    wrappers) go through the parent's own forward, its products on the seam."""

    class Marked(torch.Tensor):
        pass

    calls = []
    real = tt.grouped_experts_forward
    monkeypatch.setattr(
        tt, "grouped_experts_forward", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    module = _fused()
    ref_module = StandInGroupedExperts(12, 8, 4)
    module.w1_EFD = torch.nn.Parameter(module.w1_EFD.detach().as_subclass(Marked))
    x, counts = _routed()
    out = module(x, counts)
    assert not calls
    torch.testing.assert_close(out.as_subclass(torch.Tensor), ref_module(x, counts))


def _run_worker(case, world, tmp_path):
    cmd = [sys.executable, str(HERE / "torchtitan_ep_worker.py"), case, str(world), str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    results = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), proc.stdout + proc.stderr
        result = json.loads(path.read_text())
        assert "error" not in result, result.get("error")
        results.append(result)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return results


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
@pytest.mark.parametrize("world", [1, 2])
def test_dtensor_weights_on_gloo(tmp_path, world):
    """Expert-sharded DTensor weights (torchtitan's EP layout, ``Shard(0)``): the fused
    path runs on their local tensors, eager and compiled, with DTensor gradients."""
    for result in _run_worker("dtensor", world, tmp_path):
        assert result.pop("dtype") == "torch.float32"
        for name, err in result.items():
            assert err < 1e-6, (name, err)  # float64 compute, float32 in and out


# --------------------------------------------------------------------------- real torchtitan


def _torchtitan_moe():
    return pytest.importorskip(
        "torchtitan.models.common.moe", reason="torchtitan's MoE module does not import here"
    )


def _real_experts(moe, dim=16, hidden=24, experts=4, fused=True, seed=0):
    """A torchtitan ``GroupedExperts`` on groupmm (``fused``), its weights drawn, and a
    float64 stand-in with the same weights (the independent reference)."""
    cls = tt.groupmm_experts_class(moe.GroupedExperts, fused)
    module = cls.Config(dim=dim, hidden_dim=hidden, num_experts=experts).build()
    assert type(module) is cls
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    ref = StandInGroupedExperts(dim, hidden, experts)
    ref.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    return module, ref


def test_real_grouped_experts_bf16():
    """torchtitan's GroupedExperts on the fused block (the default), in its own bf16
    compute: output, dx and every weight gradient against a float64 reference and
    against torchtitan's own forward; padding rows and the empty expert."""
    moe = _torchtitan_moe()
    experts, ref = _real_experts(moe)
    assert type(experts).__name__ == "GroupmmFusedGroupedExperts"
    own = moe.GroupedExperts.Config(dim=16, hidden_dim=24, num_experts=4).build()
    own.load_state_dict(experts.state_dict())
    x, counts = _routed(rows=23, dim=16)  # expert 1 empty, 3 padding rows
    x32 = x.detach().float().requires_grad_(True)
    go = torch.randn(23, 16, dtype=F64)
    out, dx, grads = _grads(experts, x32, counts, go.float())
    want, want_dx, want_grads = _grads(ref, x, counts, go)
    theirs, theirs_dx, theirs_grads = _grads(own, x32, counts, go.float())
    assert out.dtype == torch.float32 and dx.dtype == torch.float32
    n = 20  # counted rows (torchtitan leaves the padding rows' output unwritten)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    assert rel(out[:n], want[:n]) < 2e-2 and rel(out[:n], theirs[:n]) < 2e-2
    assert rel(dx[:n], want_dx[:n]) < 2e-2 and rel(dx[:n], theirs_dx[:n]) < 2e-2
    assert (out[n:] == 0).all() and (dx[n:] == 0).all()
    for name, g in grads.items():
        assert g.dtype == torch.float32 and g.is_contiguous(), name
        assert rel(g, want_grads[name]) < 2e-2 and rel(g, theirs_grads[name]) < 2e-2, name
        assert g[1].abs().max() == 0, name  # the empty expert


def test_real_grouped_experts_float64_compute():
    """The same module computing in float64 (``groupmm_dtype``) matches the float64
    reference to float32 rounding: the fused path's arithmetic, not bf16's, is what the
    bf16 test's tolerance covers."""
    moe = _torchtitan_moe()
    experts, ref = _real_experts(moe)
    experts.groupmm_dtype = F64
    x, counts = _routed(rows=23, dim=16)
    go = torch.randn(23, 16, dtype=F64)
    x32 = x.detach().float().requires_grad_(True)
    out, dx, grads = _grads(experts, x32, counts, go.float())
    want, want_dx, want_grads = _grads(ref, x, counts, go)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g.double(), want_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_real_grouped_experts_compile_fullgraph():
    from torch._dynamo.utils import counters

    moe = _torchtitan_moe()
    experts, _ = _real_experts(moe)
    x, counts = _routed(rows=23, dim=16)
    x32 = x.detach().float().requires_grad_(True)
    go = torch.randn(23, 16)
    want, want_dx, want_grads = _grads(experts, x32, counts, go)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    out, dx, grads = _grads(compiled, x32, counts, go)
    assert dict(counters["graph_break"]) == {}
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(dx, want_dx)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name.removeprefix("_orig_mod.")], msg=name)
    torch._dynamo.reset()


def test_real_grouped_experts_seam_still_available():
    moe = _torchtitan_moe()
    experts, ref = _real_experts(moe, fused=False)
    assert type(experts).__name__ == "GroupmmGroupedExperts"
    x, counts = _routed(rows=23, dim=16)
    out = experts(x.detach().float(), counts)
    want = ref(x.detach(), counts)
    assert ((out[:20].double() - want[:20]).norm() / want[:20].norm()) < 2e-2


def test_real_gpt_oss_grouped_experts_bf16():
    pytest.importorskip("torchtitan.models.gpt_oss.moe", reason="torchtitan does not import here")
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    plain = GptOssGroupedExperts.Config(dim=16, hidden_dim=8, num_experts=3).build()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    cls = tt.groupmm_experts_class(GptOssGroupedExperts)
    assert not cls._groupmm_fused  # biases, clamped activation: the seam
    ours = cls.Config(dim=16, hidden_dim=8, num_experts=3).build()
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(12, 16)
    counts = torch.tensor([4, 0, 6])  # 2 padding rows
    want = plain(x, counts)
    got = ours(x, counts)
    rel = (got.float() - want.float())[:10].norm() / want.float()[:10].norm()
    assert rel < 2e-2, rel
    with pytest.raises(TypeError, match="fused=True: GptOssGroupedExperts has no SwiGLU"):
        tt.enable(plain, fused=True)


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_real_expert_parallel_two_ranks_on_gloo(tmp_path):
    """torchtitan's own EP on 2 gloo processes (``torchtitan_ep_worker.py``): MoE
    parallelized by torchtitan (Shard(0) DTensor experts, AllToAllTokenDispatcher), its
    experts on the fused block, enabled before and after ``parallelize``, and the whole
    layer converted by ``enable_moe`` (groupmm's EP block over the EP mesh's group);
    against a single-process float64 reference and torchtitan's own forward."""
    pytest.importorskip(
        "torchtitan.distributed.parallel_dims", reason="torchtitan does not import here"
    )
    _torchtitan_moe()
    for rank, result in enumerate(_run_worker("torchtitan", 2, tmp_path)):
        # the fused forward ran: bf16 model (router), f64 model (router, skewed)
        assert result.pop("fused_calls") == ["torch.bfloat16", "torch.float64", "torch.float64"]
        # enable_moe's layer: groupmm's EP block over the 2-rank EP group, 2 local experts
        assert result.pop("ep_calls") == [["torch.float64", 2, 2]] * 2
        for name, value in result.items():
            if name.endswith("/contiguous"):
                assert value is True, (rank, name)
            elif name.endswith("/zero"):  # rank 1 under skewed routing: no rows at all
                assert rank == 1 and value == 0, (rank, name, value)
            elif "/f64/" in name or "/moe/" in name:
                assert value < 1e-6, (rank, name, value)  # float32 in/out, float64 compute
            else:  # bf16: torchtitan's own forward, groupmm's, and the two against each other
                assert value < 2e-2, (rank, name, value)
        assert any(k.startswith("skewed/f64/") for k in result)
        assert any(k.startswith("skewed/moe/") for k in result)


# --------------------------------------------------------------------------- CUDA (bf16)


def _cuda_problem(rows=1000, dim=512, hidden=256, experts=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor([180, 0, 130, 250, 60, 0, 200, 160])[:experts]
    assert int(counts.sum()) < rows  # padding rows past the counted ones
    x = torch.randn(rows, dim, generator=gen, dtype=F64)
    go = torch.randn(rows, dim, generator=gen, dtype=F64)
    return x, go, counts


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("params", [torch.bfloat16, torch.float32])
def test_cuda_fused_bf16_without_host_sync(params):
    """The bf16 CUDA path (the fused Hopper kernels where they run): bf16 compute of bf16
    or fp32 parameters against the float64 reference; padding rows zero; no host sync."""
    x, go, counts = _cuda_problem()
    ref = StandInGroupedExperts(512, 256, 8)
    module = StandInGroupedExperts(512, 256, 8, dtype=params)
    module.load_state_dict({k: v.to(params) for k, v in ref.state_dict().items()})
    tt.enable(module.cuda(), fused=True)  # groupmm_dtype: bfloat16
    xc = x.to(device="cuda", dtype=params).requires_grad_(True)
    cc, goc = counts.cuda(), go.to(device="cuda", dtype=params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = module(xc, cc)
        out.backward(goc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want, want_dx, want_grads = _grads(ref, x.requires_grad_(True), counts, go)
    n = int(counts.sum())

    def rel(a, b):
        return ((a.double().cpu() - b).norm() / b.norm()).item()

    assert out.dtype == params
    assert rel(out[:n], want[:n]) < 2e-2 and rel(xc.grad[:n], want_dx[:n]) < 2e-2
    assert (out[n:] == 0).all() and (xc.grad[n:] == 0).all()
    for name, p in module.named_parameters():
        assert p.grad.dtype == params and p.grad.is_contiguous(), name
        assert rel(p.grad, want_grads[name]) < 2e-2, name


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_memory_held_for_the_backward_excludes_the_weight_copy():
    """Device memory held from forward to backward: the output, the pre-activation and
    the small int tensors, not the ``[w1 | w3]`` copy (which a plain call keeps)."""
    x, go, counts = _cuda_problem()
    module = StandInGroupedExperts(512, 256, 8, dtype=torch.bfloat16).cuda()
    tt.enable(module, fused=True)
    xc = x.to(device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    cc = counts.cuda()
    gate_up_bytes = 8 * 512 * 512 * 2

    def held(fn):
        gc.collect()  # tensors of earlier tests freed now, not during fn
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.memory_allocated() - before

    out, fused_held = held(lambda: module(xc, cc))
    out.backward(go.to(device="cuda", dtype=torch.bfloat16))
    del out
    pre_bytes = 1000 * 512 * 2
    assert fused_held < xc.nbytes + pre_bytes + 2**20, fused_held  # output + pre + slack

    def plain():
        w_in = torch.cat([module.w1_EFD, module.w3_EFD], 1).transpose(1, 2)
        return tt.expert_compute(xc, w_in, module.w2_EDF.transpose(1, 2), counts=cc)

    out, plain_held = held(plain)
    assert plain_held >= fused_held + gate_up_bytes, (plain_held, fused_held)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_real_grouped_experts_against_torchtitans_own_forward():
    moe = _torchtitan_moe()
    experts, ref = _real_experts(moe, dim=512, hidden=256, experts=8)
    own = moe.GroupedExperts.Config(dim=512, hidden_dim=256, num_experts=8).build()
    own.load_state_dict(experts.state_dict())
    experts.cuda()
    own.cuda()
    x, go, counts = _cuda_problem()
    n = int(counts.sum())
    results = []
    for module in (experts, own):
        xc = x.float().cuda().requires_grad_(True)
        out = module(xc, counts.cuda())
        out.backward(go.float().cuda())
        results.append((out[:n].double().cpu(), xc.grad[:n].double().cpu()))
    want, want_dx, _ = _grads(ref, x.requires_grad_(True), counts, go)
    for (out, dx), name in zip(results, ("groupmm", "torchtitan")):
        assert (out - want[:n]).norm() / want[:n].norm() < 2e-2, name
        assert (dx - want_dx[:n]).norm() / want_dx[:n].norm() < 2e-2, name
    for name, p in experts.named_parameters():
        theirs = dict(own.named_parameters())[name].grad
        assert (p.grad - theirs).norm() / theirs.norm() < 3e-2, name
