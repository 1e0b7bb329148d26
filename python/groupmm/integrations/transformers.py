"""groupmm as a Hugging Face transformers experts implementation.

transformers 5.x computes the experts of every MoE model (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-V3, gpt-oss, ...) through a registry of functions,
``transformers.integrations.moe.ExpertsInterface``. This module adds one, ``"groupmm"``::

    import groupmm.integrations.transformers as gt

    gt.register()                                       # idempotent
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="groupmm")
    gt.enable(model)                                    # or switch a loaded model

``enable(model)`` registers and calls ``model.set_experts_implementation("groupmm")``.
Early 5.x releases (5.0 to 5.5 at least) check the name against a fixed list and refuse
it, although their experts modules look the name up in the registry; there ``enable``
sets the model configs' ``_experts_implementation`` instead, which is what
``set_experts_implementation`` does once the check passes (``from_pretrained(...,
experts_implementation="groupmm")`` raises on those releases: load, then ``enable``).

What the registered function reads from an experts module, how one call runs (route, dispatch,
projections, gate, combine) and why: ``docs/integrations.md``. Speed against transformers'
own paths: ``docs/performance.md``.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
from torch import Tensor

from .. import _checks as check
from .. import grouped_mm
from .._glue import Combine, Routes, dispatch, routes
from ..fused import _block
from . import _expert_mm
from ._transformers_compat import _Layout, _layout, _moe_module

__all__ = ["NAME", "enable", "groupmm_experts_forward", "is_registered", "register"]

#: The name under which :func:`register` adds groupmm to transformers' registry.
NAME = "groupmm"


# --------------------------------------------------------------------------- registry


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, found {type(name).__name__}")
    if not name or name == "eager":
        raise ValueError(f"name: expected a non-empty name other than 'eager', found {name!r}")
    return name


def is_registered(name: str = NAME) -> bool:
    """True when transformers' experts registry maps ``name`` to groupmm's function."""
    registry = _moe_module().ALL_EXPERTS_FUNCTIONS
    return name in registry and registry[name] is groupmm_experts_forward


def register(name: str = NAME) -> None:
    """Add groupmm to transformers' experts-implementation registry under ``name``.

    Idempotent. Raises ``ValueError`` if ``name`` already belongs to another
    implementation (e.g. ``"grouped_mm"``), ``ImportError`` without transformers 5.x.
    """
    name = _check_name(name)
    moe = _moe_module()
    registry = moe.ALL_EXPERTS_FUNCTIONS
    if name in registry:
        if registry[name] is groupmm_experts_forward:
            return
        raise ValueError(
            f"name: {name!r} is already a transformers experts implementation "
            f"({getattr(registry[name], '__qualname__', registry[name])}); choose another name"
        )
    moe.ExpertsInterface.register(name, groupmm_experts_forward)


def enable(model: Any, name: str = NAME) -> Any:
    """Register groupmm and switch every experts module of a loaded ``model`` to it.

    Returns ``model``. Raises ``TypeError`` if ``model`` is not a transformers model and
    ``ValueError`` if none of its modules dispatches through the experts registry (a
    model without MoE layers, or one whose experts predate the registry).
    """
    name = _check_name(name)
    register(name)
    set_impl = getattr(model, "set_experts_implementation", None)
    if not callable(set_impl) or not hasattr(model, "config"):
        raise TypeError(
            "model: expected a transformers PreTrainedModel (with set_experts_implementation, "
            f"transformers >= 5.0), found {type(model).__name__}"
        )
    if not any(_is_experts(m) for m in model.modules()):
        raise ValueError(
            f"model: {type(model).__name__} has no experts module that dispatches through "
            "transformers' experts registry (no MoE layers, or experts without "
            "@use_experts_implementation); nothing was switched to groupmm"
        )
    try:
        set_impl(name)
    except ValueError as err:
        # Releases that check the name against a fixed list (5.0 to 5.5 at least). Their
        # experts modules look the configured name up in the registry, so setting the
        # configs is their supported path (the config setter recurses into sub-configs).
        if "not supported" not in str(err):
            raise
        for config in _configs(model):
            config._experts_implementation = name
    if not any(
        _is_experts(m) and m.config._experts_implementation == name for m in model.modules()
    ):
        raise RuntimeError(
            f"model: set_experts_implementation({name!r}) left every experts module of "
            f"{type(model).__name__} on another implementation"
        )
    return model


def _configs(model) -> list:
    """The distinct configs of ``model`` and of the transformers models inside it."""
    seen, out = set(), []
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(m, "set_experts_implementation"):
            if id(config) not in seen:
                seen.add(id(config))
                out.append(config)
    return out


def _is_experts(module) -> bool:
    """An experts module that transformers dispatches through the registry."""
    config = getattr(module, "config", None)
    return isinstance(getattr(module, "down_proj", None), torch.nn.Parameter) and hasattr(
        config, "_experts_implementation"
    )


# --------------------------------------------------------------------------- routing


def _route(top_k_index: Tensor, top_k_weights: Tensor, num_experts: int) -> tuple[Routes, Tensor]:
    """The expert order of the ``S = T*k`` routed copies, placeholders last (step 1), with
    int32 indices (what the kernels read), and the routing weights as ``[T, k]``, zero for
    placeholders."""
    # routing runs torch ops, no native call: these are its only checks
    check.index("top_k_index", top_k_index, 2, "[T, k]")
    num_tokens, top_k = top_k_index.shape
    route = routes(top_k_index, num_experts, placeholders=True, index_dtype=torch.int32)
    if top_k_weights.shape == (num_tokens, top_k):
        weights = top_k_weights
    elif top_k_weights.shape == (num_tokens, num_experts):  # full distribution (early 5.x)
        weights = top_k_weights.gather(1, top_k_index.clamp(0, num_experts - 1))
    else:
        raise ValueError(
            f"top_k_weights: expected shape [T, k] = {[num_tokens, top_k]} (or [T, E] = "
            f"{[num_tokens, num_experts]}), found {list(top_k_weights.shape)}"
        )
    valid = cast(Tensor, route.valid)  # placeholders=True: never None
    # a select on the mask as it is (masked_fill would need it negated: one op more)
    return route, torch.where(valid.view(num_tokens, top_k), weights, 0)


# --------------------------------------------------------------------------- autograd pieces


class _GroupBias(torch.autograd.Function):
    """``h + bias[expert]`` per sorted row; the bias gradient is a per-group column sum,
    computed as one grouped product ``ones[1, S] · grad`` (rows past ``offs[-1]``, the
    placeholders, are left out)."""

    @staticmethod
    def forward(ctx, h: Tensor, bias: Tensor, expert: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(offs)
        return h + bias.index_select(0, expert)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (offs,) = ctx.saved_tensors
        db = None
        if ctx.needs_input_grad[1]:
            ones = grad.new_ones(1, grad.shape[0])
            db = grouped_mm(ones, grad, offs=offs).squeeze(1)
        return grad, db, None, None


# --------------------------------------------------------------------------- forward


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _compute_dtype(x: Tensor, w: Tensor) -> torch.dtype:
    """The one dtype of a projection's operands: the autocast dtype inside autocast,
    else the weight's, as transformers' own grouped path does."""
    dtype = _autocast_dtype(x.device.type)
    if dtype is None or torch.float64 in (x.dtype, w.dtype):
        dtype = w.dtype
    return dtype


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, without the call when it would return ``t`` itself (each torch
    call costs host time; these run several times a block)."""
    return t if t.dtype == dtype else t.to(dtype)


