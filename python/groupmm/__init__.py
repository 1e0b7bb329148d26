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

from . import _native
from ._native import __version__

__all__ = ["grouped_mm", "build_info", "__version__"]

try:
    import torch as _torch  # noqa: F401
except ImportError:  # numpy-only use
    _HAS_TORCH = False
else:
    _HAS_TORCH = True


def build_info() -> dict:
    """What this build holds: ``{"version", "cuda", "cuda_archs", "cuda_runtime",
    "cutlass", ...}``."""
    return dict(_native.build_info())


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
