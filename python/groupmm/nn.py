"""``torch.nn`` modules built on :func:`groupmm.grouped_mm`.

:class:`GroupedExperts` holds the weights of every expert of a Mixture-of-Experts
feed-forward block stacked in a few tensors and runs all experts with one grouped
matrix multiply per projection, on tokens that are already sorted by expert (see
:func:`groupmm.moe.permute`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import _checks as check
from ._api import grouped_mm
from ._glue import swiglu

__all__ = ["ACTIVATIONS", "GroupedExperts"]

#: Activations understood by :class:`GroupedExperts`.
ACTIVATIONS = ("swiglu", "gelu", "relu")


class GroupedExperts(nn.Module):
    """The feed-forward networks of ``num_experts`` experts, run with grouped GEMMs.

    Each expert ``e`` computes, for its rows ``x`` of shape ``[n_e, d_model]``:

    - ``"swiglu"``: ``(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_out[e]``
    - ``"gelu"`` / ``"relu"``: ``act(x @ w_in[e]) @ w_out[e]``

    (plus ``b_in[e]`` / ``b_out[e]`` after each projection when ``bias=True``).

    Weights are stored stacked, input-major, so they feed :func:`grouped_mm` as they are:

    - ``w_in``: ``[E, d_model, d_ff]``, or ``[E, d_model, 2 * d_ff]`` for ``"swiglu"``
      where columns ``[:d_ff]`` are the gate projection and ``[d_ff:]`` the up
      projection (fused, so one grouped GEMM computes both);
    - ``w_out``: ``[E, d_ff, d_model]``;
    - ``b_in``: ``[E, w_in.shape[-1]]`` and ``b_out``: ``[E, d_model]`` when ``bias=True``.

    Expert ``e``'s projection equals an ``nn.Linear`` whose ``weight`` is
    ``w_in[e].T``. Initialisation matches ``nn.Linear`` per expert: weights and
    biases uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]``, ``fan_in = d_model`` for
    the input projection and ``d_ff`` for the output projection.

    Args:
        num_experts: number of experts ``E``.
        d_model: model (token) width.
        d_ff: hidden width of each expert.
        activation: ``"swiglu"`` (default), ``"gelu"`` or ``"relu"``.
        bias: add a per-expert bias after each projection.
        device, dtype: factory arguments for the parameters (any floating dtype).
    """

    w_in: nn.Parameter
    w_out: nn.Parameter
    b_in: nn.Parameter | None
    b_out: nn.Parameter | None

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_ff: int,
        activation: str = "swiglu",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # constructor arguments: nothing native sees them
        self.num_experts = check.positive_int("num_experts", num_experts)
        self.d_model = check.positive_int("d_model", d_model)
        self.d_ff = check.positive_int("d_ff", d_ff)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, found {activation!r}")
        if not isinstance(bias, bool):
            raise TypeError(f"bias: expected a bool, found {bias!r}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype: expected a floating torch.dtype or None, found {dtype!r}")
        self.activation = activation
        n_in = 2 * d_ff if activation == "swiglu" else d_ff
        dev, dt = device, dtype
        self.w_in = nn.Parameter(torch.empty(num_experts, d_model, n_in, device=dev, dtype=dt))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_ff, d_model, device=dev, dtype=dt))
        if bias:
            self.b_in = nn.Parameter(torch.empty(num_experts, n_in, device=dev, dtype=dt))
            self.b_out = nn.Parameter(torch.empty(num_experts, d_model, device=dev, dtype=dt))
        else:
            self.register_parameter("b_in", None)
            self.register_parameter("b_out", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise every expert like ``nn.Linear`` (uniform, bound ``1/sqrt(fan_in)``)."""
        bound_in = 1.0 / math.sqrt(self.d_model)
        bound_out = 1.0 / math.sqrt(self.d_ff)
        with torch.no_grad():
            self.w_in.uniform_(-bound_in, bound_in)
            self.w_out.uniform_(-bound_out, bound_out)
            if self.b_in is not None and self.b_out is not None:
                self.b_in.uniform_(-bound_in, bound_in)
                self.b_out.uniform_(-bound_out, bound_out)

    @staticmethod
    def _add_bias(h: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        # Expert id of every row, on the device (no host sync). Rows past offs[-1]
        # get id E, which indexes an appended zero row, so they stay zero.
        rows = torch.arange(h.shape[0], device=h.device, dtype=offs.dtype)
        expert_of_row = torch.searchsorted(offs, rows, right=True)
        b = torch.cat([b, b.new_zeros(1, b.shape[1])])
        return h + b[expert_of_row].to(h.dtype)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Run every expert on its rows.

        Args:
            x: ``[T, d_model]`` tokens sorted by expert.
            offs: int32 ``[num_experts]``, cumulative end row of each expert
                (expert ``e`` owns rows ``offs[e-1]:offs[e]``), on ``x``'s device.

        Returns:
            ``[T, d_model]``; rows past ``offs[-1]`` are zero (without bias, also any
            all-zero padding rows inside a group).
        """
        # the module's contract in its own names (the native rule would name a and b),
        # checked before the first product: under torch.compile its fake checks no dtype
        check.tensor("x", x)
        check.tensor("offs", offs)
        d_model, num_experts = self.d_model, self.num_experts
        check.shape("x", x, x.dim() == 2 and x.shape[1] == d_model, "[T, d_model={}]", d_model)
        ok = offs.dim() == 1 and offs.shape[0] == num_experts
        check.shape("offs", offs, ok, "[num_experts={}]", num_experts)
        check.dtype("offs", offs, torch.int32)
        check.dtype("x", x, self.w_in.dtype, "the expert weights")
        check.device("x", x, self.w_in.device, "the expert weights")
        h = grouped_mm(x, self.w_in, offs=offs)
        if self.b_in is not None:
            h = self._add_bias(h, self.b_in, offs)
        if self.activation == "swiglu":
            h = swiglu(h)
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        out = grouped_mm(h, self.w_out, offs=offs)
        if self.b_out is not None:
            out = self._add_bias(out, self.b_out, offs)
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_model={self.d_model}, d_ff={self.d_ff}, "
            f"activation={self.activation!r}, bias={self.b_in is not None}"
        )
