"""Former home of ``grouped_mm`` and its autograd shims, kept so that imports of
``groupmm.ops`` still work. The code lives in ``_api`` (the public function),
``_autograd`` (``GroupedMM``, ``GroupedMMList``), ``_library`` (the custom ops) and
``_autocast``."""

from ._api import grouped_mm
from ._autograd import GroupedMM, GroupedMMList

__all__ = ["grouped_mm", "GroupedMM", "GroupedMMList"]