def _weight(w: Tensor, dtype: torch.dtype, transposed: bool) -> Tensor:
    """``w`` as ``[E, in, out]`` in ``dtype``: a transposed view of ``[E, out, in]``
    storage, so that its gradient comes out in the parameter's own layout."""
    w = _cast(w, dtype)
    return w if transposed else w.transpose(-2, -1)


def _linear(x: Tensor, w: Tensor, offs: Tensor, transposed: bool) -> Tensor:
    """Both operands in one dtype (:func:`_compute_dtype`), then the grouped projection
    with the weight gradient in ``w``'s own layout."""
    dtype = _compute_dtype(x, w)
    return _expert_mm(_cast(x, dtype), _weight(w, dtype, transposed), offs)


def _routed_experts(
    module, layout: _Layout, hidden_states: Tensor, route: Routes, weights: Tensor
) -> Tensor:
    """Steps 2-6 of ``docs/integrations.md`` (transformers): dispatch, both projections with
    biases and the gate, optional post-expert norm, weighted combine. Returns ``[T, H]``.

    The fused path: a plain SwiGLU block (``layout.fused``: a gate, no biases, gate and
    up concatenated with the gate first, SiLU, transformers' default gate, no post
    norm: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...) runs as
    :func:`groupmm.fused.expert_block` (its two ops, ``fused._block``, called directly:
    its checks are answered here), on the stored weights through transposed views
    (their gradients in the parameters' own layout): no ``[S, H]`` copy of the input,
    and no ``[S, H]`` or ``[S, I]`` tensor kept for the backward. Everything else takes
    the steps below.
    """
    offs = route.offs
    if layout.fused:
        dtype = _compute_dtype(hidden_states, layout.w_in)
        w_in = _weight(layout.w_in, dtype, layout.transposed)
        w_out = _weight(layout.w_out, dtype, layout.transposed)
        # expert_block's checks, done where they are known: the indices and weights are
        # the routing's (int32, [T, k]), the weights' shapes checked with the layout,
        # the dtypes made one above; the devices are the caller's
        device = hidden_states.device
        check.device(layout.w_in_name, w_in, device, "hidden_states")
        check.device(layout.w_out_name, w_out, device, "hidden_states")
        x = _cast(hidden_states, dtype)
        return _block(x, w_in, w_out, offs, route.src, route.inverse, weights)
    xs = dispatch(hidden_states, route)
    h = _linear(xs, layout.w_in, offs, layout.transposed)
    expert = None
    if layout.b_in is not None or layout.b_out is not None:
        expert = route.keys.clamp(max=layout.num_experts - 1)  # placeholders: any expert
    if layout.b_in is not None:
        h = _GroupBias.apply(h, layout.b_in.to(h.dtype), expert, offs)
    h = layout.gate(h)
    y = _linear(h, layout.w_out, offs, layout.transposed)
    if layout.b_out is not None:
        y = _GroupBias.apply(y, layout.b_out.to(y.dtype), expert, offs)
    if layout.post_norm is not None:
        y = layout.post_norm(y)
    return Combine.apply(y, route.inverse, weights)


