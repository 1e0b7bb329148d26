"""Stubs of the Rust extension module ``groupmm._native``."""

from typing import Any, Optional, Sequence, Tuple

__version__: str

def grouped_mm(
    a: Any,
    b: Any,
    offs: Optional[Any] = None,
    out_dtype: Optional[Any] = None,
    out: Optional[Any] = None,
) -> Any: ...
def grouped_mm_backward(
    grad: Any, a: Any, b: Any, offs: Optional[Any] = None, need_a: bool = True, need_b: bool = True
) -> Tuple[Optional[Any], Optional[Any]]: ...
def grouped_mm_list(
    a_list: Sequence[Any],
    b_list: Sequence[Any],
    out_dtype: Optional[Any] = None,
    out: Optional[Sequence[Any]] = None,
) -> list: ...
def grouped_mm_list_backward(
    grads: Sequence[Any],
    a_list: Sequence[Any],
    b_list: Sequence[Any],
    need_a: bool = True,
    need_b: bool = True,
) -> Tuple[Optional[list], Optional[list]]: ...
def packed_out_shape(
    a_shape: Sequence[int], b_shape: Sequence[int], offs_len: Optional[int] = None
) -> list: ...
def build_info() -> dict: ...
def take_offs_error(device: int) -> bool: ...
