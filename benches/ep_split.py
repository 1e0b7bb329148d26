"""bench_ep.py's split of an EP step into dispatch, experts and combine (bench_ep.py's
docstring, "The split"): timestamps on the GPU's timeline or the host's (:class:`Clock`),
identity autograd functions that stamp the boundaries when the forward and the gradient
pass them (:class:`Split`, ``mark``), the phases of one step from its stamps
(:func:`phases_of`) and the marks put around the local experts of groupmm's two EP paths
(:func:`install_split`).
"""

from __future__ import annotations

from typing import Any

import groupmm._fixed as gfixed
import groupmm.moe as gmoe
import groupmm.parallel as gpar
import torch


def _ready(t):
    """A functional collective's result waited on (its wait is enqueued before a stamp)."""
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


class _Mark(torch.autograd.Function):
    """Identity that stamps ``fwd`` when the forward passes it and ``bwd`` when the
    gradient does."""

    @staticmethod
    def forward(ctx: Any, t, split, fwd: str, bwd: str):
        ctx.split, ctx.bwd = split, bwd
        r = _ready(t)
        out = r.view(r.shape)
        split.stamp(fwd)
        return out

    @staticmethod
    def backward(ctx: Any, grad):
        grad = _ready(grad)
        ctx.split.stamp(ctx.bwd)
        return grad, None, None, None


class Split:
    """The stamps of the step being timed: ``t0`` (start), ``f1``/``b1`` (received rows,
    forward/backward), ``f2``/``b2`` (expert output), ``f3`` (end of the forward), ``t1``
    (end of the backward). Outside ``begin() ... end()`` marks are plain identities."""

    def __init__(self, clock, enabled: bool = True):
        self.clock, self.enabled, self.cur = clock, enabled, None

    def begin(self) -> None:
        self.cur = {"t0": self.clock.stamp()}

    def end(self) -> dict:
        assert self.cur is not None
        self.cur["t1"] = self.clock.stamp()
        out, self.cur = self.cur, None
        return out

    def stamp(self, name: str) -> None:
        if self.cur is not None:
            self.cur[name] = self.clock.stamp()

    def mark(self, t, fwd: str, bwd: str):
        if self.cur is None or not self.enabled or not torch.is_tensor(t):
            return t
        return _Mark.apply(t, self, fwd, bwd)


def phases_of(ms, st: dict, ep: bool = True) -> dict:
    """One step's ``{"step", "dispatch", "experts", "combine"}`` ms from its stamps
    (``ms(a, b)``: ms between two stamps); an EP step missing a boundary has only
    ``step``; a non-EP step (``ep=False``) is all experts (no dispatch, no combine)."""
    out = {"step": ms(st["t0"], st["t1"])}
    if not ep:
        out["experts"] = out["step"]
        return out
    if not all(k in st for k in ("f1", "f2", "f3", "b2", "b1")):
        return out
    out["dispatch"] = ms(st["t0"], st["f1"]) + ms(st["b1"], st["t1"])
    out["experts"] = ms(st["f1"], st["f2"]) + ms(st["b2"], st["b1"])
    out["combine"] = ms(st["f2"], st["f3"]) + ms(st["f3"], st["b2"])
    return out


def install_split(split: Split) -> None:
    """Put the local experts of both groupmm EP paths between the two marks: the
    local-experts callable of ``groupmm.parallel.dispatch_combine`` (MoELayer's unfused EP
    path) and ``groupmm.parallel._block`` (the fused one, ``expert_parallel_block``, with
    exact and with fixed sizes alike: both call it between their exchanges)."""
    real = gpar.dispatch_combine

    def dispatch_combine(x, expert_ids, weights, num_local, experts, group=None):
        def local(received, p):
            y = experts(split.mark(received, "f1", "b1"), p)
            return split.mark(y, "f2", "b2")

        return real(x, expert_ids, weights, num_local, local, group)

    gmoe.dispatch_combine = dispatch_combine  # MoELayer's unfused EP path, imported name

    # the fused path (expert_parallel_block: one row per token and rank; exact or fixed
    # sizes) runs its local experts as parallel._block, between its exchanges
    real_block = gpar._block

    def block(x, w_in, w_out, offs, src, inverse, weights, up=None):
        x = split.mark(x, "f1", "b1")
        y = real_block(x, w_in, w_out, offs, src, inverse, weights, up)
        return split.mark(y, "f2", "b2")

    gpar._block = block  # expert_parallel_block looks it up here (exact sizes)
    gfixed._block = block  # and fixed_block here (fixed sizes)
