"""Mixture-of-Experts routing helpers and a complete MoE layer on :func:`groupmm.grouped_mm`.

The pipeline of one MoE feed-forward block::

    router = TopKRouter(d_model, num_experts, top_k)
    experts = GroupedExperts(num_experts, d_model, d_ff)

    r = router(x)                                           # weights, expert_ids [T, k]
    p = permute(x, r.expert_ids, num_experts, pad_to=None)  # expert-sorted rows + offs
    y = experts(p.tokens, p.offs)                           # grouped GEMMs
    out = unpermute(y, p.inverse, r.weights)                # weighted sum of the top-k

:class:`MoELayer` wraps exactly that.

Nothing here synchronises with the host: token counts, offsets and the permutation are
computed on the device with ``argsort`` (stable), ``searchsorted`` and ``cumsum``; shapes
depend only on ``T``, ``top_k``, ``num_experts`` and ``pad_to``, never on the routing, so
the layer runs under ``torch.compile(fullgraph=True)`` and inside CUDA graphs.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import nn

from . import _rows
from .nn import GroupedExperts, _check_positive_int, _check_tensor

__all__ = [
    "MoELayer",
    "Permuted",
    "RouterOutput",
    "TopKRouter",
    "load_balancing_loss",
    "permute",
    "unpermute",
]


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


class Permuted(NamedTuple):
    """What :func:`permute` returns."""

    tokens: torch.Tensor
    """``[R, D]`` rows sorted by expert; ``R = T*k`` (no padding) or
    ``T*k + E*(pad_to-1)`` (padding); padding rows are zero."""
    offs: torch.Tensor
    """int32 ``[E]`` cumulative end row of each expert's group in ``tokens``."""
    inverse: torch.Tensor
    """int64 ``[T, k]``: row of ``tokens`` that holds assignment ``(t, j)``."""
    counts: torch.Tensor
    """int64 ``[E]`` number of assignments per expert (before padding)."""


def _is_integer(dtype: torch.dtype) -> bool:
    """Index dtypes: integers, not bool."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


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
    are cast back to the input's dtype.
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
        self.d_model = _check_positive_int("d_model", d_model)
        self.num_experts = _check_positive_int("num_experts", num_experts)
        self.top_k = _check_positive_int("top_k", top_k)
        if top_k > num_experts:
            raise ValueError(f"top_k: expected at most num_experts={num_experts}, found {top_k}")
        if isinstance(aux_loss_coef, bool) or not isinstance(aux_loss_coef, numbers.Real):
            raise TypeError(f"aux_loss_coef: expected a float >= 0, found {aux_loss_coef!r}")
        if not aux_loss_coef >= 0:  # also refuses NaN
            raise ValueError(f"aux_loss_coef: expected a float >= 0, found {aux_loss_coef}")
        self.normalize = top_k > 1 if normalize is None else bool(normalize)
        self.aux_loss_coef = float(aux_loss_coef)
        self.gate = nn.Linear(d_model, num_experts, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x`` of shape ``[T, d_model]``."""
        _check_tensor("x", x)
        if x.dim() != 2 or x.shape[1] != self.d_model:
            raise ValueError(
                f"x: expected shape [T, d_model={self.d_model}], found {list(x.shape)}"
            )
        logits = self.gate(x)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        probs = logits.to(compute_dtype).softmax(dim=-1)
        top_p, expert_ids = probs.topk(self.top_k, dim=-1)
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


