"""The torch-free face of :func:`groupmm.grouped_mm`: numpy arrays, straight to the Rust
extension. It is ``groupmm.grouped_mm`` when torch is not installed, and the path the
torch face (``_api.py``) takes for anything that is not a torch tensor, so there is one
numpy path. Importing it does not import torch.
"""

from . import _native

__all__ = ["grouped_mm"]


def check_form(a, offs, bias) -> bool:
    """The argument rules read before any array: ``bias`` must be None (it is in the
    signature for compatibility with ``F.grouped_mm``) and the list form takes no
    ``offs``. True for the list form ``grouped_mm(As, Bs)``."""
    if bias is not None:
        raise ValueError("bias: not supported by groupmm.grouped_mm; add it to the output instead")
    if isinstance(a, (list, tuple)):
        if offs is not None:
            raise ValueError("offs: must be None for the list form grouped_mm(As, Bs)")
        return True
    return False


def packed(a, b, offs, out_dtype, out):
    """A packed product on numpy arrays (or arguments the extension reports by name)."""
    return _native.grouped_mm(a, b, offs, out_dtype, out)


def listed(As, Bs, out_dtype, out) -> list:
    """A list product on numpy arrays (or arguments the extension reports by name)."""
    return list(_native.grouped_mm_list(As, Bs, out_dtype, out))


def grouped_mm(a, b, offs=None, *, bias=None, out_dtype=None, out=None):
    """Grouped matrix multiply on numpy arrays (``groupmm.grouped_mm`` without torch).

    The same forms and arguments as the torch version: ``grouped_mm(As, Bs)`` for lists
    of 2-D arrays, ``grouped_mm(a, b, offs)`` for the packed forms; ``out_dtype`` is a
    numpy dtype (``numpy.float32`` from float16 inputs), ``out`` an array (or list of
    arrays) written in place. See the torch version's docstring for the forms.
    """
    if check_form(a, offs, bias):
        return listed(a, b, out_dtype, out)
    return packed(a, b, offs, out_dtype, out)
