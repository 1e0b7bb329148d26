"""groupmm in torchtitan's MoE (``groupmm.integrations.torchtitan``).

torchtitan 0.3.0 (PyPI) cannot import its MoE module on a CPU-only test machine without
triton, tyro and spmd_types, so it is not installed in CI. These tests run against
``StandInGroupedExperts``, a minimal stand-in with the same ``_grouped_mm(self, *, A,
B_t, offs)`` contract and the same forward as torchtitan's ``GroupedExperts`` (without
its bfloat16 casts, so that float64 checks are possible), whose default ``_grouped_mm``
is an independent per-group loop. When ``torchtitan.models.common.moe`` imports, the
real ``GroupedExperts`` and ``GptOssGroupedExperts`` are tested too (bfloat16, as they
cast).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from groupmm.integrations import torchtitan as tt

F64 = torch.float64


def loop_grouped_mm(A, B_t, offs):
    """Reference of ``torch._grouped_mm(A, B_t, offs=offs)``: per-group products, rows
    past ``offs[-1]`` zero."""
    out = A.new_zeros(A.shape[0], B_t.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = A[start:end] @ B_t[g]
        start = end
    return out


class StandInGroupedExperts(torch.nn.Module):
    """torchtitan's ``GroupedExperts`` contract: weights ``w1 [E, F, D]``, ``w2 [E, D,
    F]``, ``w3 [E, F, D]``; ``forward(x_RD, num_tokens_per_expert_E)`` with SwiGLU; every
    product through ``self._grouped_mm(A=..., B_t=w.transpose(-2, -1), offs=...)``."""

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
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=self.w2_EDF.transpose(-2, -1), offs=offs)

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


# --------------------------------------------------------------------------- real torchtitan


def _torchtitan_moe():
    return pytest.importorskip(
        "torchtitan.models.common.moe", reason="torchtitan's MoE module does not import here"
    )


def test_real_grouped_experts_bf16():
    moe = _torchtitan_moe()
    cls = tt.groupmm_experts_class(moe.GroupedExperts)
    experts = cls.Config(dim=16, hidden_dim=24, num_experts=4).build()
    assert type(experts) is cls
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    ref = StandInGroupedExperts(16, 24, 4)
    ref.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    x, counts = _routed(rows=23, dim=16)
    out = experts(x.detach().float(), counts)
    want = ref(x.detach(), counts)
    rel = (out.double() - want).norm() / want.norm()
    assert out.dtype == torch.float32 and rel < 2e-2, rel  # torchtitan computes in bf16
    out.sum().backward()
    assert experts.w1_EFD.grad.shape == experts.w1_EFD.shape


def test_real_gpt_oss_grouped_experts_bf16():
    pytest.importorskip("torchtitan.models.gpt_oss.moe", reason="torchtitan does not import here")
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

    plain = GptOssGroupedExperts.Config(dim=16, hidden_dim=8, num_experts=3).build()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = (
        tt.groupmm_experts_class(GptOssGroupedExperts)
        .Config(dim=16, hidden_dim=8, num_experts=3)
        .build()
    )
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(12, 16)
    counts = torch.tensor([4, 0, 6])  # 2 padding rows
    want = plain(x, counts)
    got = ours(x, counts)
    rel = (got.float() - want.float())[:10].norm() / want.float()[:10].norm()
    assert rel < 2e-2, rel