def groupmm_experts_forward(
    self: torch.nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
) -> Tensor:
    """transformers experts implementation on :func:`groupmm.grouped_mm`.

    Args:
        self: the experts module (``gate_up_proj``/``up_proj``, ``down_proj``, optional
            biases, flags; see docs/integrations.md).
        hidden_states: ``[T, H]`` tokens.
        top_k_index: ``[T, k]`` expert of each routed copy; ids ``>= num_experts`` or
            negative are expert-parallel placeholders and contribute nothing.
        top_k_weights: ``[T, k]`` routing weights (``[T, E]`` also accepted).

    Returns:
        ``[T, H]`` in ``hidden_states``' dtype.
    """
    # routing runs torch ops, no native call: these are its only checks
    check.dims("hidden_states", hidden_states, 2, "[T, H]")
    if top_k_index.shape[:1] != hidden_states.shape[:1]:
        raise ValueError(
            f"top_k_index: expected {hidden_states.shape[0]} rows (one per token of "
            f"hidden_states), found shape {tuple(top_k_index.shape)}"
        )
    layout = _layout(self, hidden_states.shape[-1])
    route, weights = _route(top_k_index, top_k_weights, layout.num_experts)
    out = _routed_experts(self, layout, hidden_states, route, weights)
    return _cast(out, hidden_states.dtype)
