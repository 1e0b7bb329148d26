"""The routed SwiGLU expert block as custom ops, so that the glue around the grouped
GEMMs has one place to be fused into them:

- :func:`expert_block`: the whole block, ``out[t] = sum_j weights[t, j] * y[inverse[t,
  j]]`` with ``y = act @ w_out[g]`` and ``act = silu(x[src] @ w_gate[g]) * (x[src] @
  w_up[g])`` per expert group ``g`` (gather, up projection, SwiGLU, down projection,
  router weights, top-k combine): what :class:`groupmm.moe.MoELayer` and the transformers
  and torchtitan integrations run;
- :func:`expert_up`: its up half, ``act`` (gather, up projection, SwiGLU);
- :func:`expert_down`: its down half, ``out`` from ``act`` (down projection, router
  weights, combine);
- the products with one fused epilogue each, ``groupmm._epilogue_ops``'s ``__all__``
  (e.g. a per-row scale of the product), re-exported here whole.

:func:`expert_block` is two ``torch.library`` custom ops with fakes and autograd formulas
(``swiglu_up`` and ``gated_down`` in ``groupmm._fused_ops``, their backward's arithmetic
in ``groupmm._fused_backward``; the halves' ops in ``groupmm._fused_halves``), so
``torch.compile(fullgraph=True)``, ``opcheck`` and double backward work on CPU and CUDA;
eager calls on plain tensors run the ops' ``autograd.Function`` twins (the same forward,
saved tensors and backward, without the custom-op dispatch). What each op launches, and
where it composes plain products and row ops instead (no fused kernel, or autograd
recording a graph): ARCHITECTURE.md, "The fused MoE layer".

Memory: nothing of size ``[R, D]`` or ``[R, F]`` (``R = T*k``) is kept for the backward
(``swiglu_up`` saves ``x``, ``w_in`` and the indices; ``gated_down`` saves ``pre``,
``w_out``, the indices and the router weights); the backward holds at most ``pre`` (or
``d_pre`` written over it), ``dy``, ``act_s`` and ``dw_out`` at once, then ``d_pre``,
``dw_out``, ``dx`` and one ``[R, D]`` product or slab (measured peaks:
``docs/performance.md``). Determinism: no atomics; the gradient of ``x`` sums each
token's ``k`` rows through ``inverse``.
"""

# NB: no ``from __future__ import annotations``: torch.library reads the annotations.
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _checks as check
from . import _epilogue_ops
from ._epilogue_ops import *  # noqa: F403 (its __all__: the epilogues' public ops)
from ._fused_halves import _expert_down, _expert_up
from ._fused_ops import _gated_down, _GatedDownFn, _swiglu_up, _SwigluUpFn
from ._glue import swiglu_grad
from ._library import direct

__all__ = ["expert_block", "expert_down", "expert_up", "swiglu_grad"]
__all__ += _epilogue_ops.__all__


# --------------------------------------------------------------------------- checks


#: ``w_in`` of the block: ``[E, D, 2F]`` (gate ``[:F]``, up ``[F:]``), or the pair
#: ``(gate, up)`` of two ``[E, D, F]`` weights (torchtitan's ``w1``/``w3``, Mixtral-style
#: ``gate_proj``/``up_proj`` checkpoints), read as they are: never concatenated
GateUp = Union[Tensor, Tuple[Tensor, Tensor]]


def gate_up(w_in: GateUp) -> Tuple[Tensor, Optional[Tensor]]:
    """``(w, up)``: ``(w_in, None)`` for one ``[E, D, 2F]`` weight, ``(gate, up)`` for a
    pair. Checks the ranks and the pair's agreement (names ``w_in[0]``, ``w_in[1]``)."""
    if isinstance(w_in, (tuple, list)):
        if len(w_in) != 2:
            raise ValueError(f"w_in: expected a pair (gate, up), found {len(w_in)} tensors")
        gate, up = w_in
        check.dims("w_in[0]", gate, 3, "[E, D, F] (the gate)")
        check.dims("w_in[1]", up, 3, "[E, D, F] (the up projection)")
        check.same_shape("w_in[1]", up, "w_in[0]", gate)
        check.dtype("w_in[1]", up, gate.dtype, "w_in[0]")
        check.device("w_in[1]", up, gate.device, "w_in[0]")
        return gate, up
    check.dims("w_in", w_in, 3, "[E, D, 2F] (or a pair of [E, D, F])")
    _check_gate_up("w_in", w_in)
    return w_in, None


def _width(w: Tensor, up: Optional[Tensor]) -> int:
    """``F``: the SwiGLU's width."""
    return w.shape[2] if up is not None else w.shape[2] // 2


