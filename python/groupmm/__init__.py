"""groupmm: grouped matrix multiply (grouped GEMM) for PyTorch Mixture-of-Experts.

>>> import torch, groupmm
>>> x = torch.randn(10, 4); w = torch.randn(3, 4, 5)
>>> offs = torch.tensor([2, 2, 7], dtype=torch.int32)   # group ends
>>> groupmm.grouped_mm(x, w, offs=offs).shape
torch.Size([10, 5])

See ``grouped_mm`` for every form; ``build_info()`` says what this build holds.

The package by role: ``_api`` (the public function and its argument handling),
``_autograd`` (the eager autograd shims), ``_library`` (the ``torch.ops.groupmm`` custom
ops, their fake kernels and autograd), ``_autocast``, ``_numpy`` (the torch-free path),
``_native`` (the Rust extension); ``nn``, ``moe`` and ``fused`` build MoE layers on top.
"""

import contextlib
from typing import Iterator

from . import _native
from ._native import __version__

__all__ = ["grouped_mm", "build_info", "sm_limit", "__version__"]

try:
    import torch as _torch  # noqa: F401
except ImportError:  # numpy-only use
    _HAS_TORCH = False
else:
    _HAS_TORCH = True


def build_info() -> dict:
    """What this build holds: ``{"version", "cuda", "cuda_archs", "cuda_runtime",
    "cutlass", "dev_knobs", ...}`` (``dev_knobs``: a development build, whose
    ``GROUPMM_SM90_*`` environment variables force kernel choices; never in a wheel)."""
    return dict(_native.build_info())


@contextlib.contextmanager
def sm_limit(sms: int) -> Iterator[None]:
    """Inside the block, groupmm's CUDA kernels launched by this process occupy at most
    ``sms`` SMs of any device (0: all of them), leaving the others to kernels that run
    beside them on other streams (e.g. the all-to-all exchanges of expert parallelism on
    NCCL's stream, which a product holding every SM keeps waiting). Process-wide, not per
    thread or stream; the previous limit comes back at the block's end. Launches are
    planned when issued, so the limit of the block applies to what the block issues,
    including CUDA-graph captures made inside it.

    Raises ValueError for a negative ``sms`` and RuntimeError in a build without CUDA."""
    if not isinstance(sms, int) or isinstance(sms, bool):
        raise TypeError(f"sms: expected an int, found {type(sms).__name__}")
    before = _native.sm_limit()
    _native.set_sm_limit(sms)
    try:
        yield
    finally:
        _native.set_sm_limit(before)


if _HAS_TORCH:
    from ._api import grouped_mm
    from ._autograd import GroupedMM, GroupedMMList  # noqa: F401
else:
    from ._numpy import grouped_mm


def __getattr__(name):
    if name in ("nn", "moe", "fused"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'groupmm' has no attribute {name!r}")
