"""torchtitan's objects as groupmm's torchtitan integration reads them, without importing
torchtitan: the experts' weight names, checks and ``(gate, up)`` views, DTensors' local
shards and EP process group, ``Module.parallelize``'s wrapper, and the MoE layers of a
model with the reason one cannot run on groupmm's block.
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from .. import _checks as check

#: its weights: gate, down, up
_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
_PLAIN = (Tensor, torch.nn.Parameter)


def _pair(
    w1: Tensor, w2: Tensor, w3: Tensor, dtype: torch.dtype
) -> Tuple[Tuple[Tensor, Tensor], Tensor]:
    """``((gate, up), w_out)`` of groupmm's block from torchtitan's weights, in
    ``dtype``: transposed views of the parameters (casts where their dtype differs), no
    concatenation."""
    gate = w1.to(dtype).transpose(1, 2)
    up = w3.to(dtype).transpose(1, 2)
    return (gate, up), w2.to(dtype).transpose(1, 2)


def _check_weights(w1: Tensor, w2: Tensor, w3: Tensor) -> None:
    check.dims("w1_EFD", w1, 3, "[E, F, D]")
    experts, width, dim = w1.shape
    check.dims("w3_EFD", w3, 3, "[E, F, D]")
    check.same_shape("w3_EFD", w3, "w1_EFD", w1)
    check.dims("w2_EDF", w2, 3, "[E, D, F]")
    ok = w2.shape == (experts, dim, width)
    check.shape("w2_EDF", w2, ok, "[E={}, D={}, F={}] (w1_EFD's E, D, F)", experts, dim, width)


def _local(w: Any) -> Any:
    """A DTensor's local tensor (expert parallelism, FSDP), anything else as it is."""
    if type(w) in _PLAIN:
        return w
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is not None and isinstance(w, tensor_module.DTensor):
        return w.to_local()
    return w


def _spmd_type_checking() -> bool:
    spmd = sys.modules.get("spmd_types")
    is_checking = getattr(spmd, "is_type_checking", None)
    return bool(is_checking is not None and is_checking())


def _is_experts(module: Any) -> bool:
    return callable(getattr(type(module), "_grouped_mm", None)) and hasattr(module, "num_experts")


_PARALLELIZE_WRAPPER = "Module.parallelize.<locals>.forward_with_redistribution"
_REDISTRIBUTIONS = (
    "in_src_shardings",
    "in_dst_shardings",
    "out_src_shardings",
    "out_dst_shardings",
    "local_map",
)


def _redistributes_nothing(module: Any) -> bool:
    """``module.forward`` is torchtitan's ``Module.parallelize`` wrapper around a
    sharding config of states only (no input, output or local-map sharding): the wrapper
    passes the arguments and the output through unchanged."""
    wrapper = module.__dict__.get("forward")
    if getattr(wrapper, "__qualname__", None) != _PARALLELIZE_WRAPPER:
        return False
    config = getattr(module, "_sharding_config", None)
    return config is not None and all(getattr(config, n, None) is None for n in _REDISTRIBUTIONS)


_TT_MOE = "torchtitan.models.common.moe"