def permute(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    pad_to: int | None = None,
) -> Permuted:
    """Sort token copies by expert for :func:`grouped_mm`, on the device, without host sync.

    Token ``t`` is copied once for each of its ``k`` experts. Copies are ordered by
    expert (stable, so within an expert by token, then by slot).

    How (all on ``tokens``' device, fixed output shapes): ``argsort(stable=True)`` of the
    flattened expert ids gives the order; ``searchsorted`` of the sorted ids against
    ``arange(E)`` gives each expert's end row, i.e. ``offs``; no ``.item()``,
    ``.tolist()``, ``nonzero`` or ``bincount``.

    Args:
        tokens: ``[T, D]``.
        expert_ids: ``[T, k]`` (or ``[T]`` for ``k = 1``) integer expert ids in
            ``[0, num_experts)``. Ids outside that range are not checked (checking
            would need a host sync) and give wrong results.
        num_experts: ``E``.
        pad_to: if given, every group's length is rounded up to a multiple of it
            (e.g. 8, 16, 128) with zero rows, for kernels that prefer aligned groups.
            The output then has the static upper bound ``T*k + E*(pad_to-1)`` rows;
            rows past ``offs[-1]`` are zero too.

    Returns:
        :class:`Permuted` ``(tokens, offs, inverse, counts)``; pass ``inverse`` to
        :func:`unpermute`.
    """
    _check_tensor("tokens", tokens)
    _check_tensor("expert_ids", expert_ids)
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected shape [T, D], found {list(tokens.shape)}")
    _check_positive_int("num_experts", num_experts)
    if pad_to is not None:
        _check_positive_int("pad_to", pad_to)
    if expert_ids.dim() == 1:
        expert_ids = expert_ids.unsqueeze(1)
    if expert_ids.dim() != 2 or expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"expert_ids: expected shape [T={tokens.shape[0]}, k] or [T], "
            f"found {list(expert_ids.shape)}"
        )
    if not _is_integer(expert_ids.dtype):
        raise TypeError(f"expert_ids: expected an integer dtype, found {expert_ids.dtype}")
    if expert_ids.device != tokens.device:
        raise RuntimeError(
            f"expert_ids: expected a tensor on {tokens.device} (the device of tokens), "
            f"found one on {expert_ids.device}"
        )
    r = _routes(expert_ids, num_experts, pad_to)
    sorted_tokens = _Dispatch.apply(tokens, r.src, r.dest, r.inverse, r.capacity)
    return Permuted(sorted_tokens, r.offs, r.inverse, r.counts)


class _Routes(NamedTuple):
    src: torch.Tensor  # int64 [T*k]: token of each sorted assignment
    dest: torch.Tensor  # int64 [T*k]: its row (differs from arange only with padding)
    inverse: torch.Tensor  # int64 [T, k]: row of assignment (t, j)
    offs: torch.Tensor  # int32 [E]: group ends
    counts: torch.Tensor  # int64 [E]: assignments per expert
    capacity: int | None  # rows with padding, None without


def _routes(expert_ids: torch.Tensor, num_experts: int, pad_to: int | None) -> _Routes:
    """The index side of :func:`permute` (no token data moves): on the device, no sync."""
    num_tokens, top_k = expert_ids.shape
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # sorted position -> assignment index
    sorted_ids = flat[order]
    experts = torch.arange(num_experts, device=device, dtype=torch.long)
    ends = torch.searchsorted(sorted_ids, experts, right=True)  # int64 [E]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    src = order // top_k  # row i = token of the i-th sorted assignment
    n = flat.numel()
    if pad_to is None or pad_to == 1:
        dest = torch.arange(n, device=device)
        offs = ends
        capacity = None
    else:
        padded = (counts + pad_to - 1) // pad_to * pad_to
        offs = torch.cumsum(padded, dim=0)
        starts = ends - counts
        padded_starts = offs - padded
        # sorted position i of expert e lands at padded_starts[e] + (i - starts[e]).
        dest = torch.arange(n, device=device) + (padded_starts - starts)[sorted_ids]
        capacity = n + num_experts * (pad_to - 1)
    inverse = torch.empty_like(dest).scatter(0, order, dest).view(num_tokens, top_k)
    return _Routes(src, dest, inverse, offs.to(torch.int32), counts, capacity)


