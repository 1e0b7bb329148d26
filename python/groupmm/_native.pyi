"""Type stubs of the Rust extension module ``groupmm._native`` (src/python/mod.rs).

Every function takes torch tensors or numpy arrays (not mixed; the result is of the same
kind) and reports a bad argument by name: ValueError (shapes, values), TypeError (dtypes,
types), RuntimeError (devices, CUDA). Checked against the built module by
``python3 -m mypy.stubtest groupmm._native`` in scripts/test.sh.
"""

from typing import Any, List, Optional, Sequence, Tuple, TypedDict, Union, overload

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "__version__",
    "build_info",
    "gather_mm",
    "grouped_mm",
    "grouped_mm_backward",
    "grouped_mm_list",
    "grouped_mm_list_backward",
    "list_out_shapes",
    "moe_rows",
    "packed_out_shape",
    "take_offs_error",
]
__version__: str

_Array = npt.NDArray[Any]
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
    index: Any,
    out_dtype: Any | None = None,
) -> Any:
    """``out[r] = x[index[r]] @ w[g]`` for the rows ``r`` of group ``g`` (int32 ``index``
    and ``offs``); rows whose index is out of range are zero rows of the product's A."""

def moe_rows(
    op: str,
    out: Any,
    x: Any,
    y: Any | None = None,
    index: Any | None = None,
    weights: Any | None = None,
) -> None: ...
def take_offs_error(device: int) -> bool:
    """Reads and clears the flag CUDA kernels raise on invalid ``offs`` (no sync)."""
