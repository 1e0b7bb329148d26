"""groupmm: grouped matrix multiply (grouped GEMM) for PyTorch Mixture-of-Experts.

>>> import torch, groupmm
>>> x = torch.randn(10, 4); w = torch.randn(3, 4, 5)
>>> offs = torch.tensor([2, 2, 7], dtype=torch.int32)   # group ends
>>> groupmm.grouped_mm(x, w, offs=offs).shape
torch.Size([10, 5])

See ``grouped_mm`` for every form; ``build_info()`` says what this build holds.
"""

from . import _native
from ._native import __version__

__all__ = ["grouped_mm", "build_info", "__version__"]

try:
    import torch as _torch  # noqa: F401
except ImportError:  # numpy-only use
    _torch = None


def build_info() -> dict:
    """What this build holds: ``{"version", "cuda", "cuda_archs", "cuda_runtime",
    "cutlass", ...}``."""
    return dict(_native.build_info())


def _numpy_grouped_mm(a, b, offs=None, *, out_dtype=None, out=None):
    """numpy-only ``grouped_mm``, used when torch is not installed."""
    if isinstance(a, (list, tuple)):
        return list(_native.grouped_mm_list(a, b, out_dtype, out))
    return _native.grouped_mm(a, b, offs, out_dtype, out)


if _torch is not None:
    from .ops import GroupedMM, GroupedMMList, grouped_mm  # noqa: F401
else:
    grouped_mm = _numpy_grouped_mm


def __getattr__(name):
    if name in ("nn", "moe"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'groupmm' has no attribute {name!r}")
