"""groupmm inside torchtitan's Mixture-of-Experts layers.

torchtitan runs every expert product of its ``GroupedExperts``
(``torchtitan/models/common/moe.py``) and ``GptOssGroupedExperts``
(``torchtitan/models/gpt_oss/moe.py``) through one overridable method::

    def _grouped_mm(self, *, A, B_t, offs):      # torch._grouped_mm(A, B_t, offs=offs)

with ``A [R, K]`` routed rows sorted by expert, ``B_t [E, K, N]`` (a transposed view of
the ``[E, N, K]`` expert weights) and ``offs`` the int32 cumulative group ends ``[E]``.
torchtitan's own MXFP8 converter swaps that method by subclassing; this module does the
same with groupmm::

    from groupmm.integrations.torchtitan import enable, groupmm_experts_class

    enable(model)                      # every experts module of a built model
    cls = groupmm_experts_class(GroupedExperts)   # or build the subclass yourself:
    experts = cls.Config(dim=2048, hidden_dim=768, num_experts=128).build()

What changes against ``torch._grouped_mm``: the products run on
``groupmm.grouped_mm`` (custom ops: ``torch.compile(fullgraph=True)`` traces through, no
host synchronisation); the weight gradient comes out in ``B_t``'s own layout, so the
``[E, N, K]`` parameters get theirs without a transposed copy (see
:func:`groupmm.integrations._expert_mm`); rows past ``offs[-1]`` (padding that
torchtitan's dispatchers may leave) are zero rather than unwritten; any dtype groupmm
supports works (torchtitan's forwards cast to bfloat16 themselves).

torchtitan is not a dependency: nothing here imports it. Its PyPI release (0.3.0) needs
``triton``, ``tyro``, ``spmd_types`` and a CUDA-oriented stack to import its MoE module,
which a CPU test machine lacks, so the tests
(``tests/python/test_integration_torchtitan.py``) run against a minimal stand-in with
the same ``_grouped_mm`` contract and the same forward as ``GroupedExperts``, and also
against the real classes when ``torchtitan.models.common.moe`` imports (done on CPU
with torchtitan 0.3.0, bfloat16).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import Tensor

from . import _expert_mm

__all__ = ["enable", "groupmm_experts_class", "groupmm_grouped_mm"]


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


def _groupmm_seam(self, *, A: Tensor, B_t: Tensor, offs: Tensor) -> Tensor:
    return groupmm_grouped_mm(A, B_t, offs)


_CLASSES: dict = {}


def groupmm_experts_class(parent: type) -> type:
    """A subclass of ``parent`` (torchtitan's ``GroupedExperts``, ``GptOssGroupedExperts``
    or anything with the same ``_grouped_mm(self, *, A, B_t, offs)`` method) whose
    ``_grouped_mm`` runs on groupmm. Cached: one class per parent. When ``parent`` has a
    dataclass ``Config`` (torchtitan's configurable modules), the subclass gets its own,
    so ``cls.Config(...).build()`` builds the groupmm class."""
    if not isinstance(parent, type) or not callable(getattr(parent, "_grouped_mm", None)):
        raise TypeError(
            "parent: expected a class with a _grouped_mm(self, *, A, B_t, offs) method "
            f"(torchtitan's GroupedExperts), found {parent!r}"
        )
    if getattr(parent, "_groupmm_parent", None) is not None:
        return parent  # already a groupmm class
    if parent in _CLASSES:
        return _CLASSES[parent]
    namespace = {
        "_grouped_mm": _groupmm_seam,
        "_groupmm_parent": parent,
        "__module__": parent.__module__,
        "__doc__": f"{parent.__name__} with its expert products on groupmm.grouped_mm.",
    }
    config = getattr(parent, "Config", None)
    if isinstance(config, type) and dataclasses.is_dataclass(config):
        params = cast(Any, config).__dataclass_params__
        kw_only = getattr(params, "kw_only", False)
        slots = "__slots__" in config.__dict__
        options = {"kw_only": kw_only, "slots": slots} if (kw_only or slots) else {}
        namespace["Config"] = dataclasses.dataclass(**options)(
            type("Config", (config,), {"__qualname__": f"Groupmm{parent.__name__}.Config"})
        )
    cls = type(f"Groupmm{parent.__name__}", (parent,), namespace)
    _CLASSES[parent] = cls
    return cls


def _is_experts(module: Any) -> bool:
    return callable(getattr(type(module), "_grouped_mm", None)) and hasattr(module, "num_experts")


def enable(model: torch.nn.Module) -> int:
    """Switch every torchtitan experts module inside ``model`` (``model`` itself
    included) to groupmm, in place, by giving it the class from
    :func:`groupmm_experts_class`. Returns how many modules use groupmm afterwards.
    Idempotent. Raises ``ValueError`` when ``model`` holds no such module."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, found {type(model).__name__}")
    count = 0
    for module in model.modules():
        if _is_experts(module):
            module.__class__ = groupmm_experts_class(type(module))
            count += 1
    if count == 0:
        raise ValueError(
            f"model: {type(model).__name__} holds no experts module with a "
            "_grouped_mm(self, *, A, B_t, offs) method (torchtitan's GroupedExperts); "
            "nothing was switched to groupmm"
        )
    return count
