"""What differs across transformers 5.x releases, for :mod:`groupmm.integrations.transformers`:
the module of the experts-implementation registry (:func:`_moe_module`, or a clear
ImportError), and what an experts module holds, read from its layout flags with defaults
(:func:`_layout`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .._glue import swiglu

_INSTALL_HINT = "pip install 'transformers>=5.0,<6'"


def _moe_module():
    """``transformers.integrations.moe``, or a clear ImportError."""
    try:
        from transformers.integrations import moe
    except ImportError as err:
        raise ImportError(
            "groupmm.integrations.transformers needs Hugging Face transformers 5.x with "
            f"its experts-implementation registry ({_INSTALL_HINT}): {err}"
        ) from err
    if not hasattr(moe, "ExpertsInterface") or not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        import transformers

        raise ImportError(
            f"transformers {transformers.__version__} has no experts-implementation registry "
            f"(transformers.integrations.moe.ExpertsInterface, added in 5.0); {_INSTALL_HINT}"
        )
    return moe


# --------------------------------------------------------------------------- layout


class _Layout(NamedTuple):
    """What an experts module holds, read from its flags (with defaults)."""

    w_in: Tensor  # gate_up_proj or up_proj
    b_in: Optional[Tensor]
    w_out: Tensor  # down_proj
    b_out: Optional[Tensor]
    transposed: bool  # weights [E, in, out] (True) or [E, out, in] (False)
    gate: Callable[[Tensor], Tensor]  # [S, out_in] -> [S, I]
    post_norm: Optional[Callable[[Tensor], Tensor]]
    num_experts: int
    fused: bool  # a plain SwiGLU block: expert_block runs it (see _layout)


def _layout(module, hidden: int) -> _Layout:
    has_gate = getattr(module, "has_gate", None)
    if has_gate is None:
        has_gate = hasattr(module, "gate_up_proj")
    prefix = "gate_up_proj" if has_gate else "up_proj"
    w_in, w_out = getattr(module, prefix), module.down_proj
    has_bias = getattr(module, "has_bias", None)
    if has_bias is None:
        has_bias = getattr(module, prefix + "_bias", None) is not None
    b_in = getattr(module, prefix + "_bias") if has_bias else None
    b_out = module.down_proj_bias if has_bias else None
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:
        transposed = _infer_transposed(w_in, w_out, hidden)
    concatenated = getattr(module, "is_concatenated", True)
    own_gate = getattr(module, "_apply_gate", None)
    if has_gate:
        gate = own_gate
        if gate is None:
            gate = _split_gate(module.act_fn, concatenated)
    else:
        gate = module.act_fn
    post_norm = module.post_expert_norm if getattr(module, "has_post_expert_norm", False) else None
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int):
        num_experts = w_in.shape[0]
    fused = (
        has_gate
        and not has_bias
        and post_norm is None
        and concatenated
        and _default_gate(own_gate)
        and _is_silu(getattr(module, "act_fn", None))
    )
    return _Layout(
        w_in, b_in, w_out, b_out, bool(transposed), gate, post_norm, num_experts, bool(fused)
    )


def _default_gate(gate: Any) -> bool:
    """No gate of the module's own: none (releases before ``_apply_gate``), or
    transformers' default ``act_fn(gate) * up`` on the concatenated halves (gpt-oss's
    clamped, interleaved gate and the other models' own gates are not)."""
    if gate is None:
        return True
    default = getattr(_moe_module(), "_default_apply_gate", None)
    return default is not None and getattr(gate, "__func__", gate) is default


def _is_silu(act: Any) -> bool:
    """``act`` is SiLU: ``F.silu``, ``nn.SiLU`` (``"swish"``) or transformers'
    ``SiLUActivation`` (``"silu"``, also when a hub kernel replaced its forward)."""
    if act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(act, SiLUActivation)


def _infer_transposed(w_in: Tensor, w_out: Tensor, hidden: int) -> bool:
    """Releases without ``is_transposed``: input weights ``[E, H, out]`` and output
    weights ``[E, I, H]`` are transposed, ``[E, out, H]`` and ``[E, H, I]`` are not; the
    first of the two whose shape tells decides; else the registry's default (False)."""
    if (w_in.shape[1] == hidden) != (w_in.shape[2] == hidden):
        return w_in.shape[1] == hidden
    if (w_out.shape[1] == hidden) != (w_out.shape[2] == hidden):
        return w_out.shape[2] == hidden
    return False


def _split_gate(act_fn, concatenated: bool) -> Callable[[Tensor], Tensor]:
    """``act_fn(gate) * up`` with the gate and up columns laid out as the module says."""
    return functools.partial(swiglu, act=act_fn, interleaved=not concatenated)
