"""The router of :mod:`groupmm.moe` (whose names these are): :class:`TopKRouter`, a linear
gate with softmax and top-k selection, its :class:`RouterOutput`, and the
load-balancing loss it adds (:func:`load_balancing_loss`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from . import _checks as check
from ._rows import topk_ids, topk_ids_applies


class RouterOutput(NamedTuple):
    """What :class:`TopKRouter` returns."""

    weights: torch.Tensor
    """``[T, k]`` gate weight of each chosen expert, in the input's dtype."""
    expert_ids: torch.Tensor
    """``[T, k]`` int64 ids of the chosen experts, best first."""
    probs: torch.Tensor
    """``[T, E]`` router softmax over all experts (float32 or wider)."""
    aux_loss: torch.Tensor
    """Scalar load-balancing loss, already scaled by ``aux_loss_coef`` (zero if 0)."""


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the ``T*k`` assignments routed to expert ``e`` (not
    differentiable) and ``P_e`` the mean router probability of ``e``. It equals 1 when
    routing is perfectly uniform and grows as routing concentrates.

    Args:
        probs: ``[T, E]`` router probabilities.
        expert_ids: ``[T, k]`` chosen experts.
    """
    num_experts = probs.shape[-1]
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, device=probs.device, dtype=probs.dtype)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=probs.dtype))
    frac = counts / max(flat.numel(), 1)
    mean_prob = probs.sum(dim=0) / max(probs.shape[0], 1)  # no NaN for zero tokens
    return num_experts * (frac * mean_prob).sum()


def top_k_ids(probs: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]`` int64 ids of each row's ``k`` largest router probabilities, best first:
    ``_rows.topk_ids`` where it applies (``_rows.topk_ids_applies``: CPU, or CUDA with at
    most ``_rows.TOPK_CUDA_MAX_COLS`` experts), else ``torch.topk``'s indices (the same on
    rows without ties; the native op breaks ties to the lower id). Ids carry no gradient:
    the op reads ``probs`` detached."""
    if topk_ids_applies(probs):
        return topk_ids(probs.detach(), k)
    return probs.topk(k, dim=-1).indices


class TakeChosen(torch.autograd.Function):
    """``probs.gather(-1, ids)``: the probabilities of the chosen experts. Backward:
    ``grad`` scattered into zeros at ``ids`` (ids distinct in each row), what
    ``torch.topk``'s values had, instead of ``gather``'s ``scatter_add`` (atomic adds on
    GPU). Twice differentiable: the backward is built from differentiable ops."""

    @staticmethod
    def forward(ctx: Any, probs, ids):
        ctx.save_for_backward(ids)
        ctx.shape = probs.shape
        return probs.gather(-1, ids)

    @staticmethod
    def backward(ctx: Any, grad):
        (ids,) = ctx.saved_tensors
        return grad.new_zeros(ctx.shape).scatter(-1, ids, grad), None


class TopKRouter(nn.Module):
    """Linear gate, softmax over experts, top-k selection.

    Args:
        d_model: token width.
        num_experts: number of experts ``E``.
        top_k: experts per token (``1 <= top_k <= num_experts``).
        normalize: renormalise the ``k`` chosen probabilities to sum to 1. Default
            ``None`` means ``top_k > 1`` (Mixtral style); for ``top_k == 1`` it would make
            every weight 1 and cut the router off from the task loss (Switch keeps the
            raw probability).
        aux_loss_coef: scale of the load-balancing loss (0 turns it off).
        device, dtype: factory arguments for the gate weight.

    The softmax runs in at least float32 even for 16-bit inputs; the returned weights
    are cast back to the input's dtype. The top-k ids come from groupmm's own row op
    (``_rows.topk_ids``: one warp per row on CUDA, rows up to
    ``_rows.TOPK_CUDA_MAX_COLS`` experts) and ``torch.topk`` elsewhere; the weights are
    gathered from ``probs`` at those ids (:class:`TakeChosen`), so their gradient reaches
    the gate as ``torch.topk``'s values' did.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        normalize: bool | None = None,
        aux_loss_coef: float = 0.01,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # constructor arguments: nothing native sees them
        self.d_model = check.positive_int("d_model", d_model)
        self.num_experts = check.positive_int("num_experts", num_experts)
        self.top_k = check.positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts={num_experts}, found {top_k}")
        self.aux_loss_coef = check.non_negative_float("aux_loss_coef", aux_loss_coef)
        self.normalize = top_k > 1 if normalize is None else bool(normalize)
        self.gate = nn.Linear(d_model, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x`` of shape ``[T, d_model]``."""
        # the router's contract, in its names (nn.Linear's own error names no argument)
        check.tensor("x", x)
        d_model = self.d_model
        check.shape("x", x, x.dim() == 2 and x.shape[1] == d_model, "[T, d_model={}]", d_model)
        logits = self.gate(x)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        probs = logits.to(compute_dtype).softmax(dim=-1)
        expert_ids = top_k_ids(probs, self.top_k)
        top_p = TakeChosen.apply(probs, expert_ids)
        if self.normalize:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        if self.aux_loss_coef > 0:
            aux = self.aux_loss_coef * load_balancing_loss(probs, expert_ids)
        else:
            aux = probs.new_zeros(())
        return RouterOutput(top_p.to(x.dtype), expert_ids, probs, aux)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"normalize={self.normalize}, aux_loss_coef={self.aux_loss_coef}"
        )
