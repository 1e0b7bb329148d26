"""groupmm inside torchtitan's Mixture-of-Experts layers.

::

    from groupmm.integrations.torchtitan import enable, groupmm_experts_class

    enable(model)                      # every experts module of a built model, in place
    cls = groupmm_experts_class(GroupedExperts)   # or build the subclass yourself:
    experts = cls.Config(dim=2048, hidden_dim=768, num_experts=128).build()

What runs (``fused`` of :func:`enable` / :func:`groupmm_experts_class`):

- **The seam** (``fused=None``, the default, or False; the only path for classes that are
  not plain SwiGLU, e.g. ``GptOssGroupedExperts`` with its biases and clamped
  activation): torchtitan runs every expert product through ``_grouped_mm(self, *, A,
  B_t, offs)``; it becomes ``groupmm.grouped_mm`` (rows past ``offs[-1]`` zero; the
  weight gradient in ``B_t``'s own layout, no transposed copy:
  :func:`groupmm.integrations._expert_mm`).
- **The fused block** (``fused=True``, for torchtitan's SwiGLU ``GroupedExperts`` or any
  class with its ``w1_EFD`` gate, ``w3_EFD`` up and ``w2_EDF`` down weights, no bias):
  the forward is replaced by :func:`grouped_experts_forward`, i.e.
  :func:`groupmm.parallel.expert_compute` on the expert-major rows (on Hopper the up
  projection and SwiGLU are one kernel, the backward's dSwiGLU is fused into the
  ``dgated`` product; the backward keeps the rows and the ``[R, 2F]`` pre-activation,
  no ``[R, F]`` tensor). Same semantics as torchtitan's forward: DTensor weights (expert
  parallelism, FSDP) are used through ``to_local()``, rows and weights are cast to
  ``groupmm_dtype`` (class attribute, ``torch.bfloat16`` as torchtitan; None: ``x``'s
  dtype) and the output back with ``.type_as(x)``; the parameters stay ``w1/w2/w3``
  (checkpoints unchanged). Rows past ``sum(counts)`` (padding some dispatchers leave)
  give zero output and zero gradient. Weights of another tensor subclass (e.g. float8
  wrappers) and spmd_types type checking take the parent's forward on the seam.

Why the seam is the default: measured inside torchtitan 0.3.0's own EP layer
(``benches/bench_ep.py``, impls ``tt_seam`` and ``tt_groupmm``, H100, bf16, 16k tokens
per GPU, ``benches/results/h100x2_bf16_issue30_ep_*.json``), the seam is 1.00–1.06x
torchtitan's ``torch._grouped_mm`` at EP = 1 and 2 (Qwen3-30B-A3B, OLMoE, Mixtral sizes),
while the fused block is 0.91–1.03x: writing ``[w1 | w3]`` every step (and again in
the backward) and splitting its gradient costs more than the fusion saves inside
torchtitan's dispatcher. The fused block pays where groupmm owns the whole layer
(:class:`groupmm.moe.MoELayer`, ``ep_group=``: about 2x torchtitan's EP layer).

The fused kernel reads gate and up as one ``[E, D, 2F]`` operand; torchtitan keeps
``w1`` and ``w3`` apart (its checkpoint format), so each forward writes ``[w1 | w3]``
once (``[E, 2F, D]`` contiguous, the cast to ``groupmm_dtype`` in the same copy);
``w_in`` is its transposed view and ``w_out = w2.transpose(1, 2)``, so the weight
gradients come in the parameters' own layout (``w1``/``w3``'s as contiguous halves of the
``[E, 2F, D]`` gradient, ``w2``'s through the view; contiguous, in the parameters'
dtypes). That copy is NOT kept for the backward (48 layers would hold 48 copies of the
gate/up weights):

- eager: the call runs under ``torch.autograd.graph.saved_tensors_hooks`` that save it
  as a recipe (the parameters, the view's geometry, their versions) and write it again
  when the backward reads it, likewise ``w2``'s copy when the parameters are of another
  dtype. Every other saved tensor goes to the hooks in force outside (activation
  checkpointing, CPU offload) or is kept as is; an in-place change of the parameters
  between forward and backward raises, as autograd does. Under a dispatch mode (fake
  tensors, ``make_fx``, selective checkpointing's caching mode) or with saved-tensor
  hooks disabled: plain saving.
- ``torch.compile`` (``torch.compiler.is_compiling()``): the copies are made in a
  ``torch.utils.checkpoint`` region, so the partitioner saves the parameters and
  recomputes them in the backward.

Turning it on: :func:`enable` on a built model, before or after torchtitan's
``Module.parallelize`` (whose wrapper of the experts' forward it drops: weights only,
nothing to redistribute), or :func:`groupmm_experts_class`'s ``Config`` in the model
config (as torchtitan's own converters swap classes); ``enable(model, fused=True)``
for the fused block.

torchtitan is not a dependency: nothing here imports it. The tests
(``tests/python/test_integration_torchtitan.py``) run against a stand-in with the same
contract, and, when torchtitan imports, against the real classes and torchtitan's own
expert parallelism (``MoE.parallelize``, ``AllToAllTokenDispatcher``) on 2 gloo
processes.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any, Optional, Tuple, cast

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from .. import _checks as check
from ..parallel import expert_compute
from . import _expert_mm
from ._recipes import _Recipe, _recipes_apply, _SavedAsRecipes

__all__ = [
    "enable",
    "grouped_experts_forward",
    "groupmm_experts_class",
    "groupmm_grouped_mm",
]

#: its weights: gate, down, up
_WEIGHTS = ("w1_EFD", "w2_EDF", "w3_EFD")
_PLAIN = (Tensor, torch.nn.Parameter)


def groupmm_grouped_mm(A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(A, B_t, offs=offs)`` on groupmm: ``A[rows of g] @ B_t[g]``.

    Args:
        A: ``[R, K]`` rows sorted by group.
        B_t: ``[E, K, N]`` (any strides; its layout decides the weight gradient's).
        offs: ``[E]`` cumulative group ends (int32; other integer dtypes are converted).
    """
    if offs.dtype != torch.int32 and not offs.dtype.is_floating_point:
        offs = offs.to(torch.int32)
    return _expert_mm(A, B_t, offs)


