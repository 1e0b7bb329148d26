"""SonicMoE as the benches call it: its import (:func:`load_sonic`), its stack's versions
(:func:`peer_versions`), groupmm's weights in its layout and back (:func:`sonic_weights`,
:func:`sonic_args`, :func:`to_groupmm_layout`), one forward (:func:`sonic_forward`) and
that layer in plain torch (:func:`sonic_layout_reference`, for the tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from harness.report import dist_version, error_text

if TYPE_CHECKING:
    from groupmm.moe import MoELayer


def peer_versions() -> dict:
    """SonicMoE's stack as installed here (None for what is missing)."""
    return {
        "sonic-moe": dist_version(("sonic-moe", "sonicmoe"), "sonicmoe"),
        "quack-kernels": dist_version(("quack-kernels",), "quack"),
        "nvidia-cutlass-dsl": dist_version(("nvidia-cutlass-dsl",), "cutlass"),
    }


def load_sonic():
    """``({"layer": moe_TC_softmax_topk_layer, "ActivationType": ...}, None)`` or
    ``(None, why)`` (the import error, first line)."""
    try:
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_TC_softmax_topk_layer
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return None, error_text(e)
    return {"layer": moe_TC_softmax_topk_layer, "ActivationType": ActivationType}, None


def sonic_weights(layer: MoELayer) -> tuple:
    """Copies of ``layer``'s weights in SonicMoE's layout, new contiguous leaves: ``router_w``
    ``[E, d]``, ``w1`` ``(E, 2F, d)`` (rows ``[gate; up]``), ``w2`` ``(E, d, F)``."""
    with torch.no_grad():
        router_w = layer.router.gate.weight.detach().clone()
        w1 = layer.experts.w_in.detach().transpose(1, 2).contiguous()
        w2 = layer.experts.w_out.detach().transpose(1, 2).contiguous()
    return tuple(t.requires_grad_() for t in (router_w, w1, w2))


def sonic_args(w1, w2) -> tuple:
    """The expert weights as SonicMoE's layer takes them: ``(2F, d, E)`` and ``(d, F, E)``."""
    return w1.permute(1, 2, 0), w2.permute(1, 2, 0)


def to_groupmm_layout(w1, w2) -> tuple:
    """SonicMoE's ``w1`` ``(E, 2F, d)`` and ``w2`` ``(E, d, F)`` (or their gradients) as
    groupmm's ``w_in`` ``[E, d, 2F]`` and ``w_out`` ``[E, F, d]`` (views)."""
    return w1.transpose(1, 2), w2.transpose(1, 2)


def sonic_forward(S: dict, x, router_w, w1, w2, k: int):
    """One SonicMoE layer forward, called as PEERS.md shows (Qwen3 routing)."""
    w1p, w2p = sonic_args(w1, w2)
    o, _logits, _freq = S["layer"](
        x,
        router_w,
        w1p,
        None,
        w2p,
        None,
        k,
        torch.cuda.current_stream().cuda_stream,
        S["ActivationType"].SWIGLU,
        False,
        is_softmax_over_topk=False,
        norm_topk_probs=True,
        concat_layout=True,
    )
    return o


def sonic_layout_reference(x, router_w, w1p, w2p, k: int):
    """The layer the tensors handed to SonicMoE define, in plain torch ops (a loop over
    experts; ``w1p`` ``(2F, d, E)``, ``w2p`` ``(d, F, E)``)."""
    logits = F.linear(x, router_w)
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
    top, ids = probs.topk(k, dim=-1)
    top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in range(router_w.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gate, up = (x[tok] @ w1p[:, :, e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2p[:, :, e].T
        out = out.index_add(0, tok, y * top[tok, slot].unsqueeze(-1))
    return out
