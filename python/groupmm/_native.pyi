"""Type stubs of the Rust extension module ``groupmm._native`` (src/python/).

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
    "TOPK_CUDA_MAX_COLS",
    "__version__",
    "build_info",
    "gather_k_mm",
    "gather_mm",
    "gather_sum",
    "gathers_in_gemm",
    "grouped_mm",
    "grouped_mm_backward",
    "grouped_mm_list",
    "grouped_mm_list_backward",
    "list_out_shapes",
    "packed_out_shape",
    "product",
    "row_dots",
    "scatter_rows",
    "set_sm_limit",
    "sm_limit",
    "swiglu",
    "swiglu_backward",
    "take_offs_error",
    "topk_ids",
]
__version__: str
#: the widest rows :func:`topk_ids` takes on CUDA (src/shape/rows.rs)
TOPK_CUDA_MAX_COLS: int

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
    dev_knobs: bool
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

def gather_k_mm(
    a: _Rows,
    b: _Rows,
    offs: _Rows,
    src: _Rows,
    gathered_b: bool = False,
    transposed: bool = False,
    out: Optional[_Rows] = None,
) -> _Rows:
    """The weight gradient of a routed expert layer on rows kept in token order, with no
    copy of the gathered rows: ``out[g] = Σ a_rᵀ @ b_r`` over the routed rows ``r`` of group
    ``g`` (``[G, K, N]``, ``a``'s dtype, zeros for empty groups), where routed row ``r``
    reads ``a_r = a[src[r]]`` and ``b_r = b[r]``, or with ``gathered_b``, ``a_r = a[r]`` and
    ``b_r = b[src[r]]``.

    ``a [Ta, K]`` and ``b [Tb, N]`` 2-D, of one dtype and device: the operand read in order
    has exactly ``R = len(src)`` rows, the gathered one any number; ``src`` any integer
    ``[R]`` (the source row of each routed row); ``offs`` int32 ``[G]``, the cumulative
    group ends over the ``R`` routed rows (rows past ``offs[-1]`` belong to no group). An
    index out of range is an error: at once on the CPU, at the next call on CUDA.
    ``transposed``: the same values computed as ``(Σ b_rᵀ @ a_r)ᵀ``, returned as the
    transposed view of a fresh contiguous ``[G, N, K]`` (the gradient of a column-major
    ``[G, K, N]`` weight, an ``[E, N, K]`` parameter's view, in its own layout). On Hopper
    the rows are read through ``src`` inside the GEMM where a kernel does, else gathered
    first; on the CPU always gathered first. ``out``: written instead of a fresh result
    (``[G, K, N]``, ``a``'s dtype, any strides, sharing no memory with ``a`` or ``b``) and
    returned; in place wherever the kernels can describe it as row-major, e.g. a slab of
    rows or columns of a larger gradient, else through a fresh result copied into it.
    ValueError for shapes that do not fit, TypeError and RuntimeError for dtypes and
    devices unlike ``a``'s."""

# The fused expert products (src/exec/product.rs): one GroupedM product whose epilogue does
# the glue; a fresh result, or None (after every argument check, on every device) where no
# fused kernel runs: on the CPU (nothing is read or allocated), or on a GPU, dtype or
# alignment without one (nothing ran). The caller then composes the same result
# (groupmm.fused). Never a host sync: a bad ``offs`` is reported at the next call, as by
# grouped_mm.

def product(
    epilogue: str,
    x: _Rows,
    w: _Rows,
    offs: _Rows,
    operands: Optional[Sequence[Optional[_Rows]]] = None,
    src: Optional[_Rows] = None,
    out: Optional[_Rows] = None,
) -> Optional[List[_Rows]]:
    """A GroupedM product with the fused epilogue named ``epilogue`` (a rule entry of
    src/shape/product/epilogues.rs, which lists its operands, its outputs and what it
    computes): every output, the first one first, contiguous, or None where no kernel runs
    it (the CPU, before anything is read or allocated; a device or layout no fused kernel
    takes) — the caller composes it then.

    ``x`` (named as the rule names it in messages, e.g. ``dy``) ``[T, K]``; ``w`` ``[E, K,
    N]`` (or ``[E, N, K]`` where the rule reads it transposed) of any strides; ``offs`` int32
    ``[E]``; ``operands`` the rule's, in its order (None for an absent optional one);
    ``src`` any integer ``[R]`` (the row of ``x`` of each routed row, read inside the GEMM
    where a kernel does, else gathered first; out-of-range values read zero rows and are
    reported at the next call), absent: ``R = T``, the rows in order; ``out``: the first
    output is written there instead (an operand itself only where the rule allows it).
    TypeError for an unknown ``epilogue``, missing operands or dtypes unlike ``x``'s (or
    float32 where the rule says so), ValueError for shapes that do not fit, RuntimeError for
    devices unlike ``x``'s."""

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

def topk_ids(scores: _Rows, k: int) -> _Rows:
    """int64 ``[T, k]``: row ``t`` holds the columns of the ``k`` largest values of
    ``scores[t]`` (``[T, E]``, ``E >= 1``), best first: NaN greater than every number,
    equal values lower column first. ValueError for ``k`` outside ``[1, E]`` or a shape
    that does not fit (on CUDA, ``E`` above :data:`TOPK_CUDA_MAX_COLS`), TypeError for a
    dtype that is not floating."""

def gathers_in_gemm(device: int, dtype: str) -> bool:
    """Whether products of ``dtype`` (its torch name, e.g. ``"torch.bfloat16"``) on CUDA
    device ``device`` read routed rows through ``src`` inside the GEMM (Hopper, 16-bit,
    unless ``GROUPMM_SM90_GATHER=0``): the fused layer then hands ``src`` to each product
    instead of copying the rows once for several of them. RuntimeError without CUDA."""

def set_sm_limit(sms: int) -> None:
    """Limits every later CUDA launch of this process to ``sms`` SMs on any device (0: all
    of them): the persistent products and the row kernels leave the others to kernels that
    run beside them. ValueError for a negative count, RuntimeError without CUDA."""

def sm_limit() -> int:
    """The limit :func:`set_sm_limit` set (0: none; 0 without CUDA)."""

def take_offs_error(device: int) -> bool:
    """Reads and clears the device's deferred error flag (no sync): True when a launch
    there met invalid ``offs`` or a routing index out of range since the last read."""
