"""groupmm inside other frameworks' Mixture-of-Experts layers.

- :mod:`groupmm.integrations.transformers`: a Hugging Face transformers experts
  implementation (``register()``, then ``experts_implementation="groupmm"``, or
  ``enable(model)``).
- :mod:`groupmm.integrations.torchtitan`: torchtitan's ``GroupedExperts`` with its
  ``_grouped_mm`` seam routed to groupmm.

Neither framework is a dependency of groupmm: the submodules import their framework
only where they need it and say how to install it when it is missing.

Both use :func:`_expert_mm`, groupmm's packed product ``x @ b[g]`` whose weight gradient
comes out in ``b``'s own memory layout (see there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import grouped_mm

__all__ = ["torchtitan", "transformers"]


def _column_major(b: Tensor) -> bool:
    """``b[g]`` is stored column by column (a transposed view of ``[E, N, K]``)."""
    return b.stride(-2) == 1 and b.stride(-1) != 1 and b.shape[-1] > 1


class _ExpertMM(torch.autograd.Function):
    """``out[rows of g] = x[rows of g] @ b[g]`` (packed, ``offs`` int32 group ends).

    Same values as ``groupmm.grouped_mm(x, b, offs=offs)`` with its autograd, except that
    the weight gradient follows ``b``'s layout, as torch's own grouped_mm backward does:
    for a transposed view of ``[E, N, K]`` parameters (how MoE layers store ``nn.Linear``
    style expert weights) it is computed as ``grad_gᵀ · x_g`` straight into ``[E, N,
    K]``. ``grouped_mm``'s own backward returns a contiguous ``[E, K, N]`` gradient that
    autograd would then copy, transposed, into the parameter's layout: on an H200 that
    copy doubled a Qwen3-30B-A3B MoE block's backward."""

    @staticmethod
    def forward(ctx, x: Tensor, b: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, b, offs)
        return grouped_mm(x, b, offs=offs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, b, offs = ctx.saved_tensors
        dx = db = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(grad, b.transpose(-2, -1), offs=offs)
        if ctx.needs_input_grad[1]:
            if _column_major(b):
                db = grouped_mm(grad.transpose(0, 1), x, offs=offs).transpose(-2, -1)
            else:
                db = grouped_mm(x.transpose(0, 1), grad, offs=offs)
        return dx, db, None


def _expert_mm(x: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``x @ b[g]`` per group of rows (``x [R, K]``, ``b [E, K, N]``, int32 ``offs [E]``
    group ends; rows past ``offs[-1]`` are zero), with the weight gradient in ``b``'s
    layout. Differentiable twice; compile-safe (groupmm's custom ops underneath)."""
    return _ExpertMM.apply(x, b, offs)


def __getattr__(name):
    if name in __all__:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'groupmm.integrations' has no attribute {name!r}")