def sum_copies(grad: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j grad[inverse[t, j]]``: each token's ``k`` rows summed in fp32 or
    wider (deterministic, no atomics, no ``[T*k, D]`` temporary). The backward of a row
    gather by token: one pass (``_rows.gather_sum``), or, while autograd records a graph
    through ``grad`` (double backward), ``k`` differentiable gathers."""
    if not _rows.differentiable(grad):
        return _rows.gather_sum(grad, inverse, None)
    acc = torch.promote_types(grad.dtype, torch.float32)
    out = grad.index_select(0, inverse[:, 0]).to(acc)
    for j in range(1, inverse.shape[1]):
        out = out + grad.index_select(0, inverse[:, j])
    return out.to(grad.dtype)


def combine(y: torch.Tensor, inverse: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j w[t, j] * y[inverse[t, j]]`` (a plain sum without ``w``), summed in
    fp32: one pass (``_rows.gather_sum``), or, while autograd records a graph through
    ``y`` or ``w``, a gather and a batched ``[1, k] x [k, D]`` product. Its backward is
    :func:`combine_backward`."""
    if not _rows.differentiable(y, w):
        return _rows.gather_sum(y, inverse, w)
    num_tokens, top_k = inverse.shape
    rows = y.index_select(0, inverse.reshape(-1)).view(num_tokens, top_k, y.shape[1])
    if w is None:
        return rows.sum(dim=1)
    return torch.bmm(w.to(y.dtype).unsqueeze(1), rows).squeeze(1)


def combine_backward(grad, y, inverse, w, need_y: bool, need_w: bool):
    """``(grad_y, grad_w)`` of :func:`combine`, each None unless asked for, deterministic:
    ``grad_w[t, j] = <grad[t], y[inverse[t, j]]>`` and ``grad_y[inverse[t, j]] = w[t, j]
    * grad[t]`` (rows no assignment names, i.e. padding, zero). One pass each
    (``_rows.row_dots``, ``_rows.scatter_rows``); while autograd records a graph through
    the inputs (double backward), differentiable ops with one ``[R, D]`` temporary at a
    time: a gather and a batched product, then one gather of ``grad`` by each row's token
    scaled in place by the row's weight."""
    if not _rows.differentiable(grad, y, w):
        dw = _rows.row_dots(grad, y, inverse, w.dtype) if w is not None and need_w else None
        dy = _rows.scatter_rows(grad, inverse, w, y.shape[0]) if need_y else None
        return dy, dw
    num_tokens, top_k = inverse.shape
    flat = inverse.reshape(-1)
    dy = dw = None
    if w is not None and need_w:
        rows = y.index_select(0, flat).view(num_tokens, top_k, y.shape[1])
        dw = torch.bmm(rows, grad.to(y.dtype).unsqueeze(2)).squeeze(2).to(w.dtype)
        del rows
    if need_y:
        n, rows_y = flat.numel(), y.shape[0]
        if n == 0:  # no tokens: only padding rows
            return grad.new_zeros(y.shape), dw
        # assignment of each row (the inverse permutation); padding rows: n, weight 0
        ids = torch.arange(n, device=flat.device)
        assign = flat.new_full((rows_y,), n).scatter_(0, flat, ids)
        scale = None if w is None else w.reshape(-1).to(grad.dtype)
        if rows_y != n:
            base = grad.new_ones(n) if scale is None else scale
            scale = torch.cat([base, base.new_zeros(1)]).index_select(0, assign)
            assign = assign.clamp(max=n - 1)
        elif scale is not None:
            scale = scale.index_select(0, assign)
        dy = grad.index_select(0, torch.div(assign, top_k, rounding_mode="floor"))
        if scale is not None:
            dy.mul_(scale.unsqueeze(1))  # in place: index_select keeps no output
    return dy, dw


class _Dispatch(torch.autograd.Function):
    """``rows[dest[i]] = tokens[src[i]]``: token copies in expert order (zero rows where
    padding leaves gaps). Backward: ``grad_tokens[t] = sum_j grad[inverse[t, j]]``, ``k``
    gathers of ``[T, D]`` summed in float32 or wider, deterministic, instead of autograd's
    ``index_put(accumulate=True)`` (which sorts the indices and adds atomically); no
    ``[T*k, D]`` temporary."""

    @staticmethod
    def forward(ctx, tokens, src, dest, inverse, capacity):
        ctx.save_for_backward(inverse)
        rows = tokens.index_select(0, src)
        if capacity is None:
            return rows
        return rows.new_zeros(capacity, tokens.shape[1]).index_copy_(0, dest, rows)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return sum_copies(grad, inverse), None, None, None, None


class _Combine(torch.autograd.Function):
    """:func:`combine` with :func:`combine_backward` as its backward (no ``index_put``)."""

    @staticmethod
    def forward(ctx, y, inverse, w):
        ctx.save_for_backward(y, inverse, w)
        return combine(y, inverse, w)

    @staticmethod
    def backward(ctx, grad):
        y, inverse, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        dy, dw = combine_backward(grad, y, inverse, w, need[0], w is not None and need[2])
        return dy, None, dw


def unpermute(
    expert_out: torch.Tensor,
    inverse: torch.Tensor,
    gate_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each token's ``k`` expert outputs and combine them.

    Args:
        expert_out: ``[R, D]`` rows in the order :func:`permute` produced.
        inverse: ``[T, k]`` from :func:`permute`.
        gate_weights: ``[T, k]`` weights; ``None`` sums the ``k`` outputs unweighted.

    Returns:
        ``[T, D]``: ``sum_j gate_weights[t, j] * expert_out[inverse[t, j]]``, in
        ``expert_out``'s dtype.
    """
    _check_tensor("expert_out", expert_out)
    _check_tensor("inverse", inverse)
    if expert_out.dim() != 2:
        raise ValueError(f"expert_out: expected shape [R, D], found {list(expert_out.shape)}")
    if inverse.dim() == 1:
        inverse = inverse.unsqueeze(1)
    if inverse.dim() != 2:
        raise ValueError(f"inverse: expected shape [T, k] or [T], found {list(inverse.shape)}")
    if not _is_integer(inverse.dtype):
        raise TypeError(f"inverse: expected an integer dtype, found {inverse.dtype}")
    if inverse.device != expert_out.device:
        raise RuntimeError(
            f"inverse: expected a tensor on {expert_out.device} (the device of expert_out), "
            f"found one on {inverse.device}"
        )
    if gate_weights is None:
        return _Combine.apply(expert_out, inverse, None)
    _check_tensor("gate_weights", gate_weights)
    if gate_weights.dim() == 1:
        gate_weights = gate_weights.unsqueeze(1)
    if gate_weights.shape != inverse.shape:
        raise ValueError(
            f"gate_weights: expected shape {list(inverse.shape)} (the shape of inverse), "
            f"found {list(gate_weights.shape)}"
        )
    return _Combine.apply(expert_out, inverse, gate_weights)


class MoELayer(nn.Module):
    """A complete MoE feed-forward layer: router, permute, grouped experts, unpermute.

    ``forward(x)`` takes ``[..., d_model]`` and returns the same shape. The
    load-balancing loss of the last forward is kept in ``self.aux_loss`` (add it to the
    training loss); ``forward(x, return_aux_loss=True)`` returns ``(out, aux_loss)``
    instead, which is the form to use under ``torch.compile``.

    Args:
        d_model, d_ff, num_experts, top_k: sizes.
        activation: expert activation, see :class:`~groupmm.nn.GroupedExperts`.
        bias: per-expert biases.
        normalize: renormalise top-k weights, see :class:`TopKRouter`.
        aux_loss_coef: load-balancing loss scale (0 turns it off).
        pad_to: pad each expert group to a multiple of this (see :func:`permute`).
        fused: run the experts as :func:`groupmm.fused.expert_up` and
            :func:`groupmm.fused.expert_down` (gather, up projection and SwiGLU as one
            operation; down projection, router weights and combine as another; their
            glue in one-pass row kernels): needs ``activation="swiglu"``,
            ``bias=False`` and no ``pad_to``. Same results to rounding, less activation
            memory, faster on every measured configuration (README, "Whole MoE
            layers"). ``None`` (default): fused whenever the layer allows it;
            ``False``: the unfused path (permute, :class:`~groupmm.nn.GroupedExperts`,
            unpermute).
        device, dtype: factory arguments.
    """

    aux_loss: torch.Tensor | None

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        top_k: int,
        activation: str = "swiglu",
        bias: bool = False,
        normalize: bool | None = None,
        aux_loss_coef: float = 0.01,
        pad_to: int | None = None,
        fused: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if pad_to is not None:
            _check_positive_int("pad_to", pad_to)
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused: expected a bool or None, found {fused!r}")
        fusable = activation == "swiglu" and not bias and pad_to in (None, 1)
        if fused is None:
            fused = fusable
        if fused and not fusable:
            raise ValueError(
                "fused: needs activation='swiglu', bias=False and pad_to=None, found "
                f"activation={activation!r}, bias={bias}, pad_to={pad_to}"
            )
        self.pad_to = pad_to
        self.fused = fused
        self.router = TopKRouter(
            d_model,
            num_experts,
            top_k,
            normalize,
            aux_loss_coef,
            device=device,
            dtype=dtype,
        )
        self.experts = GroupedExperts(
            num_experts, d_model, d_ff, activation, bias, device=device, dtype=dtype
        )
        self.aux_loss = None

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def forward(
        self, x: torch.Tensor, return_aux_loss: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Apply the layer to ``x`` of shape ``[..., d_model]``."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        route = self.router(flat)
        if self.fused:
            from .fused import expert_down, expert_up

            r = _routes(route.expert_ids, self.num_experts, None)
            ex = self.experts
            h = expert_up(flat, ex.w_in, r.offs, r.src, r.inverse)
            out = expert_down(h, ex.w_out, r.offs, r.inverse, route.weights).view(shape)
        else:
            p = permute(flat, route.expert_ids, self.num_experts, self.pad_to)
            y = self.experts(p.tokens, p.offs)
            out = unpermute(y, p.inverse, route.weights).view(shape)
        if return_aux_loss:
            return out, route.aux_loss
        self.aux_loss = route.aux_loss
        return out
