"""The one timer of the benches: ``round_robin`` (implementations taking turns over rounds,
CUDA events around back-to-back calls), ``median_ms``, ``per_call_us`` and ``Clock``.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from harness.report import error_text

#: the keyword arguments of :func:`round_robin` a bench's command line sets
RR_ARGS = ("rounds", "sample_ms", "calls", "min_calls", "max_calls", "warmup")


def rr_orders(n: int, rounds: int) -> list:
    """The order of ``n`` implementations in each round: round r starts at ``r % n``."""
    return [[(r + i) % n for i in range(n)] for r in range(rounds)]


def spread(samples) -> dict:
    """Median, min, max and inclusive quartiles of a non-empty list of numbers."""
    s = sorted(float(v) for v in samples)
    if not s:
        raise ValueError("spread of no samples")
    q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else s * 3
    return {"median": statistics.median(s), "min": s[0], "q1": q1, "q3": q3, "max": s[-1]}


def paired(num, den) -> dict | None:
    """The spread of the round-by-round ratios ``den[i] / num[i]`` (rounds missing on
    either side skipped); None without any."""
    if not num or not den:
        return None
    r = [d / n for n, d in zip(num, den) if n and d]
    return spread(r) if r else None


def calls_for(est_ms: float, sample_ms: float, lo: int, hi: int) -> int:
    """Calls per sample so that a sample lasts about ``sample_ms``, within ``[lo, hi]``."""
    if not est_ms or est_ms <= 0 or not math.isfinite(est_ms):
        return hi
    return max(lo, min(hi, math.ceil(sample_ms / est_ms - 1e-6)))


def lead_for(host_ms: float, gpu_ms: float, calls: int, margin: float = 1.25) -> float:
    """GPU spin (ms) before a sample so the GPU never waits for the host inside it: the
    host issues call j at ``(j + 1) * host``, the GPU starts it at ``lead + j * gpu``."""
    need = host_ms + (calls - 1) * max(0.0, host_ms - gpu_ms)
    return margin * need + 0.02


_CYCLES_PER_MS = None


def gpu_spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (``torch.cuda._sleep``)."""
    global _CYCLES_PER_MS
    if ms <= 0:
        return
    if _CYCLES_PER_MS is None:
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(2_000_000)
        e.record()
        e.synchronize()
        _CYCLES_PER_MS = 2_000_000 / max(s.elapsed_time(e), 1e-3)
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS))


def _host_and_gpu_ms(run, reps: int = 3, lead: float = 0.0):
    """Host ms per ``run()`` (median, no sync) and GPU ms per ``run()`` (events)."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu_spin(lead)
    s.record()
    host = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
    e.record()
    e.synchronize()
    return statistics.median(host), s.elapsed_time(e) / reps


def round_robin(
    impls: dict,
    *,
    rounds: int = 7,
    sample_ms: float = 3.0,
    calls: int | None = None,
    min_calls: int = 3,
    max_calls: int = 50,
    warmup: int = 2,
    lead: bool = True,
    isolated: bool = False,
    max_lead_ms: float = 50.0,
) -> tuple:
    """Time ``impls`` (name -> callable; None skipped) round-robin. Returns ``(results,
    meta)``: per name ``{"ms", "min", "q1", "q3", "max", "samples", "calls", "host_ms",
    "mode", "warm_s", "error": None}`` or ``{"ms": None, "error"}``; meta ``{"lead_ms",
    "orders", "rounds"}``. ``isolated``: one call per sample, no spin, the host waiting for
    each."""
    rounds = max(1, rounds)
    names = [k for k, v in impls.items() if v is not None]
    res, live = {}, {}
    for k in names:
        t0 = time.perf_counter()
        try:
            for _ in range(max(1, warmup)):
                impls[k]()
            torch.cuda.synchronize()
        except Exception as e:  # an implementation that cannot run a case is reported
            torch.cuda.synchronize()
            res[k] = {"ms": None, "error": error_text(e, 120)}
            continue
        live[k] = {"run": impls[k], "warm_s": time.perf_counter() - t0}
    for st in live.values():
        h0, _ = _host_and_gpu_ms(st["run"], reps=1)
        st["host_ms"], st["gpu_ms"] = _host_and_gpu_ms(st["run"], lead=lead_for(h0, 0.0, 3))
        st["calls"] = (
            1 if isolated else calls or calls_for(st["gpu_ms"], sample_ms, min_calls, max_calls)
        )
    lead_ms = 0.0
    if lead and not isolated and live:
        need = [lead_for(st["host_ms"], st["gpu_ms"], st["calls"]) for st in live.values()]
        lead_ms = min(max_lead_ms, max(need))
    keys = list(live)
    orders = rr_orders(len(keys), rounds)
    events = {k: [None] * rounds for k in keys}
    for r, order in enumerate(orders):
        for k in (keys[i] for i in order):
            st = live[k]
            if "error" in st:
                continue
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gpu_spin(lead_ms)
            s.record()
            try:
                for _ in range(st["calls"]):
                    st["run"]()
            except Exception as ex:  # reported; the other implementations go on
                st["error"] = error_text(ex, 120)
            e.record()
            if isolated:
                e.synchronize()
            if "error" not in st:
                events[k][r] = (s, e)
    torch.cuda.synchronize()
    for k in keys:
        st = live[k]
        if "error" in st:
            res[k] = {"ms": None, "error": st["error"]}
            continue
        per = [None if ev is None else ev[0].elapsed_time(ev[1]) / st["calls"] for ev in events[k]]
        sp = spread([v for v in per if v is not None])
        res[k] = {"ms": sp.pop("median"), **sp, "samples": per, "calls": st["calls"]}
        res[k].update(host_ms=st["host_ms"], mode="events", warm_s=st["warm_s"], error=None)
    meta = {"lead_ms": lead_ms, "orders": [[keys[i] for i in o] for o in orders], "rounds": rounds}
    return {k: res[k] for k in names if k in res}, meta


def rr_settings(args) -> dict:
    """:func:`round_robin`'s keyword arguments of ``RR_ARGS`` that ``args`` has."""
    return {k: getattr(args, k) for k in RR_ARGS if hasattr(args, k)}


def median_ms(fn, reps: int, warmup: int = 5, *, cuda: bool = True):
    """Median ms per call of ``fn()`` over ``reps`` calls after ``warmup``: CUDA events
    around each call, issued back to back, or ``perf_counter`` on the CPU."""
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
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def per_call_us(fn, calls: int) -> float:
    """Host µs per call of ``fn`` over ``calls`` calls issued without a sync (the GPU work
    is tiny: the host is the bottleneck), after up to 200 warm-up calls."""
    for _ in range(min(200, calls)):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / calls / 1e3


class Clock:
    """Timestamps on the GPU timeline (CUDA events) or the host's (``perf_counter``)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _ready(t):
    """A functional collective's result waited on (its wait is enqueued before a stamp)."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


class Mark(torch.autograd.Function):
    """Identity that calls ``on_fwd()`` when the forward passes it and ``on_bwd()`` when
    the gradient does (``wait``: a functional collective's result waited on first)."""

    @staticmethod
    def forward(ctx, t, on_fwd, on_bwd, wait: bool = False):
        ctx.on_bwd, ctx.wait = on_bwd, wait
        t = _ready(t) if wait else t
        out = t.view(t.shape)
        on_fwd()
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = _ready(grad) if ctx.wait else grad
        ctx.on_bwd()
        return grad, None, None, None
