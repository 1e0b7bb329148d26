"""The argument checks that run in Python, one function per rule and one wording each.

Every other argument rule is the Rust rules layer's (``src/shape/``, raised by
``_native`` with the same conventions). A check lives here only when it has to run
before a native call, and each call site says why in a one-line comment:

- nothing native sees the argument: module constructors, and the routing (torch ops);
- the native rule would come too late or not at all: under ``torch.compile`` and
  FakeTensor the fake kernels run instead of the native code, an operand is read only by
  the backward (``inverse``) or converted before the call (an index to int32);
- the argument is the caller's contract, named as the caller names it (``x`` against
  the expert weights), where the native rule would name the GEMM's ``a`` and ``b``;
- autograd: what must be refused before autograd records the call (``out=``).

The message rule is the core's: it starts with the argument's name; ``ValueError`` for
shapes and values, ``TypeError`` for types and dtypes, ``RuntimeError`` for devices.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import torch
from torch import Tensor

__all__ = [
    "device",
    "dims",
    "dtype",
    "index",
    "integer",
    "is_integer",
    "non_negative_float",
    "out",
    "out_dtype",
    "out_grad",
    "out_list",
    "positive_int",
    "same_shape",
    "shape",
    "tensor",
]


def positive_int(name: str, value: object) -> int:
    """``value`` as a positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive int, found {value!r}")
    if value <= 0:
        raise ValueError(f"{name}: expected a positive int, found {value}")
    return value


def non_negative_float(name: str, value: object) -> float:
    """``value`` as a float ``>= 0`` (a real number, not a bool; NaN refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a float >= 0, found {value!r}")
    if not float(value) >= 0:  # also refuses NaN
        raise ValueError(f"{name}: expected a float >= 0, found {value}")
    return float(value)


def tensor(name: str, value: object) -> None:
    """``value`` is a torch tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(value).__name__}")


def shape(name: str, t: Tensor, ok: bool, what: str, *args: object) -> None:
    """``ok`` says ``t``'s shape is ``what.format(*args)`` (e.g. ``"[T, D]"``; formatted
    only on failure)."""
    if not ok:
        raise ValueError(f"{name}: expected shape {what.format(*args)}, found {list(t.shape)}")


def dims(name: str, t: Any, n: int, what: str) -> None:
    """``t`` is a tensor of ``n`` dimensions, shaped ``what``."""
    tensor(name, t)
    shape(name, t, t.dim() == n, what)


def same_shape(name: str, t: Tensor, like_name: str, like: Tensor) -> None:
    """``t`` has ``like``'s shape."""
    if t.shape != like.shape:
        raise ValueError(
            f"{name}: expected shape {list(like.shape)} (the shape of {like_name}), "
            f"found {list(t.shape)}"
        )


def is_integer(dtype: torch.dtype) -> bool:
    """Index dtypes: integers, not bool."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def integer(name: str, t: Tensor) -> None:
    """``t`` holds integers (an index)."""
    if not is_integer(t.dtype):
        raise TypeError(f"{name}: expected an integer dtype, found {t.dtype}")


def index(name: str, t: Any, n: int, what: str) -> None:
    """``t`` is an integer tensor of ``n`` dimensions, shaped ``what``."""
    dims(name, t, n, what)
    integer(name, t)


def dtype(name: str, t: Tensor, want: torch.dtype, of: Optional[str] = None) -> None:
    """``t`` is of dtype ``want`` (the dtype of ``of``, when given)."""
    if t.dtype != want:
        why = "" if of is None else f" (the dtype of {of})"
        raise TypeError(f"{name}: expected dtype {want}{why}, found {t.dtype}")


def device(name: str, t: Tensor, want: torch.device, of: str) -> None:
    """``t`` is on ``want``, the device of ``of``."""
    if t.device != want:
        raise RuntimeError(
            f"{name}: expected a tensor on {want} (the device of {of}), found one on {t.device}"
        )


def out_dtype(value: object) -> None:
    """``out_dtype`` of ``grouped_mm`` is a torch dtype (its value is the Rust rule's)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"out_dtype: expected a torch.dtype or None, found {type(value).__name__}")


def out(value: object, inputs: Any) -> None:
    """``out`` of a packed product is a tensor, and ``out=`` is not differentiable (like
    ``torch.mm(out=)``)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"out: expected a torch.Tensor, found {type(value).__name__}")
    out_grad(value, inputs)


def out_list(value: object, inputs: Any) -> None:
    """``out`` of a list product is a list of tensors, and ``out=`` is not
    differentiable."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"out: expected a list of tensors (one per group) for the list form, "
            f"found {type(value).__name__}"
        )
    for i, o in enumerate(value):
        tensor(f"out[{i}]", o)
    out_grad(value, inputs)


def out_grad(value: Any, inputs: Any) -> None:
    """``out=`` (a tensor or a list of them) is refused while autograd would record the
    call: an input or an output requires grad."""
    if not torch.is_grad_enabled():
        return
    if any(isinstance(x, Tensor) and x.requires_grad for x in inputs):
        raise RuntimeError(
            "out: grouped_mm(..., out=...) does not support automatic differentiation, "
            "but an input requires grad"
        )
    outs = value if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(o, Tensor) and o.requires_grad for o in outs):
        raise RuntimeError(
            "out: grouped_mm(..., out=...) does not support automatic differentiation, "
            "but out requires grad"
        )
