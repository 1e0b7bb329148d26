"""The one step timer of the benches: median milliseconds of a callable.

from timing import median_ms  # benches/timing.py, same folder as the bench
"""

import statistics
import time

import torch


def median_ms(fn, reps: int, warmup: int = 5, *, cuda: bool = True, isolated: bool = False):
    """Median milliseconds per call of ``fn()`` over ``reps`` calls after ``warmup`` calls.

    CUDA (``cuda=True``): CUDA events around each call, calls issued back to back with no
    host sync between them (as in a training step, and as triton's do_bench does), so
    the host's launch cost is hidden whenever it is shorter than the GPU work; with
    ``isolated`` the host waits for each call to finish before issuing the next, which
    puts the launch latency inside every timed call. CPU: ``time.perf_counter`` around
    each call (the work runs on the calling thread)."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
        if isolated:
            ends[i].synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
