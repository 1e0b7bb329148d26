"""groupmm inside torchtitan's Mixture-of-Experts layers.

::

    from groupmm.integrations.torchtitan import enable_moe, enable, convert_moe_config

    enable_moe(model)              # every MoE layer of a built model on groupmm's fused block
    spec.model = convert_moe_config(spec.model)   # or the model config, before the build
    enable(model, fused=True)      # the experts modules only (torchtitan's dispatcher kept)

**The whole MoE layer** (:func:`enable_moe`, :func:`convert_moe_config`, the class
:func:`groupmm_routed_experts_class`): each torchtitan ``MoE`` keeps its own forward
(router module, per-expert counts, the ``tokens_per_expert_E`` accumulation of its
load-balancing update, shared experts), and its ``routed_experts`` (token dispatcher,
grouped experts, weighted combine) becomes groupmm's fused block on the router's ids and
weights: :func:`groupmm.fused.expert_block` at EP = 1 (routes by one sort, rows gathered
in the GEMM, SwiGLU fused, the weighted top-k sum in one row op; no host sync, runs under
``torch.compile(fullgraph=True)``), :func:`groupmm.parallel.expert_parallel_block` over
the EP group of the experts' DTensor weights at EP > 1. Measurements against torchtitan's
own layer (``benches/bench_ep.py``, ``benches/bench_torchtitan.py``): ``docs/performance.md``
and ``docs/expert_parallel.md``.

Expert parallelism, the experts-only path (``enable``), when to turn each on, and how it is
tested: ``docs/integrations.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings
from typing import Any, Optional, cast

import torch
from torch import Tensor

from .._glue import routes
from ..fused import expert_block
from ..parallel import expert_compute, expert_parallel_block
from ._torchtitan_compat import (
    _PLAIN,
    _TT_MOE,
    _WEIGHTS,
    _check_weights,
    _ep_group,
    _is_experts,
    _local,
    _moe_layers,
    _pair,
    _redistributes_nothing,
    _spmd_type_checking,
    _swiglu_experts_class,
)
from ._torchtitan_layer import _experts_class, _groupmm_seam, _routed_class, groupmm_grouped_mm

__all__ = [
    "convert_moe_config",
    "enable",
    "enable_moe",
    "grouped_experts_forward",
    "groupmm_experts_class",
    "groupmm_grouped_mm",
    "groupmm_routed_experts_class",
]


# --------------------------------------------------------------------------- the fused block


def grouped_experts_forward(
    x_RD: Tensor,
    w1_EFD: Tensor,
    w2_EDF: Tensor,
    w3_EFD: Tensor,
    num_tokens_per_expert_E: Tensor,
    *,
    dtype: Optional[torch.dtype] = torch.bfloat16,
) -> Tensor:
    """torchtitan's ``GroupedExperts`` forward on groupmm's fused SwiGLU block:
    ``out = (silu(x @ w1[g]ᵀ) * (x @ w3[g]ᵀ)) @ w2[g]ᵀ`` for the rows of each expert
    ``g``, computed in ``dtype`` and returned in ``x``'s dtype.

    Args:
        x_RD: ``[R, D]`` rows sorted by expert (``R >= sum(counts)``: rows past the
            counted ones give zero output and zero gradient).
        w1_EFD: ``[E, F, D]`` gate weights (plain tensors: ``to_local()`` DTensors first).
        w2_EDF: ``[E, D, F]`` down weights.
        w3_EFD: ``[E, F, D]`` up weights.
        num_tokens_per_expert_E: integer ``[E]`` rows per expert, on ``x``'s device.
        dtype: the compute dtype (torchtitan's ``bfloat16``); None: ``x``'s dtype.

    The block reads ``w1`` and ``w3`` in place as the pair ``(gate, up)`` (transposed
    views; casts to ``dtype`` where the parameters are of another dtype, as torchtitan's
    own forward casts them), each with its own gradient in its parameter's layout. No
    host sync.
    """
    _check_weights(w1_EFD, w2_EDF, w3_EFD)
    dtype = x_RD.dtype if dtype is None else dtype
    w_in, w_out = _pair(w1_EFD, w2_EDF, w3_EFD, dtype)
    out = expert_compute(x_RD.to(dtype), w_in, w_out, counts=num_tokens_per_expert_E)
    return out.type_as(x_RD)


def _fused_forward(self, x_RD: Tensor, num_tokens_per_expert_E: Tensor) -> Tensor:
    if not type(self)._groupmm_fused:
        # switched to the seam after a wrapper captured this forward (parallelize)
        return self._groupmm_parent.forward(self, x_RD, num_tokens_per_expert_E)
    weights = [_local(getattr(self, name, None)) for name in _WEIGHTS]
    if not all(isinstance(w, Tensor) for w in weights):
        raise TypeError(
            f"{type(self).__name__}: the fused path needs torchtitan's SwiGLU experts "
            f"weights {', '.join(_WEIGHTS)}; use fused=False for this class"
        )
    if not all(type(w) in _PLAIN for w in weights) or _spmd_type_checking():
        # another tensor subclass (float8 wrappers) or type checking: the parent's own
        # forward, its products on the groupmm seam
        return self._groupmm_parent.forward(self, x_RD, num_tokens_per_expert_E)
    w1, w2, w3 = weights
    return grouped_experts_forward(
        x_RD, w1, w2, w3, num_tokens_per_expert_E, dtype=self.groupmm_dtype
    )


# --------------------------------------------------------------------------- the classes


def groupmm_experts_class(parent: type, fused: Optional[bool] = None) -> type:
    """A subclass of ``parent`` (torchtitan's ``GroupedExperts``, ``GptOssGroupedExperts``
    or anything with the same ``_grouped_mm(self, *, A, B_t, offs)`` method) on groupmm.

    Args:
        parent: the class.
        fused: None (default) or False: the seam (a groupmm class under None:
            itself). True: the fused block (the caller vouches that ``parent`` computes
            ``w1``/``w2``/``w3`` SwiGLU; the forward raises when those weights are
            missing). A groupmm class with another ``fused`` gives its
            parent's class for that path.

    Cached: one class per parent and path. The fused class has ``groupmm_dtype =
    torch.bfloat16`` (its compute dtype; None: the input's), which an instance may
    override. When ``parent`` has a dataclass ``Config`` (torchtitan's configurable
    modules), the subclass gets its own, so ``cls.Config(...).build()`` builds it."""
    return _experts_class(parent, fused, _fused_forward)


def enable(model: torch.nn.Module, fused: Optional[bool] = None) -> int:
    """Switch every torchtitan experts module inside ``model`` (``model`` itself
    included) to groupmm, in place, by giving it the class from
    :func:`groupmm_experts_class`. Returns how many modules use groupmm afterwards.

    ``fused``: None (default): the seam for modules not on groupmm yet (the faster
    inside torchtitan: docs/integrations.md), the path they have for the others; True: the
    fused block for all (``TypeError`` when one lacks the ``w1_EFD``/``w2_EDF``/``w3_EFD``
    weights); False: the seam for all. Nothing changes when it raises.

    Before or after torchtitan's ``Module.parallelize``: that wraps the forward of each
    module it shards in an instance attribute calling the forward of its time; for the
    experts (weights only: nothing to redistribute) the wrapper is dropped so that the
    fused forward runs. A module with any other instance ``forward`` keeps its forward:
    ``ValueError`` under True, the seam and a warning where None would keep it fused.

    Raises ``ValueError`` when ``model`` holds no such module."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, found {type(model).__name__}")
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: expected None, True or False, found {fused!r}")
    modules = [m for m in model.modules() if _is_experts(m)]
    if not modules:
        raise ValueError(
            f"model: {type(model).__name__} holds no experts module with a "
            "_grouped_mm(self, *, A, B_t, offs) method (torchtitan's GroupedExperts); "
            "nothing was switched to groupmm"
        )
    plan = []
    for module in modules:
        cls = groupmm_experts_class(type(module), fused)
        drop = False
        if cls._groupmm_fused:  # type: ignore[attr-defined]
            missing = [n for n in _WEIGHTS if not isinstance(getattr(module, n, None), Tensor)]
            if missing:
                raise TypeError(
                    f"fused=True: {type(module).__name__} has no SwiGLU experts weights "
                    f"{', '.join(missing)} (torchtitan's GroupedExperts: w1_EFD, w2_EDF, "
                    "w3_EFD); use fused=None to keep such modules on the seam"
                )
            wrapped = "forward" in module.__dict__
            drop = wrapped and _redistributes_nothing(module)
            if wrapped and not drop:
                what = (
                    f"{type(module).__name__} has a forward of its own (an instance "
                    "attribute other than torchtitan's parallelize wrapper of the "
                    "experts), which the fused forward would not replace"
                )
                if fused:
                    raise ValueError(f"fused=True: {what}")
                warnings.warn(f"{what}: it stays on the seam", stacklevel=2)
                cls = groupmm_experts_class(type(module), False)
        plan.append((module, cls, drop))
    for module, cls, drop in plan:
        if drop:
            del module.__dict__["forward"]
        module.__class__ = cls
    return len(plan)


# --------------------------------------------------------------------------- the whole MoE


def _routed_forward(
    self,
    x_BLD: Tensor,
    topk_scores_BLK: Tensor,
    topk_expert_ids_BLK: Tensor,
    num_local_tokens_per_expert_E: Tensor,
) -> Tensor:
    """torchtitan's ``RoutedExperts.forward`` (dispatch, SwiGLU experts, weighted combine)
    as groupmm's fused block: :func:`groupmm.fused.expert_block` on the routes of the
    router's ids (EP = 1), :func:`groupmm.parallel.expert_parallel_block` over the EP
    group of the experts' weights (EP > 1)."""
    params = [getattr(self.inner_experts, n) for n in _WEIGHTS]
    w1, w2, w3 = (_local(w) for w in params)
    if not all(type(w) in _PLAIN for w in (w1, w2, w3)) or _spmd_type_checking():
        # weights of another tensor subclass (float8 wrappers) or SPMD type checking:
        # torchtitan's own dispatch, experts and combine
        return self._groupmm_parent.forward(
            self, x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E
        )
    dim = x_BLD.shape[-1]
    top_k = topk_expert_ids_BLK.shape[-1]
    x = x_BLD.reshape(-1, dim)
    ids = topk_expert_ids_BLK.reshape(-1, top_k)
    scores = topk_scores_BLK.reshape(-1, top_k)
    dtype = x.dtype if self.groupmm_dtype is None else self.groupmm_dtype
    w_in, w_out = _pair(w1, w2, w3, dtype)
    if scores.dtype not in (dtype, torch.float32):
        scores = scores.float()  # torchtitan weights the experts' outputs in float32
    group = _ep_group(params[0])
    if group is None:
        r = routes(ids, w1.shape[0])
        out = expert_block(x.to(dtype), w_in, w_out, r.offs, r.src, r.inverse, scores)
    else:
        out = expert_parallel_block(x.to(dtype), ids, scores, w_in, w_out, group)
    return out.type_as(x_BLD).view(x_BLD.shape[0], -1, dim)


_OURS = (_fused_forward, _groupmm_seam)


def groupmm_routed_experts_class(parent: type) -> type:
    """A subclass of ``parent`` (torchtitan's ``RoutedExperts``: ``inner_experts`` +
    ``token_dispatcher``, ``forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
    num_local_tokens_per_expert_E)``) whose forward is groupmm's fused block on the
    routed tokens (:func:`enable_moe` says what runs). Cached; ``groupmm_dtype =
    torch.bfloat16`` (the compute dtype, torchtitan's; None: the input's); its own
    ``Config`` when ``parent`` has a dataclass one. A groupmm class gives itself."""
    return _routed_class(parent, _routed_forward)


#: enable_moe's dtype default: the class's groupmm_dtype
_KEEP: Any = object()


def enable_moe(model: torch.nn.Module, *, dtype: Any = _KEEP) -> int:
    """Run every torchtitan ``MoE`` layer inside ``model`` (``model`` itself included)
    on groupmm's fused MoE block, in place. Returns how many MoE layers run on groupmm
    afterwards.

    What runs: the ``MoE`` module keeps torchtitan's own forward, so its router module
    (scores, softmax or sigmoid, ``expert_bias_E`` for aux-loss-free balancing,
    node-limited routing, ``route_norm``, ``route_scale``), its per-expert token counts
    and the ``tokens_per_expert_E`` accumulation its load-balancing update reads, and its
    shared experts run exactly as in torchtitan; its ``routed_experts`` (token
    dispatcher, grouped experts, weighted combine) gets the class from
    :func:`groupmm_routed_experts_class`: groupmm's fused block on the router's ids and
    weights, the experts' ``w1``/``w3`` read in place as the pair ``(gate, up)`` (no
    per-step copy) and ``w2`` as ``w_out``, computed in ``groupmm_dtype`` (torchtitan's
    bfloat16) and returned in the input's dtype. Parameters, buffers and their names are
    unchanged (the same ``state_dict``: torchtitan's checkpoints load as they are).

    - EP = 1 (plain weights, or DTensors whose expert dim is not sharded):
      :func:`groupmm.fused.expert_block` on :func:`groupmm._glue.routes` of the ids; no
      host sync; runs under ``torch.compile(fullgraph=True)`` per transformer block as
      torchtitan compiles it.
    - EP > 1 (torchtitan's ``MoE.parallelize`` with EP: the experts' weights DTensors
      sharded along dim 0 over the EP mesh dim): :func:`groupmm.parallel.
      expert_parallel_block` over that mesh dim's process group (taken from
      ``w1_EFD.device_mesh``) on the local shards, each token sent once to each rank
      holding any of its experts; torchtitan's dispatcher is not used. One host sync per
      layer call (the split sizes): under ``torch.compile`` that is a graph break, so
      compile the blocks with ``fullgraph=False`` at EP > 1.
    - Weights of another tensor subclass (float8 wrappers) and SPMD type checking:
      torchtitan's own routed forward.

    Args:
        model: a built torchtitan model or module, before ``Module.parallelize`` (which
            wraps the forward it finds; ``convert_moe_config`` converts a config before
            the model is built).
        dtype: the experts' compute dtype for the converted layers (``groupmm_dtype``;
            None: the input's dtype); by default the class's, ``torch.bfloat16``.

    Raises ``ValueError`` (``model`` holds no MoE layer; a layer parallelized already),
    ``TypeError`` (experts that are not torchtitan's SwiGLU ``GroupedExperts``: use
    :func:`enable`, the seam, for those); nothing changes when it raises."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, found {type(model).__name__}")
    if dtype is not _KEEP and dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype or None, found {dtype!r}")
    layers = _moe_layers(model, _OURS)
    for _fqn, routed, _inner, _dispatcher in layers:
        routed.__class__ = groupmm_routed_experts_class(type(routed))
        if dtype is not _KEEP:
            routed.groupmm_dtype = dtype
    return len(layers)


def convert_moe_config(model_config: Any) -> Any:
    """torchtitan's model config (``Module.Config`` tree, e.g. ``model_registry(
    "30B-A3B").model``) with every ``RoutedExperts.Config`` replaced by the config of
    :func:`groupmm_routed_experts_class`'s class, as torchtitan's own model converters
    swap classes before the build: the model built from it has its MoE layers on groupmm
    (:func:`enable_moe` says what runs) before torchtitan parallelizes it. Returns the
    config (the same object, changed in place, unless the root itself is replaced).
    Imports torchtitan. ``TypeError`` (nothing changed) where the experts are not
    torchtitan's SwiGLU ``GroupedExperts``."""
    RoutedExperts = importlib.import_module(_TT_MOE).RoutedExperts

    found = list(model_config.traverse(RoutedExperts.Config))
    for fqn, config, _parent, _attr in found:
        owner = type(config.inner_experts)._owner
        if not _swiglu_experts_class(owner, _OURS):
            raise TypeError(
                f"model_config: {fqn}.inner_experts builds {owner.__name__}, not "
                "torchtitan's SwiGLU GroupedExperts; use enable(model) for this class"
            )
    for _fqn, config, parent, attr in found:
        cls = groupmm_routed_experts_class(type(config)._owner)
        fields = dataclasses.fields(config)
        new = cast(Any, cls).Config(**{f.name: getattr(config, f.name) for f in fields if f.init})
        if parent is None:
            model_config = new
        elif isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return model_config
