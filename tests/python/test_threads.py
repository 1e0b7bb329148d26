"""Concurrent calls from several Python threads give correct results, and the GIL is
released while the CPU kernels run."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from conftest import assert_close_rel, make_list, make_packed, ref_list, ref_packed
from groupmm import grouped_mm

FORMS = {
    "2d3d": dict(groups=4, m=0, n=24, k=40, extent=120),
    "2d2d": dict(groups=4, m=20, n=24, k=0, extent=120),
    "3d2d": dict(groups=4, m=20, n=0, k=40, extent=120),
    "3d3d": dict(groups=4, m=20, n=24, k=40, extent=0),
}


def _job(seed: int):
    """One thread's work: a forward+backward of a form chosen by seed, plus a list call;
    returns everything needed to check it afterwards."""
    form = list(FORMS)[seed % 4]
    dtype = [torch.float32, torch.float64, torch.bfloat16][seed % 3]
    a, b, offs = make_packed(form, **FORMS[form], dtype=dtype, seed=seed)
    a.requires_grad_(True)
    b.requires_grad_(True)
    out = grouped_mm(a, b, offs=offs)
    go = torch.ones_like(out)
    da, db = torch.autograd.grad(out, (a, b), go)
    As, Bs = make_list([(7, 5, 9), (0, 3, 2), (11, 13, 6)], dtype=dtype, seed=seed)
    outs = grouped_mm(As, Bs)
    return form, dtype, a.detach(), b.detach(), offs, out.detach(), da, db, As, Bs, outs


def test_concurrent_calls_are_correct():
    seeds = list(range(48))
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(_job, seeds))
    for seed, (form, dtype, a, b, offs, out, da, db, As, Bs, outs) in zip(seeds, results):
        ra = a.double().requires_grad_(True)
        rb = b.double().requires_grad_(True)
        ref = ref_packed(ra, rb, offs)
        assert_close_rel(out, ref, dtype, f"{form} seed {seed}")
        if ref.requires_grad:
            ga, gb = torch.autograd.grad(ref, (ra, rb), torch.ones_like(ref), allow_unused=True)
            ga = torch.zeros_like(ra) if ga is None else ga
            gb = torch.zeros_like(rb) if gb is None else gb
            assert_close_rel(da, ga, dtype, f"da {form} seed {seed}")
            assert_close_rel(db, gb, dtype, f"db {form} seed {seed}")
        for o, r in zip(outs, ref_list(As, Bs)):
            assert_close_rel(o, r, dtype, f"list seed {seed}")
        # and bitwise what the same call gives on this thread alone
        assert torch.equal(out, grouped_mm(a, b, offs=offs))


def test_gil_is_released_during_the_kernel():
    """A Python thread keeps running while a large grouped_mm computes. With the GIL
    held, no Python bytecode of another thread could run inside the call's interval."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 512, generator=gen)
    w = torch.randn(8, 512, 512, generator=gen)
    offs = torch.arange(1, 9, dtype=torch.int32) * 256
    grouped_mm(x, w, offs=offs)  # warm up
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.02)
    try:
        for _ in range(5):  # the kernel must take long enough to see the ticker
            t0 = time.perf_counter()
            grouped_mm(x, w, offs=offs)
            t1 = time.perf_counter()
            if t1 - t0 > 0.03:
                break
            x = torch.cat([x, x])
            offs = offs * 2
    finally:
        stop.set()
        th.join()
    assert t1 - t0 > 0.03, "the call was too fast to observe"
    lo, hi = t0 + 0.2 * (t1 - t0), t0 + 0.8 * (t1 - t0)
    inside = [t for t in ticks if lo <= t <= hi]
    assert inside, "no Python code ran during the call: the GIL was not released"
