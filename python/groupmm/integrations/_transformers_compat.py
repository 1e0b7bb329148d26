"""What differs across transformers 5.x releases, for :mod:`groupmm.integrations.transformers`:
the module of the experts-implementation registry (:func:`_moe_module`, or a clear
ImportError), and what an experts module holds, read from its layout flags with defaults
(:func:`_layout`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, cast

import torch
from torch import Tensor

from .. import _checks as check
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
    fused: bool  # a plain SwiGLU block: the fused block's ops run it (see _derive)
    w_in_name: str = "gate_up_proj"  # the module's names of w_in and w_out (for messages)
    w_out_name: str = "down_proj"


class _Derived(NamedTuple):
    """What :func:`_layout` derives from a module's flags, shapes and callables (kept on
    the module with the key it was derived from)."""

    key: tuple
    transposed: bool
    gate: Optional[Callable[[Tensor], Tensor]]  # None: the module's own _apply_gate
    num_experts: int
    fused: bool


#: the key of the module's ``__dict__`` under which :func:`_layout` keeps its ``_Derived``
_CACHE = "_groupmm_layout"


def _member(module, name: str, required: bool = False) -> Any:
    """``getattr(module, name)`` (``None`` when absent, unless ``required``), a parameter
    or submodule read from its registry first: ``nn.Module.__getattr__``, where getattr
    finds them, is a Python frame (about 1 us a read, several reads a call)."""
    d = module.__dict__
    for registry in ("_parameters", "_modules"):
        values = d.get(registry)
        if values is not None and name in values:
            return values[name]
    return getattr(module, name) if required else getattr(module, name, None)


def _layout(module, hidden: int) -> _Layout:
    """The module's layout, read on every call (its tensors, flags and callables may be
    replaced between calls: transformers' expert parallelism swaps the parameters for
    local tensors around each forward). What is derived from them (the transposition
    when the flag is absent, the gate, the expert count, the fused path and its shape
    checks: most of the cost) is kept on the module with the key of everything it was
    derived from (``hidden``, the flags, the weights' shapes, the activation and gate; no
    tensor) and derived again when the key changes. Traced calls (``torch.compile``)
    read and derive everything each time and keep nothing."""
    compiling = torch.compiler.is_compiling()
    member = _traced_member if compiling else _member
    has_gate = getattr(module, "has_gate", None)
    if has_gate is None:
        has_gate = hasattr(module, "gate_up_proj")
    prefix = "gate_up_proj" if has_gate else "up_proj"
    w_in, w_out = member(module, prefix, True), member(module, "down_proj", True)
    has_bias = getattr(module, "has_bias", None)
    if has_bias is None:
        has_bias = member(module, prefix + "_bias") is not None
    b_in = member(module, prefix + "_bias", True) if has_bias else None
    b_out = member(module, "down_proj_bias", True) if has_bias else None
    has_post_norm = getattr(module, "has_post_expert_norm", False)
    post_norm = member(module, "post_expert_norm", True) if has_post_norm else None
    own_gate = getattr(module, "_apply_gate", None)
    act = member(module, "act_fn")
    key = (
        hidden,
        bool(has_gate),
        bool(has_bias),
        w_in.shape,
        w_out.shape,
        getattr(module, "is_transposed", None),
        getattr(module, "is_concatenated", True),
        post_norm,
        getattr(module, "num_experts", None),
        act,
        # the gate's function only (bound to the module itself: the key keeps no
        # reference to the module, no cycle through its __dict__); the gate itself is
        # read on each call
        getattr(own_gate, "__func__", own_gate),
    )
    derived = None if compiling else module.__dict__.get(_CACHE)
    if derived is None or derived.key != key:
        derived = _derive(key, prefix, w_in, w_out, own_gate, module)
        if not compiling:
            module.__dict__[_CACHE] = derived
    gate = derived.gate if derived.gate is not None else own_gate  # own_gate: never None
    return _Layout(
        w_in,
        b_in,
        w_out,
        b_out,
        derived.transposed,
        cast(Callable[[Tensor], Tensor], gate),
        post_norm,
        derived.num_experts,
        derived.fused,
        prefix,
    )


def _traced_member(module, name: str, required: bool = False) -> Any:
    """:func:`_member` by getattr alone (what the compiler traces)."""
    return getattr(module, name) if required else getattr(module, name, None)


def _derive(key: tuple, prefix: str, w_in: Tensor, w_out: Tensor, own_gate, module) -> _Derived:
    """:func:`_layout`'s derived part, for ``key``; the fused path's shapes checked."""
    hidden, has_gate, has_bias, _, _, transposed, concatenated, post_norm, num_experts = key[:9]
    act = key[9]
    if transposed is None:
        transposed = _infer_transposed(w_in, w_out, hidden)
    if not has_gate:
        gate = module.act_fn
    elif own_gate is None:
        gate = _split_gate(module.act_fn, concatenated)
    else:
        gate = None  # the module's own, read on each call
    if not isinstance(num_experts, int):
        num_experts = w_in.shape[0]
    fused = bool(
        has_gate
        and not has_bias
        and post_norm is None
        and concatenated
        and _default_gate(own_gate)
        and _is_silu(act)
    )
    if fused:
        _check_fused(prefix, w_in, w_out, bool(transposed), hidden, num_experts)
    return _Derived(key, bool(transposed), gate, num_experts, fused)


def _check_fused(
    prefix: str, w_in: Tensor, w_out: Tensor, transposed: bool, hidden: int, num_experts: int
) -> None:
    """The fused block's weights agree with ``hidden`` and the expert count (what
    :func:`groupmm.fused.expert_block` checks on every call: the integration calls the
    block's ops itself, with these checks once per layout), named as the module names
    them."""
    for name, w in ((prefix, w_in), ("down_proj", w_out)):
        check.shape(name, w, w.dim() == 3, "[E, out, in] (expert weights)")
    inner = w_in.shape[2] if transposed else w_in.shape[1]  # 2I
    outer = w_in.shape[1] if transposed else w_in.shape[2]  # H
    ok = w_in.shape[0] == num_experts and outer == hidden and inner % 2 == 0
    what = "[E={}, H={}, 2I]" if transposed else "[E={}, 2I, H={}]"
    why = " (E = num_experts, H = hidden_states.shape[1], 2I even)"
    check.shape(prefix, w_in, ok, what + why, num_experts, hidden)
    inter = inner // 2
    want = (num_experts, inter, hidden) if transposed else (num_experts, hidden, inter)
    what = "[E={}, I={}, H={}]" if transposed else "[E={}, H={}, I={}]"
    why = f" (I = half the gate and up width of {prefix})"
    check.shape("down_proj", w_out, w_out.shape == want, what + why, *want)


def _registry_default_gate() -> Any:
    """transformers' default ``_apply_gate`` function, or None (releases without one, or
    no transformers): read once, at import, not inside a traced call (an import there is
    a graph break: transformers' lazy modules)."""
    try:
        return getattr(_moe_module(), "_default_apply_gate", None)
    except ImportError:
        return None


_DEFAULT_APPLY_GATE = _registry_default_gate()


def _default_gate(gate: Any) -> bool:
    """No gate of the module's own: none (releases before ``_apply_gate``), or
    transformers' default ``act_fn(gate) * up`` on the concatenated halves (gpt-oss's
    clamped, interleaved gate and the other models' own gates are not)."""
    if gate is None:
        return True
    default = _DEFAULT_APPLY_GATE
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
