"""The one timer of the benches.

    from harness.timing import median_ms, round_robin

``median_ms(fn, reps)``: median milliseconds of one callable (CUDA events around each call,
or ``perf_counter`` on the CPU) — the step timer of bench_transformers and bench_cpu.

``round_robin({name: fn, ...})``: several implementations of the same product measured
against each other in a way that survives the clock drift of these GPUs (an H200's clocks
move by up to ~10 % within seconds, and whichever implementation runs first after an idle
moment is fastest; ``../shared/PEERS.md``, "Timing on these GPUs"):

* every implementation is warmed up (JIT compiles happen here), then its host and GPU time
  per call estimated from a few calls;
* a *sample* is CUDA events around ``calls`` back-to-back calls (or one CUDA-graph replay of
  ``calls`` captured calls with ``graph=True``), ``calls`` chosen per implementation so a
  sample lasts about ``sample_ms`` (or fixed with ``calls=N``);
* before every sample the GPU spins (``torch.cuda._sleep``) for the same *lead* time, long
  enough for the host to enqueue the whole sample: the events then hold GPU time only, even
  for an implementation whose host cost per call exceeds its GPU time, and every
  implementation starts its samples from the same state;
* the implementations run round-robin over ``rounds`` rounds, the start rotating each round
  (round r runs ``order[r % n], order[r % n + 1], ...``), so drift lands on all of them
  alike; there is no host sync between samples;
* per implementation: the median ms per call, its spread (min, quartiles, max) over the
  rounds, and the per-round samples, so ratios can also be taken round by round
  (``paired``): two implementations of one round ran seconds apart at most.

``rr_settings(args)``: round_robin's settings from a bench's command line (the flags
themselves, results and their files: benches/report.py).

The pure parts (``rr_orders``, ``spread``, ``paired``, ``calls_for``, ``lead_for``) take and
return plain numbers and are unit-tested on the CPU (tests/python/test_bench_timing.py).
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from harness.report import error_text

# ----------------------------------------------------------------------------------------
# pure parts


def rr_orders(n: int, rounds: int) -> list:
    """The order of ``n`` implementations (indices) in each of ``rounds`` rounds: round r
    starts at ``r % n`` and goes round, so over any n consecutive rounds every implementation
    takes every position once."""
    return [[(r + i) % n for i in range(n)] for r in range(rounds)]


def spread(samples) -> dict:
    """Median, min, max and quartiles (inclusive method: the quartiles of the samples
    themselves, no extrapolation) of a non-empty list of numbers."""
    s = sorted(float(v) for v in samples)
    if not s:
        raise ValueError("spread of no samples")
    if len(s) >= 2:
        q1, _, q3 = statistics.quantiles(s, n=4, method="inclusive")
    else:
        q1 = q3 = s[0]
    return {"median": statistics.median(s), "min": s[0], "q1": q1, "q3": q3, "max": s[-1]}


def paired(num, den) -> dict | None:
    """Round-by-round ratios ``den[i] / num[i]`` (the speed of ``num``'s implementation over
    ``den``'s when both are times of the same rounds): their spread, or None when either
    side has no samples. Rounds where one side is missing are skipped (``None``)."""
    if not num or not den:
        return None
    r = [d / n for n, d in zip(num, den) if n and d]
    return spread(r) if r else None


def calls_for(est_ms: float, sample_ms: float, lo: int, hi: int) -> int:
    """Back-to-back calls per sample so that a sample lasts about ``sample_ms`` given a GPU
    time of ``est_ms`` per call, within ``[lo, hi]``."""
    if not est_ms or est_ms <= 0 or not math.isfinite(est_ms):
        return hi
    return max(lo, min(hi, math.ceil(sample_ms / est_ms - 1e-6)))  # - rounding noise


def lead_for(host_ms: float, gpu_ms: float, calls: int, margin: float = 1.25) -> float:
    """GPU spin (ms) before a sample so the GPU never waits for the host inside it.

    The host enqueues call j (0-based) about ``(j + 1) * host_ms`` after the spin starts; the
    GPU, with no waiting, starts it at ``lead + j * gpu_ms``; so the lead must be at least
    ``max_j((j + 1) * host - j * gpu) = host + (calls - 1) * max(0, host - gpu)``, plus a
    margin for the host's jitter."""
    need = host_ms + (calls - 1) * max(0.0, host_ms - gpu_ms)
    return margin * need + 0.02


# ----------------------------------------------------------------------------------------
# CUDA parts

_CYCLES_PER_MS = None


def _cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU (measured once)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        torch.cuda.synchronize()
        torch.cuda._sleep(1000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cyc = 2_000_000
        s.record()
        torch.cuda._sleep(cyc)
        e.record()
        e.synchronize()
        _CYCLES_PER_MS = cyc / max(s.elapsed_time(e), 1e-3)
    return _CYCLES_PER_MS


def gpu_spin(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (a one-thread spin kernel)."""
    if ms > 0:
        torch.cuda._sleep(int(ms * _cycles_per_ms()))


def _graph_of(fn, calls: int):
    """A CUDA graph of ``calls`` calls of ``fn`` (warmed on a side stream first, as
    torch.cuda.graph requires), returned as (replay function, graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return g.replay, g


def _host_and_gpu_ms(run, per: int, reps: int = 3, lead: float = 0.0):
    """Host ms per ``run()`` (median of ``reps``, issued without a sync) and GPU ms per
    ``run()`` (events around the ``reps`` runs after a spin of ``lead`` ms), each divided by
    ``per`` (the calls one run holds)."""
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
    return statistics.median(host) / per, s.elapsed_time(e) / reps / per


def round_robin(
    impls: dict,
    *,
    rounds: int = 7,
    sample_ms: float = 3.0,
    calls: int | None = None,
    min_calls: int = 3,
    max_calls: int = 50,
    warmup: int = 2,
    graph: bool = False,
    lead: bool = True,
    isolated: bool = False,
    max_lead_ms: float = 50.0,
) -> tuple:
    """Time ``impls`` (name -> callable; ``None`` values are skipped) against each other,
    round-robin (see the module docstring). Returns ``(results, meta)``:

    ``results[name]``: ``{"ms": median ms per call, "min", "q1", "q3", "max": its spread,
    "samples": ms per call of each round (None where that round has none), "calls": calls
    per sample, "host_ms": host ms per call, "mode": "events" | "graph", "warm_s": wall
    seconds of the warm-up (JIT compiles show here), "error": None}`` or, for an
    implementation that raised, ``{"ms": None, "error": "..."}``.

    ``meta``: ``{"lead_ms": the spin before every sample, "orders": rr_orders, "rounds"}``.

    ``calls`` fixes the calls per sample (else chosen per implementation for ``sample_ms``
    within ``[min_calls, max_calls]``); ``lead=False`` drops the spin; ``isolated``: one
    call per sample, no spin, the host waiting for each sample to finish (the launch
    latency inside every sample); ``graph``: each sample one replay of a CUDA graph of the
    sample's calls where capture works (else events, said in ``mode``)."""
    rounds = max(1, rounds)
    names = [k for k, v in impls.items() if v is not None]
    res = {}
    live = {}
    for k in names:  # warm up: JIT compiles, allocator, caches
        fn = impls[k]
        t0 = time.perf_counter()
        try:
            for _ in range(max(1, warmup)):
                fn()
            torch.cuda.synchronize()
        except Exception as e:  # an implementation that cannot run a case is reported
            torch.cuda.synchronize()
            res[k] = {"ms": None, "error": error_text(e, 120)}
            continue
        live[k] = {"run": fn, "warm_s": time.perf_counter() - t0, "mode": "events"}

    for st in live.values():  # host and GPU ms per call
        h0, _ = _host_and_gpu_ms(st["run"], 1, reps=1, lead=0.0)
        st["host_ms"], st["gpu_ms"] = _host_and_gpu_ms(
            st["run"], 1, reps=3, lead=lead_for(h0, 0.0, 3)
        )
        if isolated:
            st["calls"] = 1
        elif calls:
            st["calls"] = calls
        else:
            st["calls"] = calls_for(st["gpu_ms"], sample_ms, min_calls, max_calls)

    if graph and not isolated:
        for st in live.values():
            fn, n = st["run"], st["calls"]
            try:
                replay, g = _graph_of(fn, n)
            except Exception as e:  # capture is not for every implementation
                torch.cuda.synchronize()
                st["graph_error"] = error_text(e, 120)
                continue
            st["graph"] = g  # kept alive until the samples are read
            st["sample"] = replay
            st["mode"] = "graph"
            st["host_ms"], _ = _host_and_gpu_ms(replay, n, reps=2, lead=0.0)

    for st in live.values():
        if "sample" not in st:
            fn, n = st["run"], st["calls"]

            def sample(fn=fn, n=n):
                for _ in range(n):
                    fn()

            st["sample"] = sample

    lead_ms = 0.0
    if lead and not isolated and live:
        need = []
        for st in live.values():
            if st["mode"] == "graph":  # one replay per sample: its host cost, once
                need.append(lead_for(st["host_ms"] * st["calls"], 0.0, 1))
            else:
                need.append(lead_for(st["host_ms"], st["gpu_ms"], st["calls"]))
        lead_ms = min(max_lead_ms, max(need))

    keys = list(live)
    orders = rr_orders(len(keys), rounds)
    events = {k: [None] * rounds for k in keys}
    for r, order in enumerate(orders):
        for i in order:
            k = keys[i]
            st = live[k]
            if "error" in st:
                continue
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gpu_spin(lead_ms)
            s.record()
            try:
                st["sample"]()
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
        got = [v for v in per if v is not None]
        sp = spread(got)
        res[k] = {
            "ms": sp["median"],
            "min": sp["min"],
            "q1": sp["q1"],
            "q3": sp["q3"],
            "max": sp["max"],
            "samples": per,
            "calls": st["calls"],
            "host_ms": st["host_ms"],
            "mode": st["mode"],
            "warm_s": st["warm_s"],
            "error": None,
        }
        if "graph_error" in st:
            res[k]["graph_error"] = st["graph_error"]
    for st in live.values():  # free the graphs' private memory pools
        st.pop("graph", None)
    return {k: res[k] for k in names if k in res}, {
        "lead_ms": lead_ms,
        "orders": [[keys[i] for i in o] for o in orders],
        "rounds": rounds,
    }


# --------------------------------------------------------------------------- arguments
# round_robin's settings from a command line (its flags: report.add_rr_args).


#: the keyword arguments of :func:`round_robin` a bench's command line sets
RR_ARGS = ("rounds", "sample_ms", "calls", "min_calls", "max_calls", "warmup", "graph")


def rr_settings(args) -> dict:
    """:func:`round_robin`'s keyword arguments from a bench's parsed command line: those of
    ``RR_ARGS`` that ``args`` has (also what the bench records as its timer)."""
    return {k: getattr(args, k) for k in RR_ARGS if hasattr(args, k)}


def median_ms(fn, reps: int, warmup: int = 5, *, cuda: bool = True, isolated: bool = False):
    """Median milliseconds per call of ``fn()`` over ``reps`` calls after ``warmup`` calls.

    CUDA (``cuda=True``): CUDA events around each call, calls issued back to back with no
    host sync between them (as in a training step, and as triton's do_bench does), so
    the host's launch cost is hidden whenever it is shorter than the GPU work; with
    ``isolated`` the host waits for each call to finish before issuing the next, which
    puts the launch latency inside every timed call. CPU: ``time.perf_counter`` around
    each call (the work runs on the calling thread). Several implementations of one
    product compared with each other: ``round_robin``."""
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