# --------------------------------------------------------------------------- the fused block


class _GateUp(torch.autograd.Function):
    """``[w1 | w3]`` along dim 1 in ``dtype`` (``[E, 2F, D]``, contiguous): the cat and
    the cast in one copy. Backward: each half of the gradient as a contiguous tensor in
    its weight's dtype. Saves no tensor."""

    @staticmethod
    def forward(ctx: Any, w1: Tensor, w3: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.dtypes = (w1.dtype, w3.dtype)
        return _gate_up(w1, w3, dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        width = grad.shape[1] // 2
        halves = (grad[:, :width], grad[:, width:])
        out = [
            h.to(dtype, memory_format=torch.contiguous_format) if need else None
            for h, dtype, need in zip(halves, ctx.dtypes, ctx.needs_input_grad)
        ]
        return out[0], out[1], None


def _gate_up(w1: Tensor, w3: Tensor, dtype: torch.dtype) -> Tensor:
    experts, width, dim = w1.shape
    out = w1.new_empty((experts, 2 * width, dim), dtype=dtype)
    out[:, :width].copy_(w1)
    out[:, width:].copy_(w3)
    return out


def _weights(w1: Tensor, w2: Tensor, w3: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(w_in, w_out)`` of :func:`groupmm.parallel.expert_compute` from torchtitan's
    weights, by torch ops (what a compiled forward traces)."""
    return torch.cat([w1, w3], 1).to(dtype).transpose(1, 2), w2.to(dtype).transpose(1, 2)


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

    One copy of ``[w1 | w3]`` per call, not kept for the backward (module docstring).
    No host sync.
    """
    check.dims("w1_EFD", w1_EFD, 3, "[E, F, D]")
    experts, width, dim = w1_EFD.shape
    check.dims("w3_EFD", w3_EFD, 3, "[E, F, D]")
    check.same_shape("w3_EFD", w3_EFD, "w1_EFD", w1_EFD)
    check.dims("w2_EDF", w2_EDF, 3, "[E, D, F]")
    ok = w2_EDF.shape == (experts, dim, width)
    check.shape("w2_EDF", w2_EDF, ok, "[E={}, D={}, F={}] (w1_EFD's E, D, F)", experts, dim, width)
    dtype = x_RD.dtype if dtype is None else dtype
    rows = x_RD.to(dtype)
    if torch.compiler.is_compiling():
        # the weights' views made in a checkpointed region: the partitioner recomputes
        # them in the backward from the parameters instead of saving the copy
        w_in, w_out = _checkpoint(_weights, w1_EFD, w2_EDF, w3_EFD, dtype, use_reentrant=False)
        out = expert_compute(rows, w_in, w_out, counts=num_tokens_per_expert_E)
        return out.type_as(x_RD)
    w_in = _GateUp.apply(w1_EFD, w3_EFD, dtype)
    w_down = w2_EDF.to(dtype)
    args = (rows, w_in.transpose(1, 2), w_down.transpose(1, 2))
    if not _recipes_apply():
        out = expert_compute(*args, counts=num_tokens_per_expert_E)
    else:
        recipes = [_Recipe(w_in, lambda: _gate_up(w1_EFD, w3_EFD, dtype), (w1_EFD, w3_EFD))]
        if w_down is not w2_EDF:  # a copy in dtype: rebuilt too
            recipes.append(_Recipe(w_down, lambda: w2_EDF.to(dtype), (w2_EDF,)))
        with _SavedAsRecipes(recipes):
            out = expert_compute(*args, counts=num_tokens_per_expert_E)
    return out.type_as(x_RD)


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


def _groupmm_seam(self, *, A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
    return groupmm_grouped_mm(A, B_t, offs)


_CLASSES: dict = {}


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
    if not isinstance(parent, type) or not callable(getattr(parent, "_grouped_mm", None)):
        raise TypeError(
            "parent: expected a class with a _grouped_mm(self, *, A, B_t, offs) method "
            f"(torchtitan's GroupedExperts), found {parent!r}"
        )
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: expected None, True or False, found {fused!r}")
    own = getattr(parent, "_groupmm_parent", None)
    if own is not None:
        if fused is None or fused == parent._groupmm_fused:  # type: ignore[attr-defined]
            return parent  # already a groupmm class
        parent = own
    fused = bool(fused)  # None: the seam (the fused block is asked for, see the module)
    key = (parent, fused)
    if key in _CLASSES:
        return _CLASSES[key]
    name = f"Groupmm{'Fused' if fused else ''}{parent.__name__}"
    namespace: dict = {
        "_grouped_mm": _groupmm_seam,
        "_groupmm_parent": parent,
        "_groupmm_fused": fused,
        "__module__": parent.__module__,
        "__doc__": (
            f"{parent.__name__} on groupmm's fused SwiGLU block."
            if fused
            else f"{parent.__name__} with its expert products on groupmm.grouped_mm."
        ),
    }
    if fused:
        namespace["forward"] = _fused_forward
        namespace["groupmm_dtype"] = torch.bfloat16
    config = getattr(parent, "Config", None)
    if isinstance(config, type) and dataclasses.is_dataclass(config):
        params = cast(Any, config).__dataclass_params__
        kw_only = getattr(params, "kw_only", False)
        slots = "__slots__" in config.__dict__
        options = {"kw_only": kw_only, "slots": slots} if (kw_only or slots) else {}
        namespace["Config"] = dataclasses.dataclass(**options)(
            type("Config", (config,), {"__qualname__": f"{name}.Config"})
        )
    cls = type(name, (parent,), namespace)
    _CLASSES[key] = cls
    return cls


def _is_experts(module: Any) -> bool:
    return callable(getattr(type(module), "_grouped_mm", None)) and hasattr(module, "num_experts")


def enable(model: torch.nn.Module, fused: Optional[bool] = None) -> int:
    """Switch every torchtitan experts module inside ``model`` (``model`` itself
    included) to groupmm, in place, by giving it the class from
    :func:`groupmm_experts_class`. Returns how many modules use groupmm afterwards.

    ``fused``: None (default): the seam for modules not on groupmm yet (the faster
    inside torchtitan: module docstring), the path they have for the others; True: the
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
