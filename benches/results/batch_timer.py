"""The timer of issue 28's record scripts in this folder (issue28_*.py): ``warmup`` calls,
then five batches of ``reps`` calls back to back between two CUDA events; the median
batch's milliseconds per call. Imported by the scripts as ``from batch_timer import
batch_ms`` (they run as ``python3 benches/results/<script>.py``, this folder first on
the path)."""

import torch


def batch_ms(f, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            f()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return sorted(out)[2]