def _check_experts(x: Tensor, w_in: GateUp, w_out: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """The ranks of ``x``, ``w_in`` and ``w_out`` and ``w_in``'s even width (or pair):
    :func:`gate_up` of ``w_in``."""
    check.dims("x", x, 2, "[T, D]")
    w, up = gate_up(w_in)
    check.dims("w_out", w_out, 3, "[E, F, D]")
    return w, up


def _check_expert_count(
    x: Tensor,
    w: Tensor,
    up: Optional[Tensor],
    w_out: Tensor,
    experts: int,
    x_name: str = "x",
    experts_of: str = "offs",
) -> None:
    """``w_in [E, D, 2F]`` (or ``w`` and ``up``, ``[E, D, F]`` each) and ``w_out [E, F,
    D]`` with ``E = experts`` (the length of ``experts_of``) and ``D`` the width of ``x``
    (called ``x_name``), in ``x``'s dtype and on its device (checked here, so that the
    native rules never name them "w" and "b")."""
    width = x.shape[1]
    name = "w_in" if up is None else "w_in[0]"
    ok = w.shape[0] == experts and w.shape[1] == width
    what = "[E={}, D={}, {}] (E = len({}), D = {}.shape[1])"
    check.shape(name, w, ok, what, experts, width, "2F" if up is None else "F", experts_of, x_name)
    f = _width(w, up)
    ok = w_out.shape == (experts, f, width)
    what = "[E={}, F={}, D={}] (E = len({}), F from w_in, D = {}.shape[1])"
    check.shape("w_out", w_out, ok, what, experts, f, width, experts_of, x_name)
    for n, t in ((name, w), ("w_out", w_out)):
        check.dtype(n, t, x.dtype, x_name)
        check.device(n, t, x.device, x_name)


def _check_routes(x: Tensor, offs: Tensor, src: Tensor, inverse: Tensor) -> None:
    """``offs [E]``, ``src [R]``, ``inverse [T, k]`` with ``T`` the rows of ``x`` and
    ``T*k = R`` (every routed row named once)."""
    check.index("offs", offs, 1, "[E]")
    check.index("src", src, 1, "[R]")
    check.index("inverse", inverse, 2, "[T, k]")
    ok = inverse.shape[0] == x.shape[0] and inverse.numel() == src.shape[0]
    what = "[T={}, k] with T*k = R = {} (the length of src)"
    check.shape("inverse", inverse, ok, what, x.shape[0], src.shape[0])


def _int32(index: Tensor) -> Tensor:
    """``index`` as int32, the form every kernel reads, made once per block call (the ops
    and their backwards then hand it to each native call as it is, instead of each call
    converting an int64 index again)."""
    return index if index.dtype == torch.int32 else index.to(torch.int32)


def _check_gate_up(name: str, w: Tensor) -> None:
    if w.shape[-1] % 2:
        raise ValueError(
            f"{name}: expected an even last dimension [gate | up], found {list(w.shape)}"
        )


# --------------------------------------------------------------------------- expert_block


def expert_block(
    x: Tensor,
    w_in: GateUp,
    w_out: Tensor,
    offs: Tensor,
    src: Tensor,
    inverse: Tensor,
    weights: Optional[Tensor] = None,
) -> Tensor:
    """A whole routed SwiGLU expert block: ``out[t] = sum_j weights[t, j] * y[inverse[t,
    j]]`` with ``y[r] = act[r] @ w_out[g]``, ``act[r] = silu(a[r] @ w_gate[g]) * (a[r] @
    w_up[g])`` and ``a[r] = x[src[r]]``, for the rows ``r`` of each group ``g``.

    Args:
        x: ``[T, D]`` tokens, in token order (never copied into expert order).
        w_in: ``[E, D, 2F]``, columns ``[:F]`` the gate and ``[F:]`` the up projection
            (:class:`groupmm.nn.GroupedExperts`' ``w_in``; any strides), or the pair
            ``(w_gate, w_up)`` of two ``[E, D, F]`` weights (any strides; e.g.
            torchtitan's ``(w1.transpose(1, 2), w3.transpose(1, 2))``), read in place
            and given a gradient each: no concatenated copy.
        w_out: ``[E, F, D]`` (``GroupedExperts``' ``w_out``; any strides).
        offs: int32 ``[E]`` group ends over the ``R`` routed rows.
        src: integer ``[R]``, the token of each row (``x`` row ``src[r]``).
        inverse: integer ``[T, k]``, the row of each token's ``j``-th copy (every row
            named once: ``R = T*k``).
        weights: ``[T, k]`` router weights (differentiable), or None for a plain sum.

    Returns:
        ``[T, D]`` in ``x``'s dtype, in token order. Rows past ``offs[-1]`` (e.g.
        expert-parallel placeholders) contribute nothing.

    Two ops, ``torch.ops.groupmm.swiglu_up`` then ``gated_down``; what runs and what the
    backward keeps: the module docstring. :func:`groupmm._glue.routes` gives
    ``offs``/``src``/``inverse`` (``MoELayer`` calls this). An index out of range is an
    error: at once on the CPU, at the device's next call on CUDA (no host sync); it is
    never read.
    """
    # before the ops: their fakes (torch.compile) check nothing, the indices are converted
    # to int32 before the native calls, only the backward reads some operands, and the
    # GEMMs would name w_in and w_out "w" and "b"
    w, up = _check_experts(x, w_in, w_out)
    _check_routes(x, offs, src, inverse)
    _check_expert_count(x, w, up, w_out, offs.shape[0])
    if weights is not None:
        check.tensor("weights", weights)
        check.same_shape("weights", weights, "inverse", inverse)
    return _block(x, w, w_out, offs, _int32(src), _int32(inverse), weights, up)


def _block(
    x: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    offs: Tensor,
    src: Optional[Tensor],
    inverse: Optional[Tensor],
    weights: Optional[Tensor],
    up: Optional[Tensor] = None,
) -> Tensor:
    """The two ops of :func:`expert_block` on checked arguments (int32 indices; ``w_in``
    the gate ``[E, D, F]`` when ``up`` is given, else ``[E, D, 2F]``). Also
    what :func:`groupmm.parallel.expert_compute` runs on rows already in expert order:
    ``src`` None (``x``'s rows are the routed rows: no gather, ``dy = d_out``) with
    ``inverse`` None (the output is the rows ``y`` themselves: no combine, no
    ``weights``) or ``arange(R)`` as ``[R, 1]`` (each row scaled by its weight)."""
    # pre is the block's own: gated_down's backward may write its gradient over it
    if direct(x, w_in, w_out, offs, src, inverse, weights, up):
        pre, act = _SwigluUpFn.apply(x, w_in, offs, src, inverse, up)
        return _GatedDownFn.apply(pre, act, w_out, offs, src, inverse, weights, True)
    pre, act = _swiglu_up(x, w_in, offs, src, inverse, up)
    return _gated_down(pre, act, w_out, offs, src, inverse, weights, True)


# --------------------------------------------------------------------------- expert_up


def expert_up(x: Tensor, w: Tensor, offs: Tensor, src: Tensor, inverse: Tensor) -> Tensor:
    """The up half of a routed SwiGLU expert block: ``act[r] = silu(a[r] @ w_gate[g]) *
    (a[r] @ w_up[g])`` with ``a[r] = x[src[r]]``, for the rows ``r`` of each group ``g``.

    Args:
        x: ``[T, D]`` tokens, in token order (never copied into expert order).
        w: ``[E, D, 2F]``, columns ``[:F]`` the gate and ``[F:]`` the up projection
            (:class:`groupmm.nn.GroupedExperts`' ``w_in``).
        offs: int32 ``[E]`` group ends over the ``R`` routed rows.
        src: integer ``[R]``, the token of each row (``x`` row ``src[r]``).
        inverse: integer ``[T, k]``, the row of each token's ``j``-th copy (every row
            named once: ``R = T*k``); used by the backward to sum a token's rows.

    Returns:
        ``[R, F]`` in ``x``'s dtype; rows past ``offs[-1]`` are zero.

    One op, ``torch.ops.groupmm.expert_up`` (the up projection and SwiGLU in one native
    call where a fused kernel runs; it keeps the pre-activation ``[R, 2F]`` for the
    backward). :func:`expert_block` is the whole block (ops ``swiglu_up``, ``gated_down``).
    :func:`groupmm._glue.routes` gives ``src``/``inverse``. An index out of range is
    an error: at once on the CPU, at the device's next call on CUDA (no host sync).
    """
    # before the op: its fake (torch.compile) checks nothing, the indices are converted
    # to int32 before the native call, and only the backward reads inverse
    check.dims("x", x, 2, "[T, D]")
    check.dims("w", w, 3, "[E, D, 2F]")
    _check_routes(x, offs, src, inverse)
    _check_gate_up("w", w)
    return _expert_up(x, w, offs, _int32(src), _int32(inverse))[0]


# --------------------------------------------------------------------------- expert_down


def expert_down(
    h: Tensor, w: Tensor, offs: Tensor, inverse: Tensor, weights: Optional[Tensor] = None
) -> Tensor:
    """The down half of a routed expert block: ``out[t] = sum_j weights[t, j] *
    y[inverse[t, j]]`` with ``y = h @ w[g]`` per group ``g`` of rows.

    Args:
        h: ``[R, F]`` activations of the routed rows, in expert order.
        w: ``[E, F, D]`` (:class:`groupmm.nn.GroupedExperts`' ``w_out``).
        offs: int32 ``[E]`` group ends over the ``R`` rows.
        inverse: integer ``[T, k]``, the row of each token's ``j``-th copy.
        weights: ``[T, k]`` router weights (differentiable), or None for a plain sum.

    Returns:
        ``[T, D]`` in ``h``'s dtype, in token order.
    """
    # before the op: its fake (torch.compile) checks nothing, and inverse is converted
    # to int32 before the row ops read it
    check.dims("h", h, 2, "[R, F]")
    check.dims("w", w, 3, "[E, F, D]")
    check.index("offs", offs, 1, "[E]")
    check.index("inverse", inverse, 2, "[T, k]")
    if weights is not None:
        check.tensor("weights", weights)
        check.same_shape("weights", weights, "inverse", inverse)
    return _expert_down(h, w, offs, _int32(inverse), weights)[0]
