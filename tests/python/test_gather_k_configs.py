"""The configurations of the gathered weight-gradient kernel on Hopper
(``_native.gather_k_mm``; its contract: test_gather_k.py): the cooperative 128 x 256
kernel (the default) against a float64 reference at the residues of its tile (output
widths not a multiple of 64, 192 or 256, an expert's tokens not a multiple of the
64-token k-block, empty experts, one-token experts, tokens past ``offs[-1]``), with the
gathered operand either side (``x[src]ᵀ·dH`` and ``actᵀ·dY[src]``), and bitwise against
the cooperative 128 x 192 and ping-pong 128 x 128 kernels
(``GROUPMM_SM90_GATHER_K=co192|pp128`` in a fresh process of a development build, where
those overrides and kernels exist)."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, outputs_in_fresh_process, ragged_routes

pytestmark = pytest.mark.cuda


def _hopper() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _case(T, M, N, E, k, gathered_b, seed):
    """``(a, b, offs, src)`` of a gathered product over ``R = T*k`` routed rows: gathered
    A: ``a`` is x ``[T, M]`` (read through src), ``b`` is dH ``[R, N]``; gathered B: ``a``
    is act ``[R, M]``, ``b`` is dY ``[T, N]``. Group sizes with an empty expert, a
    one-token one and 7 routed rows past ``offs[-1]``."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    R = T * k
    offs, src = ragged_routes(T, k, E, g)
    if gathered_b:
        a = torch.randn(R, M, generator=g).to("cuda", dt)
        b = torch.randn(T, N, generator=g).to("cuda", dt)
    else:
        a = torch.randn(T, M, generator=g).to("cuda", dt)
        b = torch.randn(R, N, generator=g).to("cuda", dt)
    return a, b, offs, src


def _reference(a, b, offs, src, gathered_b):
    """``[E, M, N]`` in float64: per expert, the transposed routed rows of ``a`` times
    those of ``b``, the gathered one read through ``src``."""
    s = src.long()
    a = (a if gathered_b else a[s]).double()
    b = (b[s] if gathered_b else b).double()
    out = torch.zeros(offs.numel(), a.shape[1], b.shape[1], dtype=torch.float64, device=a.device)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        out[e] = a[lo:hi].t() @ b[lo:hi]
        lo = hi
    return out


@pytest.mark.parametrize("gathered_b", [False, True])
@pytest.mark.parametrize("M, N", [(136, 200), (264, 520), (64, 8), (776, 264)])
def test_gather_k_residues_equal_reference(gathered_b, M, N):
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    from groupmm import _native

    a, b, offs, src = _case(211, M, N, 6, 3, gathered_b, seed=M + N)
    got = _native.gather_k_mm(a, b, offs, src, gathered_b, False)
    want = _reference(a, b, offs, src, gathered_b)
    assert got.shape == want.shape
    scale = want.abs().max().clamp_min(1e-12)
    assert ((got.double() - want).abs().max() / scale).item() < 1e-2
    assert not got[offs.numel() // 2].any()  # the empty expert: exact zeros


def _outputs():
    from groupmm import _native

    out = []
    for i, (M, N, gathered_b) in enumerate([(264, 520, False), (136, 200, True), (64, 8, False)]):
        a, b, offs, src = _case(257, M, N, 5, 2, gathered_b, seed=i)
        out.append(_native.gather_k_mm(a, b, offs, src, gathered_b, False).cpu())
    return out


@pytest.mark.parametrize("config", ["co192", "pp128"])
def test_gather_k_configurations_are_bitwise_equal(config, tmp_path):
    """The other gathered varlen-K kernels (a fresh process with GROUPMM_SM90_GATHER_K
    set) compute the same bits as the cooperative 128 x 256 one: the same fp32 sums in
    the same token order."""
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    env = {"GROUPMM_SM90_GATHER_K": config}
    other = outputs_in_fresh_process("test_gather_k_configs", env, tmp_path / f"{config}.pt")
    here = _outputs()
    assert len(here) == len(other) == 3
    for x, y in zip(here, other):
        assert torch.equal(x, y)
