"""groupmm inside other frameworks' Mixture-of-Experts layers.

- :mod:`groupmm.integrations.transformers`: a Hugging Face transformers experts
  implementation (``register()``, then ``experts_implementation="groupmm"``, or
  ``enable(model)``).
- :mod:`groupmm.integrations.torchtitan`: torchtitan's SwiGLU ``GroupedExperts`` on the
  fused expert block, its other experts with their ``_grouped_mm`` seam routed to
  groupmm (``enable(model)``).

Neither framework is a dependency of groupmm: the submodules import their framework
only where they need it and say how to install it when it is missing.

Both use :func:`_expert_mm`, groupmm's packed product ``x @ b[g]`` (its weight gradient
comes out in ``b``'s own memory layout, as every packed gradient does).
"""

from __future__ import annotations

from torch import Tensor

from .. import grouped_mm

__all__ = ["torchtitan", "transformers"]


def _expert_mm(x: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``x @ b[g]`` per group of rows (``x [R, K]``, ``b [E, K, N]``, int32 ``offs [E]``
    group ends; rows past ``offs[-1]`` are zero). Its weight gradient comes out in
    ``b``'s own layout (for a transposed view of ``[E, N, K]`` weights, ``[E, N, K]``
    storage), which ``grouped_mm``'s backward now gives every caller; this name stays
    the integrations' one entry point. Differentiable twice; compile-safe."""
    return grouped_mm(x, b, offs=offs)


def __getattr__(name):
    if name in __all__:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'groupmm.integrations' has no attribute {name!r}")
