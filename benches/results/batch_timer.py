"""The timer and the routing of issue 28's record scripts in this folder (issue28_*.py).
``batch_ms``: ``warmup`` calls, then five batches of ``reps`` calls back to back between
two CUDA events; the median batch's milliseconds per call. ``uniform_routes``: k distinct
uniform experts per token, as ``(src, offs)``. Imported by the scripts as ``from
batch_timer import ...`` (they run as ``python3 benches/results/<script>.py``, this folder
first on the path)."""

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


def uniform_routes(T: int, k: int, E: int, g: torch.Generator, device="cuda"):
    """``(src, offs)`` of T tokens' k distinct uniform experts (one ``randperm`` per token
    from ``g``): int32 ``src [T*k]``, each routed row's token in expert order, and int32
    ``offs [E]``, the cumulative group ends."""
    expert = torch.stack([torch.randperm(E, device=device, generator=g)[:k] for _ in range(T)])
    expert = expert.flatten()
    order = torch.argsort(expert, stable=True)
    src = (order // k).to(torch.int32)
    offs = torch.bincount(expert, minlength=E).cumsum(0).to(torch.int32)
    return src, offs
