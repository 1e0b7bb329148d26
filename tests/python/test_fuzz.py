"""Fuzzing the public API with hypothesis: valid and invalid inputs (shapes, zero
sizes, dtypes, strides, offsets, out buffers, lists of the wrong length, non-tensors).

valid   -> the result (and gradients) match the float64 reference;
invalid -> ValueError / TypeError / RuntimeError whose message names the argument, and
           a given ``out`` buffer is left bitwise untouched.

Examples: ``conftest.FUZZ_EXAMPLES`` (4000 with ``CI`` set, 200 otherwise; override with
``GROUPMM_FUZZ_EXAMPLES``). Runs on cpu and, when present, cuda.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import pytest
import torch
from conftest import DEVICES, FUZZ_EXAMPLES, I32, TOL, ref_list, ref_packed
from groupmm import grouped_mm
from hypothesis import given, settings
from hypothesis import strategies as st

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DIM = st.one_of(st.just(0), st.just(1), st.integers(2, 16))
SENTINEL = 4321.0
NP_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}

PACKED_MUTATIONS = [
    "a_ndim",
    "b_ndim",
    "k_mismatch",
    "groups",
    "offs_dtype",
    "offs_ndim",
    "offs_decreasing",
    "offs_negative",
    "offs_past_end",
    "offs_missing_or_extra",
    "offs_not_tensor",
    "dtype_mix",
    "dtype_unsupported",
    "a_sparse",
    "a_not_tensor",
    "b_not_tensor",
    "out_dtype_bad",
    "out_shape",
    "out_dtype",
    "out_with_grad",
    "out_overlap",
    "bias",
]
LIST_MUTATIONS = [
    "length",
    "entry_ndim",
    "k_mismatch",
    "dtype_mix",
    "entry_not_tensor",
    "bs_not_list",
    "offs_given",
    "out_length",
    "out_shape",
    "out_dtype_bad",
]
HOST_ONLY = {"offs_decreasing", "offs_negative", "offs_past_end"}  # cuda never reads offs


class Case:
    def __init__(self) -> None:
        self.call_kw: dict = {}
        self.expect: Optional[str] = None  # argument the error must name; None = valid
        self.out: Any = None
        self.numpy = False

    def __repr__(self) -> str:
        def d(x):
            if isinstance(x, torch.Tensor):
                return f"T{list(x.shape)}{x.stride()}{x.dtype}{'+g' if x.requires_grad else ''}"
            if isinstance(x, (list, tuple)):
                return "[" + ", ".join(d(v) for v in x) + "]"
            return repr(x)

        return f"Case({self.form}, args={d(self.args)}, kw={d(list(self.kw.items()))}, " + (
            f"expect={self.expect}, numpy={self.numpy})"
        )


def _layout(draw, t: torch.Tensor) -> torch.Tensor:
    """The same values (or, for 'expanded', values broadcast along dim 0) in a
    non-contiguous layout."""
    how = draw(st.sampled_from(["contig", "contig", "transposed", "sliced", "expanded", "neg"]))
    if how == "neg":  # a lazily negated view of -t: the values of t
        return torch._neg_view(t.neg())
    if how == "transposed" and t.dim() >= 2:
        return t.mT.contiguous().mT
    if how == "sliced" and t.dim() >= 2:
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype, device=t.device)
        view = big[..., 1::2]
        view.copy_(t)
        return view
    if how == "expanded" and t.shape[0] > 1:
        return t[:1].expand_as(t)
    return t


def _rnd(gen, shape, dtype, device):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


def _offs(draw, groups: int, extent: int, device) -> torch.Tensor:
    ends = sorted(draw(st.lists(st.integers(0, extent), min_size=groups, max_size=groups)))
    if groups and draw(st.booleans()):
        ends[-1] = extent
    return torch.tensor(ends, dtype=I32, device=device)


def _other_dtype(draw, dtype):
    return draw(st.sampled_from([d for d in FLOATS if d != dtype]))


@st.composite
def packed_case(draw, device: str):
    c = Case()
    form = draw(st.sampled_from(["2d3d", "2d2d", "3d2d", "3d3d"]))
    dtype = draw(st.sampled_from(FLOATS))
    g = draw(st.integers(0, 5))
    m, n, k, extent = draw(DIM), draw(DIM), draw(DIM), draw(DIM)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if form == "2d3d":
        a, b = _rnd(gen, (extent, k), dtype, device), _rnd(gen, (g, k, n), dtype, device)
    elif form == "2d2d":
        a, b = _rnd(gen, (m, extent), dtype, device), _rnd(gen, (extent, n), dtype, device)
    elif form == "3d2d":
        a, b = _rnd(gen, (g, m, k), dtype, device), _rnd(gen, (k, extent), dtype, device)
    else:
        a, b = _rnd(gen, (g, m, k), dtype, device), _rnd(gen, (g, k, n), dtype, device)
    offs = None if form == "3d3d" else _offs(draw, g, extent, device)
    a, b = _layout(draw, a), _layout(draw, b)
    out_dtype = None
    if dtype in (torch.float16, torch.bfloat16) and draw(st.booleans()):
        out_dtype = torch.float32
    out_shape = list(ref_packed(a.cpu(), b.cpu(), None if offs is None else offs.cpu()).shape)
    use_out = draw(st.booleans())
    out = None
    if use_out:
        out = torch.full(out_shape, SENTINEL, dtype=out_dtype or dtype, device=device)
        if out.dim() >= 2 and draw(st.booleans()):
            out = out.mT.contiguous().mT
    want_grad = not use_out and draw(st.booleans())
    c.numpy = device == "cpu" and dtype in NP_DTYPES and not want_grad and draw(st.booleans())

    mutation = draw(st.sampled_from([None] * 8 + PACKED_MUTATIONS))
    if device != "cpu" and mutation in HOST_ONLY:
        mutation = None
    ends = [] if offs is None else offs.tolist()
    kw: dict = {}
    if mutation == "a_ndim":
        a, c.expect = (a.reshape(-1) if a.dim() == 2 else a[None]), "a"
    elif mutation == "b_ndim":
        b, c.expect = (b.reshape(-1) if b.dim() == 2 else b[None]), "b"
    elif mutation == "k_mismatch":
        shape = list(b.shape)
        shape[-2] += 1
        b, c.expect = _rnd(gen, shape, dtype, device), "b"
    elif mutation == "groups" and form != "2d2d":
        if form == "3d2d":
            a, c.expect = _rnd(gen, (g + 1, *a.shape[1:]), dtype, device), "a"
        else:
            b, c.expect = _rnd(gen, (g + 1, *b.shape[1:]), dtype, device), "b"
    elif mutation == "offs_dtype" and offs is not None:
        offs = offs.to(draw(st.sampled_from([torch.int64, torch.float32, torch.int16])))
        c.expect = "offs"
    elif mutation == "offs_ndim" and offs is not None:
        offs, c.expect = (offs[None] if draw(st.booleans()) or g == 0 else offs[0]), "offs"
    elif mutation == "offs_decreasing" and offs is not None and g >= 2:
        e = list(ends)
        e[0] = e[1] + 1
        offs, c.expect = torch.tensor(e, dtype=I32, device=device), "offs"
    elif mutation == "offs_negative" and offs is not None and g >= 1:
        e = list(ends)
        e[0] = -draw(st.integers(1, 2**31 - 1))
        offs, c.expect = torch.tensor(e, dtype=I32, device=device), "offs"
    elif mutation == "offs_past_end" and offs is not None and g >= 1:
        e = list(ends)
        e[-1] = extent + draw(st.integers(1, 1000))
        offs, c.expect = torch.tensor(e, dtype=I32, device=device), "offs"
    elif mutation == "offs_missing_or_extra":
        if offs is None:
            offs = torch.zeros(g, dtype=I32, device=device)
        else:
            offs = None
        c.expect = "offs"
    elif mutation == "offs_not_tensor" and offs is not None:
        offs, c.expect = draw(st.sampled_from([ends, tuple(ends), 3, "offs"])), "offs"
    elif mutation == "dtype_mix":
        b, c.expect = b.to(_other_dtype(draw, dtype)), "b"
    elif mutation == "dtype_unsupported":
        bad = draw(st.sampled_from([torch.int32, torch.int64, torch.complex64, torch.bool]))
        a, b, c.expect = a.to(bad), b.to(bad), "a"
        c.numpy = False
    elif mutation == "a_sparse" and a.dim() == 2:
        a, c.expect, c.numpy = a.detach().to_sparse(), "a", False
    elif mutation == "a_not_tensor":
        a, c.expect = draw(st.sampled_from([None, 1.5, "a", object()])), "a"
    elif mutation == "b_not_tensor":
        b, c.expect = draw(st.sampled_from([None, 2, "b", object()])), "b"
    elif mutation == "out_dtype_bad":
        bad = [d for d in (*FLOATS, torch.int32) if d != dtype and d != torch.float32]
        bad += [torch.float32] if dtype == torch.float64 else []
        out_dtype, c.expect = draw(st.sampled_from(bad)), "out_dtype"
    elif mutation == "out_shape":
        shape = list(out_shape)
        shape[draw(st.integers(0, len(shape) - 1))] += 1
        out, c.expect = torch.full(shape, SENTINEL, dtype=out_dtype or dtype, device=device), "out"
    elif mutation == "out_dtype":
        od = _other_dtype(draw, out_dtype or dtype)
        out, c.expect = torch.full(out_shape, SENTINEL, dtype=od, device=device), "out"
    elif mutation == "out_with_grad" and a.numel() + b.numel() > 0:
        out = torch.full(out_shape, SENTINEL, dtype=out_dtype or dtype, device=device)
        a = a.detach().requires_grad_(True) if a.is_leaf else a.requires_grad_(True)
        c.expect, c.numpy = "out", False
    elif mutation == "out_overlap" and a.numel() > 0:
        out_numel = int(np.prod(out_shape))
        if out_numel > 0:
            # aliases a (and, when it has several elements, itself); with out_dtype the
            # dtype is wrong too: every variant names out
            stride = [0 if out_numel > 1 else 1] * len(out_shape)
            out = a.detach().as_strided(out_shape, stride, a.storage_offset())
            # (torch only: converting a negated view to numpy copies it, ending the alias)
            c.expect, c.numpy = "out", False
    elif mutation == "bias":
        kw["bias"], c.expect = torch.zeros(1, device=device), "bias"
    if c.expect and use_out is False and out is None and draw(st.booleans()):
        # a valid out buffer with an otherwise bad call must stay untouched
        if mutation != "out_with_grad":
            out = torch.full(out_shape, SENTINEL, dtype=out_dtype or dtype, device=device)
    if c.expect is None and want_grad:
        a, b = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
    c.args = [a, b, offs]
    c.kw = dict(kw, out_dtype=out_dtype, out=out)
    c.out = out
    c.form = form
    return c


@st.composite
def list_case(draw, device: str):
    c = Case()
    c.form = "list"
    dtype = draw(st.sampled_from(FLOATS))
    dims = draw(st.lists(st.tuples(DIM, DIM, DIM), min_size=0, max_size=5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    As = [_layout(draw, _rnd(gen, (m, k), dtype, device)) for m, n, k in dims]
    Bs = [_layout(draw, _rnd(gen, (k, n), dtype, device)) for m, n, k in dims]
    out_dtype = None
    if dtype in (torch.float16, torch.bfloat16) and draw(st.booleans()):
        out_dtype = torch.float32
    use_out = draw(st.booleans())
    outs = None
    if use_out:
        outs = [
            torch.full((m, n), SENTINEL, dtype=out_dtype or dtype, device=device)
            for m, n, _ in dims
        ]
    want_grad = not use_out and draw(st.booleans())
    c.numpy = device == "cpu" and dtype in NP_DTYPES and not want_grad and draw(st.booleans())
    mutation = draw(st.sampled_from([None] * 5 + LIST_MUTATIONS))
    i = draw(st.integers(0, len(dims) - 1)) if dims else None
    kw: dict = {}
    if mutation == "length" and dims:
        Bs, c.expect = Bs[:-1], "Bs"
    elif mutation == "entry_ndim" and dims:
        As = list(As)
        As[i], c.expect = As[i][None], f"As[{i}]"
    elif mutation == "k_mismatch" and dims:
        m, n, k = dims[i]
        Bs = list(Bs)
        Bs[i], c.expect = _rnd(gen, (k + 1, n), dtype, device), f"Bs[{i}]"
    elif mutation == "dtype_mix" and dims:
        Bs = list(Bs)
        Bs[i], c.expect = Bs[i].to(_other_dtype(draw, dtype)), f"Bs[{i}]"
    elif mutation == "entry_not_tensor" and dims:
        Bs = list(Bs)
        Bs[i], c.expect = draw(st.sampled_from([None, 1.0, "x"])), f"Bs[{i}]"
    elif mutation == "bs_not_list" and dims:
        Bs, c.expect = Bs[0], "Bs"
    elif mutation == "offs_given":
        kw["offs"], c.expect = torch.zeros(len(dims), dtype=I32, device=device), "offs"
    elif mutation == "out_length" and dims:
        full = [
            torch.full((m, n), SENTINEL, dtype=out_dtype or dtype, device=device)
            for m, n, _ in dims
        ]
        outs, c.expect = full + full[:1], "out"
    elif mutation == "out_shape" and dims:
        outs = [
            torch.full((m, n), SENTINEL, dtype=out_dtype or dtype, device=device)
            for m, n, _ in dims
        ]
        outs[i] = torch.full(
            (dims[i][0] + 1, dims[i][1]), SENTINEL, dtype=outs[i].dtype, device=device
        )
        c.expect = f"out[{i}]"
    elif mutation == "out_dtype_bad" and dims:
        bad = [d for d in FLOATS if d != dtype and d != torch.float32]
        out_dtype, c.expect = draw(st.sampled_from(bad)), "out_dtype"
    if c.expect is None and want_grad:
        As = [x.detach().requires_grad_(True) for x in As]
        Bs = [x.detach().requires_grad_(True) for x in Bs]
    c.args = [As, Bs]
    c.kw = dict(kw, out_dtype=out_dtype, out=outs)
    c.out = outs
    return c


# --------------------------------------------------------------------------- checks


def _to_numpy(x):
    if isinstance(x, torch.Tensor):
        if x.dtype not in NP_DTYPES and x.dtype != I32:
            return x
        return x.detach().cpu().resolve_neg().numpy()
    if isinstance(x, (list, tuple)):
        return type(x)(_to_numpy(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_numpy(v) for k, v in x.items()}
    if isinstance(x, torch.dtype) and x in NP_DTYPES:
        return NP_DTYPES[x]
    return x


def _snapshot(out) -> List[bytes]:
    outs = out if isinstance(out, (list, tuple)) else [out]
    snaps = []
    for o in outs:
        if isinstance(o, np.ndarray):
            snaps.append(o.tobytes())
        elif isinstance(o, torch.Tensor):
            dense = torch.empty(o.shape, dtype=o.dtype).copy_(o.detach().cpu())
            snaps.append(dense.reshape(-1).view(torch.uint8).numpy().tobytes())
    return snaps


def _check_close(got, ref, dtype, scale):
    got = torch.as_tensor(got).detach().to(torch.float64).cpu()
    assert got.shape == ref.shape
    err = torch.linalg.vector_norm(got - ref).item()
    den = max(torch.linalg.vector_norm(ref).item(), 1e-2 * scale, 1e-30)
    assert err / den <= TOL[dtype], f"relative error {err / den:.3e} > {TOL[dtype]} ({dtype})"


def _scale(a, b, offs):
    return torch.linalg.vector_norm(ref_packed(a.abs(), b.abs(), offs)).item()


def _run(case: Case):
    args, kw = case.args, dict(case.kw)
    if case.numpy:
        args, kw = _to_numpy(args), _to_numpy(kw)
        case.out = kw["out"]
    out_dtype = case.kw["out_dtype"]
    before = _snapshot(case.out) if case.out is not None else None
    if kw.get("out") is None:
        kw.pop("out")
    if case.expect is not None:
        with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
            grouped_mm(*args, **kw)
        msg = str(info.value)
        assert case.expect in msg, f"message does not name {case.expect!r}: {msg}"
        assert "internal error" not in msg
        if before is not None:
            assert _snapshot(case.out) == before, "out was written by a failing call"
        return
    res = grouped_mm(*args, **kw)
    if case.out is not None:
        assert res is case.out or all(r is o for r, o in zip(res, case.out))
    if case.form == "list":
        As, Bs = case.args
        dt = As[0].dtype if As else torch.float64
        tol_dt = torch.float32 if out_dtype is not None else dt
        assert isinstance(res, list) and len(res) == len(As)
        refs = ref_list([x.detach().cpu() for x in As], [x.detach().cpu() for x in Bs])
        for r, ref, x, y in zip(res, refs, As, Bs):
            assert isinstance(r, np.ndarray) == case.numpy
            assert r.dtype == (_to_numpy(out_dtype or dt) if case.numpy else out_dtype or dt)
            scale = torch.linalg.vector_norm(
                x.detach().cpu().double().abs() @ y.detach().cpu().double().abs()
            )
            _check_close(r, ref, tol_dt, scale.item())
        if not case.numpy and any(x.requires_grad for x in (*As, *Bs)) and As:
            _check_list_grads(res, As, Bs, dt)
        return
    a, b, offs = case.args
    ca, cb = a.detach().cpu(), b.detach().cpu()
    co = None if offs is None else offs.cpu()
    ref = ref_packed(ca, cb, co)
    assert isinstance(res, np.ndarray) == case.numpy
    tol_dt = torch.float32 if out_dtype is not None else a.dtype
    _check_close(res, ref, tol_dt, _scale(ca, cb, co))
    if isinstance(res, torch.Tensor) and a.requires_grad:
        go = torch.randn(res.shape, dtype=torch.float64)
        da, db = torch.autograd.grad(res, (a, b), go.to(res.dtype).to(res.device))
        assert da.dtype == a.dtype and db.dtype == b.dtype
        g = go.to(res.dtype).to(a.dtype).double()  # the backward runs in a's dtype
        ga, gb = _ref_grads(ca.double(), cb.double(), co, g)
        sa, sb = _ref_grads(ca.double().abs(), cb.double().abs(), co, g.abs())
        _check_close(da, ga, a.dtype, torch.linalg.vector_norm(sa).item())
        _check_close(db, gb, a.dtype, torch.linalg.vector_norm(sb).item())


def _ref_grads(a, b, offs, g):
    a, b = a.requires_grad_(True), b.requires_grad_(True)
    ref = ref_packed(a, b, offs)
    if not ref.requires_grad:
        return torch.zeros_like(a), torch.zeros_like(b)
    ga, gb = torch.autograd.grad(ref, (a, b), g, allow_unused=True)
    return (
        torch.zeros_like(a) if ga is None else ga,
        torch.zeros_like(b) if gb is None else gb,
    )


def _check_list_grads(res, As, Bs, dt):
    gos = [torch.randn(r.shape, dtype=torch.float64).to(r.dtype).to(r.device) for r in res]
    loss = sum((r.double() * g.double()).sum() for r, g in zip(res, gos))
    grads = torch.autograd.grad(loss, [*As, *Bs])
    for i, (a, b, go) in enumerate(zip(As, Bs, gos)):
        # the backward runs in the inputs' dtype: the gradient is rounded to it first
        ca, cb, g = a.detach().cpu().double(), b.detach().cpu().double(), go.cpu().to(dt).double()
        ga, gb = g @ cb.mT, ca.mT @ g
        assert grads[i].dtype == dt
        sa = torch.linalg.vector_norm(g.abs() @ cb.abs().mT).item()
        sb = torch.linalg.vector_norm(ca.abs().mT @ g.abs()).item()
        _check_close(grads[i], ga, dt, sa)
        _check_close(grads[len(As) + i], gb, dt, sb)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=FUZZ_EXAMPLES, deadline=None)
@given(data=st.data())
def test_fuzz_public_api(device, data):
    strategy = st.one_of(packed_case(device), list_case(device))
    _run(data.draw(strategy))
