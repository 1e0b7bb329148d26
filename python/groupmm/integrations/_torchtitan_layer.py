"""The classes groupmm's torchtitan integration gives torchtitan's modules: the
``_grouped_mm`` seam on groupmm, and the subclasses of an experts or routed-experts class
(cached, one per parent and path, with a ``Config`` of their own) around the forward that
:mod:`groupmm.integrations.torchtitan` passes in.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, cast

import torch
from torch import Tensor

from . import _expert_mm


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


def _experts_class(parent: type, fused: Optional[bool], forward: Callable[..., Any]) -> type:
    """:func:`groupmm.integrations.torchtitan.groupmm_experts_class`, the fused class's
    forward being ``forward``."""
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
        namespace["forward"] = forward
        namespace["groupmm_dtype"] = torch.bfloat16
    _own_config(parent, name, namespace)
    cls = type(name, (parent,), namespace)
    _CLASSES[key] = cls
    return cls


def _own_config(parent: type, name: str, namespace: dict) -> None:
    """A ``Config`` of the subclass's own in ``namespace`` when ``parent`` has a dataclass
    ``Config`` (torchtitan's configurable modules: ``cls.Config(...).build()`` then
    builds the subclass), with the parent's dataclass options."""
    config = getattr(parent, "Config", None)
    if isinstance(config, type) and dataclasses.is_dataclass(config):
        params = cast(Any, config).__dataclass_params__
        kw_only = getattr(params, "kw_only", False)
        slots = "__slots__" in config.__dict__
        options = {"kw_only": kw_only, "slots": slots} if (kw_only or slots) else {}
        namespace["Config"] = dataclasses.dataclass(**options)(
            type("Config", (config,), {"__qualname__": f"{name}.Config"})
        )


_ROUTED_CLASSES: dict = {}


def _routed_class(parent: type, forward: Callable[..., Any]) -> type:
    """:func:`groupmm.integrations.torchtitan.groupmm_routed_experts_class`, its forward
    being ``forward``."""
    if not isinstance(parent, type) or not callable(getattr(parent, "forward", None)):
        raise TypeError(f"parent: expected torchtitan's RoutedExperts class, found {parent!r}")
    if getattr(parent, "_groupmm_routed", False):
        return parent
    if parent in _ROUTED_CLASSES:
        return _ROUTED_CLASSES[parent]
    name = f"Groupmm{parent.__name__}"
    namespace: dict = {
        "forward": forward,
        "groupmm_dtype": torch.bfloat16,
        "_groupmm_parent": parent,
        "_groupmm_routed": True,
        "__module__": parent.__module__,
        "__doc__": f"{parent.__name__} on groupmm's fused SwiGLU block (dispatch, "
        "experts and combine in one).",
    }
    _own_config(parent, name, namespace)
    cls = type(name, (parent,), namespace)
    _ROUTED_CLASSES[parent] = cls
    return cls
