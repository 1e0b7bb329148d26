"""Autocast for grouped_mm: the eager rule (:func:`autocast_dtype`, :func:`cast`) and the
dispatcher kernels that apply the same rule when the ops are called through the
dispatcher (``torch.compile``, tracing, ``torch.ops.groupmm.*``).

The rule is ``torch.mm``'s (autocast's ``cached_cast``): under autocast, floating inputs
other than float64 go to the current autocast dtype of their device; ``out=`` calls are
not cast.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _library

__all__ = ["autocast_dtype", "cast"]

#: one call answering "is autocast on for any device" (torch >= 2.4); the per-device
#: check below only runs when it says yes
_any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


def autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for ``t``'s device when autocast is on there, else None."""
    if not _any_enabled():
        return None
    device_type = "cuda" if t.is_cuda else "cpu" if t.is_cpu else None
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast(t: Tensor, dtype: Optional[torch.dtype]) -> Tensor:
    """Autocast's rule (``cached_cast``): floating tensors other than float64 go to
    ``dtype``; the cast is differentiable, so gradients come back in ``t.dtype``."""
    if dtype is None or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


def _register() -> "torch.library.Library":
    """Autocast kernels for the forward ops (what ``torch.library.register_autocast``
    does, but following the *current* autocast dtype rather than a fixed one): cast the
    floating inputs, then run the op with this device's autocast key excluded so that it
    does not come back here."""
    lib = torch.library.Library("groupmm", "FRAGMENT")
    for device_type in ("cpu", "cuda"):
        if not torch._C._is_autocast_available(device_type):
            continue
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def mm_kernel(_ks, a, b, offs, out_dtype, _dev=device_type, _keyset=keyset):
            dtype = torch.get_autocast_dtype(_dev)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return _library.mm_op(cast(a, dtype), cast(b, dtype), offs, out_dtype)

        def list_kernel(_ks, As, Bs, out_dtype, _dev=device_type, _keyset=keyset):
            dtype = torch.get_autocast_dtype(_dev)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return _library.list_op(
                    [cast(x, dtype) for x in As], [cast(x, dtype) for x in Bs], out_dtype
                )

        lib.impl("grouped_mm", mm_kernel, key, with_keyset=True)
        lib.impl("grouped_mm_list", list_kernel, key, with_keyset=True)
    return lib


_lib: Optional[torch.library.Library]
try:
    _lib = _register()
except (AttributeError, RuntimeError):  # pragma: no cover - torch without these hooks
    _lib = None  # eager calls still cast in Python