def _ep_group(w: Any) -> Optional[Any]:
    """The process group over which the DTensor ``w`` shards its experts (dim 0, on one
    mesh dim of more than one rank: torchtitan's EP mesh dim); None for a plain tensor
    or experts not sharded (EP = 1, expert TP)."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    if tensor_module is None or not isinstance(w, tensor_module.DTensor):
        return None
    mesh = w.device_mesh
    dims = [i for i, p in enumerate(w.placements) if p.is_shard(0) and mesh.size(i) > 1]
    if not dims:
        return None
    if len(dims) > 1:
        names = mesh.mesh_dim_names or tuple(range(mesh.ndim))
        raise ValueError(
            "w1_EFD: experts sharded along dim 0 over several mesh dims "
            f"{[names[i] for i in dims]}; expected one (torchtitan's EP dim)"
        )
    return mesh.get_group(dims[0])


def _swiglu_experts_class(cls: type, ours: Tuple[Any, ...]) -> bool:
    """``cls`` computes torchtitan's SwiGLU experts: its ``forward`` and ``_grouped_mm``
    are torchtitan's ``GroupedExperts``' own or groupmm's (``ours``: the integration's
    fused forward and seam)."""
    for attr in ("forward", "_grouped_mm"):
        fn = getattr(cls, attr, None)
        if fn in ours:
            continue
        where = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None))
        if where != (_TT_MOE, f"GroupedExperts.{attr}"):
            return False
    return True


def _moe_parts(module: Any) -> Optional[Tuple[Any, Any, Any]]:
    """``(routed_experts, inner_experts, token_dispatcher)`` of a torchtitan ``MoE``
    (router, routed experts, the ``tokens_per_expert_E`` buffer), else None."""
    routed = getattr(module, "routed_experts", None)
    inner = getattr(routed, "inner_experts", None)
    dispatcher = getattr(routed, "token_dispatcher", None)
    if not (
        isinstance(routed, torch.nn.Module)
        and isinstance(inner, torch.nn.Module)
        and dispatcher is not None
        and isinstance(getattr(module, "router", None), torch.nn.Module)
        and hasattr(module, "tokens_per_expert_E")
    ):
        return None
    return routed, inner, dispatcher


def _why_not(
    fqn: str, routed: Any, inner: Any, dispatcher: Any, ours: Tuple[Any, ...]
) -> Optional[Exception]:
    """The error saying why the MoE at ``fqn`` cannot run on groupmm's block, or None."""
    at = f"model: {fqn}.routed_experts" if fqn else "model: routed_experts"
    names = {n for n, _ in inner.named_parameters()}
    if names != set(_WEIGHTS) or not _swiglu_experts_class(type(inner), ours):
        return TypeError(
            f"{at}.inner_experts is {type(inner).__name__} (parameters "
            f"{sorted(names)}), not torchtitan's SwiGLU GroupedExperts (w1_EFD, w2_EDF, "
            "w3_EFD, no bias); enable_moe runs SwiGLU experts only: use enable(model) for "
            "this class (its expert products on groupmm's grouped_mm seam)"
        )
    experts = inner.w1_EFD.shape[0]
    if getattr(dispatcher, "num_experts", experts) != experts:
        return ValueError(
            f"{at}: its token dispatcher routes to {dispatcher.num_experts} experts, "
            f"its inner_experts hold {experts}"
        )
    if "forward" in routed.__dict__:
        return ValueError(
            f"{at} has a forward of its own (torchtitan's Module.parallelize wraps it): "
            "call enable_moe before parallelize, or build the model from a config "
            "converted by convert_moe_config"
        )
    return None


def _moe_layers(model: torch.nn.Module, ours: Tuple[Any, ...]) -> List[Tuple[Any, ...]]:
    """``(fqn, routed_experts, inner_experts, token_dispatcher)`` of every torchtitan
    ``MoE`` inside ``model`` (``model`` itself included), each checked by :func:`_why_not`
    unless already on groupmm; raises where there is none or one cannot be converted."""
    layers = []
    for fqn, module in model.named_modules():
        parts = _moe_parts(module)
        if parts is not None:
            layers.append((fqn, *parts))
    if not layers:
        raise ValueError(
            f"model: {type(model).__name__} holds no torchtitan MoE layer (a module with "
            "router, routed_experts.inner_experts, routed_experts.token_dispatcher and "
            "tokens_per_expert_E); nothing was switched to groupmm"
        )
    for fqn, routed, inner, dispatcher in layers:
        if getattr(type(routed), "_groupmm_routed", False):
            continue
        error = _why_not(fqn, routed, inner, dispatcher, ours)
        if error is not None:
            raise error
    return layers
