"""torch's own grouped product, as the benches call it: ``torch.nn.functional.grouped_mm``
(bench_gpu.py times it against groupmm; bench_moe.py's torch-gmm and plain layers run on
it), one rule each for whether this torch has it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm():
    """The grouped product bench_gpu.py times: ``F.grouped_mm``, else ``torch._grouped_mm``
    (a torch before the public name), else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def why_no_grouped_mm():
    """None where ``F.grouped_mm`` exists (the layers of :class:`TorchGmm` and
    bench_moe's plain layer call it by that name), else why they cannot run."""
    return None if hasattr(F, "grouped_mm") else f"no F.grouped_mm in torch {torch.__version__}"


class TorchGmm:
    """Context: GroupedExperts' grouped products on F.grouped_mm (the autograd graph a
    forward records inside keeps F.grouped_mm for the backward)."""

    def __enter__(self):
        import groupmm.nn as gnn  # here: bench_gpu.py runs --dry-run without groupmm

        self.gnn, self.saved = gnn, gnn.grouped_mm
        gnn.grouped_mm = lambda a, b, offs=None: F.grouped_mm(a, b, offs=offs)

    def __exit__(self, *exc):
        self.gnn.grouped_mm = self.saved
