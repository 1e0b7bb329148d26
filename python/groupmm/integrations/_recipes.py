"""Saved tensors that the backward builds again instead of keeping them: the eager path
of the torchtitan integration's fused block, whose ``[w1 | w3]`` weight copy is not kept
(:mod:`groupmm.integrations.torchtitan` says when and why)."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import torch
from torch import Tensor


class _Recipe:
    """A tensor that the backward builds again instead of keeping it: ``build()`` makes
    the storage of ``base`` anew from ``sources``; a saved view of it is rebuilt with its
    own geometry."""

    def __init__(self, base: Tensor, build: Callable[[], Tensor], sources: Tuple[Tensor, ...]):
        storage = base.untyped_storage()
        self.key = (storage.data_ptr(), storage.nbytes(), base.device)
        self.build = build
        self.sources = sources

    def matches(self, t: Tensor) -> bool:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes(), t.device) == self.key


class _SavedAsRecipes:
    """``saved_tensors_hooks`` under which a saved tensor from a recipe's storage is kept
    as (recipe, view geometry, the sources' versions) and built again when the backward
    reads it; every other saved tensor goes to the hooks in force outside, or is kept
    (detached, with its version checked as autograd does)."""

    def __init__(self, recipes: List[_Recipe]):
        self.recipes = recipes
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *args: object) -> None:
        self.hooks.__exit__(*args)

    def pack(self, t: Tensor) -> Any:
        for recipe in self.recipes:
            if recipe.matches(t):
                view = (t.shape, t.stride(), t.storage_offset())
                return ("recipe", recipe, view, [s._version for s in recipe.sources])
        if self.outer is not None:
            return ("outer", self.outer[1], self.outer[0](t))
        return ("plain", t.detach(), t._version)

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        kind = packed[0]
        if kind == "outer":
            return packed[1](packed[2])
        if kind == "plain":
            t, version = packed[1], packed[2]
            _check_version(t._version, version, "a saved tensor")
            return t
        recipe, (size, stride, offset), versions = packed[1:]
        for s, version in zip(recipe.sources, versions):
            _check_version(s._version, version, "an expert weight")
        with torch.no_grad():
            return recipe.build().as_strided(size, stride, offset)


def _check_version(now: int, then: int, what: str) -> None:
    if now != then:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by "
            f"an inplace operation: {what} of groupmm's torchtitan experts is at version "
            f"{now}; expected version {then} instead"
        )


def _recipes_apply() -> bool:
    """Eager autograd on real tensors: grad mode, no compiler, no dispatch mode (fake
    tensors, make_fx, selective checkpointing's caching mode), hooks not disabled."""
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
    )
