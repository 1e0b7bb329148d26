"""Type stubs of the Rust extension module ``groupmm._native`` (src/python/mod.rs).

Every function takes torch tensors or numpy arrays (not mixed; the result is of the same
kind) and reports a bad argument by name: ValueError (shapes, values), TypeError (dtypes,
types), RuntimeError (devices, CUDA). Checked against the built module by
``python3 -m mypy.stubtest groupmm._native`` in scripts/test.sh.
"""

from typing import Any, List, Optional, Sequence, Tuple, TypedDict, TypeVar, Union, overload

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "__version__",
    "build_info",
    "gather_mm",
    "gather_sum",
    "grouped_mm",
    "grouped_mm_backward",
    "grouped_mm_list",
    "grouped_mm_list_backward",
    "list_out_shapes",
    "packed_out_shape",
    "row_dots",
    "scatter_rows",
    "swiglu",
    "swiglu_backward",
    "take_offs_error",
]
__version__: str

_Array = npt.NDArray[Any]
#: the row ops take torch tensors or numpy arrays (not mixed) and return the same kind
_Rows = TypeVar("_Rows", torch.Tensor, npt.NDArray[Any])
#: numpy's out_dtype: float32 from float16 inputs, or the input dtype
_NumpyDType = Union[np.dtype[Any], type, str]

class _BuildInfo(TypedDict):
    version: str
    cuda: bool
    cuda_archs: List[str]
    cuda_runtime: Optional[str]
    cutlass: Optional[str]
    cpu_gemm: str
    cpu_threads: int
    abi3: bool

@overload
def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offs: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Packed grouped product ``grouped_mm(a, b, offs)``, written into ``out`` (and
    returned) when given."""

@overload
def grouped_mm(
    a: _Array,
    b: _Array,
    offs: Optional[npt.NDArray[np.int32]] = None,
    out_dtype: Optional[_NumpyDType] = None,
    out: Optional[_Array] = None,
) -> _Array: ...
@overload
def grouped_mm_backward(
    grad: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    offs: Optional[torch.Tensor] = None,
    need_a: bool = True,
    need_b: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(dA, dB)`` of a packed product (``dA = grad·bᵀ``, ``dB = aᵀ·grad``), each None
    when not requested."""

@overload
def grouped_mm_backward(
    grad: _Array,
    a: _Array,
    b: _Array,
    offs: Optional[npt.NDArray[np.int32]] = None,
    need_a: bool = True,
    need_b: bool = True,
) -> Tuple[Optional[_Array], Optional[_Array]]: ...
@overload
def grouped_mm_list(
    a_list: Sequence[torch.Tensor],
    b_list: Sequence[torch.Tensor],
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[Sequence[torch.Tensor]] = None,
) -> List[torch.Tensor]:
    """List product ``[a_list[i] @ b_list[i]]``, written into ``out`` when given."""

@overload
def grouped_mm_list(
    a_list: Sequence[_Array],
    b_list: Sequence[_Array],
    out_dtype: Optional[_NumpyDType] = None,
    out: Optional[Sequence[_Array]] = None,
) -> List[_Array]: ...
@overload
def grouped_mm_list_backward(
    grads: Sequence[torch.Tensor],
    a_list: Sequence[torch.Tensor],
    b_list: Sequence[torch.Tensor],
    need_a: bool = True,
    need_b: bool = True,
) -> Tuple[Optional[List[torch.Tensor]], Optional[List[torch.Tensor]]]:
    """``(dAs, dBs)`` of a list product, each None when not requested."""

@overload
def grouped_mm_list_backward(
    grads: Sequence[_Array],
    a_list: Sequence[_Array],
    b_list: Sequence[_Array],
    need_a: bool = True,
    need_b: bool = True,
) -> Tuple[Optional[List[_Array]], Optional[List[_Array]]]: ...
def packed_out_shape(
    a_shape: Sequence[int], b_shape: Sequence[int], offs_len: Optional[int] = None
) -> List[int]:
    """Output shape of a packed product from shapes alone (ValueError from the shape
    rules)."""

def list_out_shapes(
    a_shapes: Sequence[Sequence[int]], b_shapes: Sequence[Sequence[int]]
) -> List[List[int]]:
    """Output shapes ``[M_i, N_i]`` of a list product from shapes alone (ValueError from
    the shape rules)."""

def build_info() -> _BuildInfo:
    """What this build holds."""

def gather_mm(
    x: Any,
    w: Any,
    offs: Any,
    src: Any,
    out_dtype: Any | None = None,
) -> Any:
    """``out[r] = x[src[r]] @ w[g]`` for the rows ``r`` of group ``g`` (``src``: the token
    of each routed row, any integer dtype; int32 ``offs``); rows whose ``src`` is out of
    range are zero rows of the product's A."""

# The row ops of the MoE glue (src/shape/rows.rs): ``inverse [T, k]`` is the row of each
# token's ``j``-th choice, any integer dtype; operands of any layout (copied contiguous
# once); a fresh result.

def swiglu(pre: _Rows) -> _Rows:
    """``silu(gate) * up`` of ``pre = [gate | up]`` (``[R, 2F]`` → ``[R, F]``)."""

def swiglu_backward(grad: _Rows, pre: _Rows) -> _Rows:
    """``[d gate | d up]`` (``[R, 2F]``) of :func:`swiglu` from ``grad [R, F]``."""

def gather_sum(y: _Rows, inverse: _Rows, weights: Optional[_Rows] = None) -> _Rows:
    """``out[t] = sum_j weights[t, j] * y[inverse[t, j]]`` (``[T, D]``; weight 1 without
    ``weights``, which has ``y``'s dtype or float32)."""

def scatter_rows(grad: _Rows, inverse: _Rows, weights: Optional[_Rows], rows: int) -> _Rows:
    """``out[inverse[t, j]] = weights[t, j] * grad[t]`` into ``[rows, D]``, every row
    written once (zeros for rows no index names)."""

def row_dots(grad: _Rows, y: _Rows, inverse: _Rows, out_dtype: Optional[Any] = None) -> _Rows:
    """``out[t, j] = <grad[t], y[inverse[t, j]]>`` (``[T, k]``) as ``out_dtype``:
    ``grad``'s dtype (None) or float32."""

def take_offs_error(device: int) -> bool:
    """Reads and clears the flag CUDA kernels raise on invalid ``offs`` (no sync)."""
