"""groupmm.sm_limit: the process-wide cap on the SMs groupmm's CUDA launches occupy.

The context manager's bookkeeping runs wherever the build has CUDA; the results under a
cap (a persistent grid smaller than the SM count, down to one CTA) are checked on the GPU
against the same calls without one, bitwise (a smaller grid changes which CTA computes a
tile, not how it is computed).
"""

import groupmm
import pytest
import torch
from conftest import HAS_CUDA

CUDA_BUILD = bool(groupmm.build_info()["cuda"])


@pytest.mark.skipif(not CUDA_BUILD, reason="a build without CUDA has no SM limit")
def test_sm_limit_sets_and_restores():
    assert groupmm._native.sm_limit() == 0
    with groupmm.sm_limit(7):
        assert groupmm._native.sm_limit() == 7
        with groupmm.sm_limit(0):
            assert groupmm._native.sm_limit() == 0
        assert groupmm._native.sm_limit() == 7
    assert groupmm._native.sm_limit() == 0
    with pytest.raises(RuntimeError), groupmm.sm_limit(3):
        raise RuntimeError("inside")
    assert groupmm._native.sm_limit() == 0


@pytest.mark.skipif(not CUDA_BUILD, reason="a build without CUDA has no SM limit")
def test_sm_limit_bad_values_name_the_argument():
    with pytest.raises(ValueError, match="sms"), groupmm.sm_limit(-1):
        pass
    with pytest.raises(TypeError, match="sms"), groupmm.sm_limit(True):
        pass
    with pytest.raises(TypeError, match="sms"), groupmm.sm_limit(2.0):
        pass
    assert groupmm._native.sm_limit() == 0


@pytest.mark.skipif(CUDA_BUILD, reason="checks the build without CUDA")
def test_sm_limit_without_cuda_raises():
    with pytest.raises(RuntimeError), groupmm.sm_limit(4):
        pass


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm")
@pytest.mark.parametrize("sms", [1, 5, 64])
def test_sm_limit_results_equal_unlimited_bf16(sms):
    """Packed forward and backward (varlen kernels), the fused expert block (the SwiGLU
    and dgated kernels, the row kernels) and a list product under a cap: bitwise equal
    to the same calls without one."""
    from groupmm._glue import routes
    from groupmm.fused import expert_block

    gen = torch.Generator(device="cuda").manual_seed(sms)
    bf16 = torch.bfloat16
    counts = torch.tensor([300, 0, 517, 64, 129, 1], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=bf16, generator=gen)
    w = torch.randn(6, 256, 384, device="cuda", dtype=bf16, generator=gen)
    go = torch.randn(x.shape[0], 384, device="cuda", dtype=bf16, generator=gen)
    T, E, k, F = 400, 8, 2, 128
    tokens = torch.randn(T, 256, device="cuda", dtype=bf16, generator=gen)
    ids = torch.rand(T, E, device="cuda", generator=gen).argsort(1)[:, :k]
    weights = torch.rand(T, k, device="cuda", generator=gen).to(bf16)
    w_in = torch.randn(E, 256, 2 * F, device="cuda", dtype=bf16, generator=gen) * 0.06
    w_out = torch.randn(E, F, 256, device="cuda", dtype=bf16, generator=gen) * 0.09
    lists = [torch.randn(m, 64, device="cuda", dtype=bf16, generator=gen) for m in (5, 70)]
    rhs = [torch.randn(64, n, device="cuda", dtype=bf16, generator=gen) for n in (33, 8)]

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, tokens, w_in, w_out)]
        a, b, t, wi, wo = leaves
        y = groupmm.grouped_mm(a, b, offs=offs)
        y.backward(go)
        r = routes(ids, E)
        out = expert_block(t, wi, wo, r.offs, r.src, r.inverse, weights)
        out.backward(torch.ones_like(out))
        listed = groupmm.grouped_mm(lists, rhs)
        return [y.detach(), out.detach(), *listed] + [p.grad for p in leaves]

    want = run()
    with groupmm.sm_limit(sms):
        got = run()
    torch.cuda.synchronize()
    for i, (g, ref) in enumerate(zip(got, want)):
        assert torch.equal(g, ref), i
