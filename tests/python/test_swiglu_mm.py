"""The SwiGLU up projection kernels on Hopper (``_native.product("swiglu")``): the cooperative
128 x 256 kernel (the default) against a float64 reference at the residues of its tile
(F not a multiple of 64 or 128, K not a multiple of the 64-wide k-block, empty experts,
rows past ``offs[-1]``, both weight majors, rows read through ``src`` or packed), and
bitwise against the ping-pong 128 x 128 kernel (``GROUPMM_SM90_SWIGLU=pp128`` in a fresh
process of a development build, where that override and kernel exist)."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, outputs_in_fresh_process

pytestmark = pytest.mark.cuda


def _hopper() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _case(T, K, F, E, k, k_major, gathered, seed):
    """x [T, K], w [E, K, 2F] (or a transposed view of [E, 2F, K]), offs with an empty
    expert and 5 rows past its end, and src (or the packed rows it would gather)."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    x = torch.randn(T, K, generator=g).to("cuda", dt)
    if k_major:
        w = (torch.randn(E, 2 * F, K, generator=g) / K**0.5).to("cuda", dt).transpose(1, 2)
    else:
        w = (torch.randn(E, K, 2 * F, generator=g) / K**0.5).to("cuda", dt)
    R = T * k
    counts = torch.randint(0, 2 * R // E + 1, (E,), generator=g)
    counts[E // 2] = 0
    offs = counts.cumsum(0).clamp(max=R - 5).to("cuda", torch.int32)
    src = torch.randint(0, T, (R,), generator=g).to("cuda", torch.int32)
    if gathered:
        return x, w, offs, src
    return x[src.long()], w, offs, None


def _reference(x, w, offs, src):
    """(pre, act) in float64, zeros past offs[-1]."""
    xs = (x if src is None else x[src.long()]).double()
    w = w.double()
    pre = torch.zeros(xs.shape[0], w.shape[-1], dtype=torch.float64, device=x.device)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        pre[lo:hi] = xs[lo:hi] @ w[e]
        lo = hi
    F = w.shape[-1] // 2
    return pre, torch.nn.functional.silu(pre[:, :F]) * pre[:, F:]


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("k_major", [False, True])
@pytest.mark.parametrize("K, F", [(72, 8), (264, 200), (128, 776)])
def test_swiglu_mm_residues_equal_reference(gathered, k_major, K, F):
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    from groupmm import _native

    x, w, offs, src = _case(300, K, F, 6, 3, k_major, gathered, seed=K + F)
    got = _native.product("swiglu", x, w, offs, (), src)
    assert got is not None, "the fused kernel runs on Hopper in bf16 at these sizes"
    pre, act = got
    want_pre, want_act = _reference(x, w, offs, src)
    n = int(offs[-1])
    assert _rel(pre[:n], want_pre[:n]) < 1e-2
    assert _rel(act[:n], want_act[:n]) < 1e-2
    assert not pre[n:].any() and not act[n:].any()  # rows past offs[-1]: exact zeros


def _outputs():
    from groupmm import _native

    out = []
    for i, (K, F, k_major, gathered) in enumerate(
        [(264, 200, False, True), (128, 776, True, True), (72, 8, False, False)]
    ):
        x, w, offs, src = _case(257, K, F, 5, 2, k_major, gathered, seed=i)
        out.extend(t.cpu() for t in _native.product("swiglu", x, w, offs, (), src))
    return out


def test_swiglu_configurations_are_bitwise_equal(tmp_path):
    """The ping-pong 128 x 128 kernel (a fresh process with GROUPMM_SM90_SWIGLU=pp128)
    computes the same bits as the cooperative 128 x 256 one: the same fp32 sums in the same
    k order, the same epilogue arithmetic."""
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    env = {"GROUPMM_SM90_SWIGLU": "pp128"}
    other = outputs_in_fresh_process("test_swiglu_mm", env, tmp_path / "pp128.pt")
    here = _outputs()
    assert len(here) == len(other) == 6
    for a, b in zip(here, other):
        assert torch.equal(a, b)
