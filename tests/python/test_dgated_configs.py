"""The configurations of the DGated kernel on Hopper (``_native.product("dgated")``: the backward of
a routed SwiGLU expert's down projection; its contract: ``_native.pyi``): on rows read
through ``src`` the cooperative 128 x 256 kernel and the ping-pong 128 x 128 one
(the rule's choice, and ``GROUPMM_SM90_DGATED=pp128`` in a fresh process of a development
build, where the override and that kernel exist), against
a float64 reference at the residues of their tiles (F not a multiple of 64, 128 or 256, an
expert's rows not a multiple of 64 or 128, empty and one-row experts, rows past
``offs[-1]``), dpre written apart from ``pre`` and over it, beside the packed-rows kernel;
and bitwise against each other (the same fp32 products, the same formulas, the same
summation order)."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA, outputs_in_fresh_process, ragged_routes

pytestmark = pytest.mark.cuda

# (T, k, E, D, F): F = 200 and 264 leave partial 64-column chunks and 256-column tiles, 520
# a partial tile of two and a half chunks, 8 a single partial chunk; D = 136 a partial
# k-block
SHAPES = [(211, 3, 6, 136, 200), (97, 2, 5, 520, 264), (130, 4, 9, 64, 520), (50, 1, 3, 72, 8)]


def _hopper() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)


def _case(T, k, E, D, F, seed):
    """``(dy_tokens, w_out, offs, pre, scale, src)`` over ``R = T*k`` routed rows: group
    sizes with an empty expert, a one-row one and 7 routed rows past ``offs[-1]``."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    R = T * k
    offs, src = ragged_routes(T, k, E, g)
    dy = torch.randn(T, D, generator=g).to("cuda", dt)
    w_out = (torch.randn(E, F, D, generator=g) / D**0.5).to("cuda", dt)
    pre = (2 * torch.randn(R, 2 * F, generator=g)).to("cuda", dt)
    scale = torch.rand(R, generator=g).to("cuda")
    return dy, w_out, offs, pre, scale, src


def _reference(dy_rows, w_out, offs, pre, scale):
    """``(dpre, act, row_grad)`` in float64 from the contract; rows past ``offs[-1]``
    zero."""
    R, F = pre.shape[0], w_out.shape[1]
    p = torch.zeros(R, F, dtype=torch.float64, device=pre.device)
    lo = 0
    for e, hi in enumerate(offs.tolist()):
        p[lo:hi] = dy_rows[lo:hi].double() @ w_out[e].double().t()
        lo = hi
    gate, up = pre.double().chunk(2, dim=-1)
    sig, s = torch.sigmoid(gate), scale.double()[:, None]
    dpre = torch.cat([s * p * up * sig * (1 + gate * (1 - sig)), s * p * gate * sig], 1)
    silu = gate * sig
    valid = (torch.arange(R, device=pre.device) < lo).double()[:, None]
    return dpre * valid, s * silu * up * valid, (p * silu * up).sum(1) * valid[:, 0]


def _outputs():
    """Every case's outputs (rows through src, packed rows, dpre written over ``pre``), on
    the CPU."""
    from groupmm import _native

    out = []
    for i, (T, k, E, D, F) in enumerate(SHAPES):
        dy, w_out, offs, pre, scale, src = _case(T, k, E, D, F, seed=i)
        dpre, act, partial = _native.product("dgated", dy, w_out, offs, (pre, scale), src)
        out.append([dpre.cpu(), act.cpu(), partial.sum(0).cpu()])
        packed = dy.index_select(0, src.long())
        dpre, act, partial = _native.product("dgated", packed, w_out, offs, (pre, scale))
        out.append([dpre.cpu(), act.cpu(), partial.sum(0).cpu()])
        own = pre.clone()
        dpre, act, partial = _native.product("dgated", dy, w_out, offs, (own, scale), src, own)
        assert dpre.data_ptr() == own.data_ptr()
        out.append([dpre.cpu(), act.cpu(), partial.sum(0).cpu()])
    return out


def _check(got):
    """Each case's outputs against the float64 reference (bf16 outputs: relative to the
    largest magnitude); rows past ``offs[-1]`` exact zeros."""
    assert len(got) == 3 * len(SHAPES)
    for i, (T, k, E, D, F) in enumerate(SHAPES):
        dy, w_out, offs, pre, scale, src = _case(T, k, E, D, F, seed=i)
        want = _reference(dy[src.long()], w_out, offs, pre, scale)
        end = int(offs[-1])
        for variant in range(3):
            for name, g, w in zip(("dpre", "act", "row_grad"), got[3 * i + variant], want):
                w = w.cpu()
                err = ((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
                assert err < 2e-2, (SHAPES[i], variant, name, err)
                assert not g[end:].any(), (SHAPES[i], variant, name, "rows past offs[-1]")


@pytest.mark.parametrize("config", ["co256", "pp128"])
def test_dgated_configuration_equals_reference(config, tmp_path):
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    if config == "co256":  # the rule's choice: this process computes it
        _check(_outputs())
        return
    env = {"GROUPMM_SM90_DGATED": config}
    _check(outputs_in_fresh_process("test_dgated_configs", env, tmp_path / f"{config}.pt"))


def test_dgated_configurations_are_bitwise_equal(tmp_path):
    if not _hopper():
        pytest.skip("needs an sm_90 GPU")
    pp = outputs_in_fresh_process(
        "test_dgated_configs", {"GROUPMM_SM90_DGATED": "pp128"}, tmp_path / "pp.pt"
    )
    co = _outputs()  # the rule's cooperative 128 x 256 kernel
    for a, b in zip(co, pp):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
