"""numpy inputs (list and packed forms; float16/32/64) return numpy arrays equal to
numpy references."""

from __future__ import annotations

import numpy as np
import pytest
from groupmm import grouped_mm

NP_TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


def _ref_packed(a, b, offs):
    a, b = a.astype(np.float64), b.astype(np.float64)
    ends = [] if offs is None else [int(v) for v in offs]
    if a.ndim == 2 and b.ndim == 3:
        out, s = np.zeros((a.shape[0], b.shape[2])), 0
        for g, e in enumerate(ends):
            out[s:e] = a[s:e] @ b[g]
            s = e
        return out
    if a.ndim == 2 and b.ndim == 2:
        out, s = np.zeros((len(ends), a.shape[0], b.shape[1])), 0
        for g, e in enumerate(ends):
            out[g] = a[:, s:e] @ b[s:e]
            s = e
        return out
    if a.ndim == 3 and b.ndim == 2:
        out, s = np.zeros((a.shape[1], b.shape[1])), 0
        for g, e in enumerate(ends):
            out[:, s:e] = a[g] @ b[:, s:e]
            s = e
        return out
    return np.einsum("gmk,gkn->gmn", a, b)


def _rel(x, ref):
    den = np.linalg.norm(ref)
    err = np.linalg.norm(x.astype(np.float64) - ref)
    return err / den if den > 0 else err


def _problems(rng, dt):
    def r(*s):
        return rng.standard_normal(s).astype(dt)

    i32 = np.int32
    return [
        (r(20, 8), r(3, 8, 5), np.array([4, 4, 15], i32)),
        (r(6, 20), r(20, 5), np.array([0, 9, 17], i32)),
        (r(3, 6, 7), r(7, 20), np.array([5, 5, 18], i32)),
        (r(3, 6, 7), r(3, 7, 4), None),
        (r(9, 0), r(2, 0, 3), np.array([3, 9], i32)),
    ]


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64], ids=lambda d: d.__name__)
def test_packed_numpy(dt):
    rng = np.random.default_rng(0)
    for a, b, offs in _problems(rng, dt):
        out = grouped_mm(a, b, offs=offs)
        assert isinstance(out, np.ndarray) and out.dtype == dt
        ref = _ref_packed(a, b, offs)
        assert out.shape == ref.shape
        assert _rel(out, ref) <= NP_TOL[dt]
        # strided views: reversed rows and transposed weights
        a2 = np.ascontiguousarray(a[..., ::-1, :])[..., ::-1, :]
        b2 = np.swapaxes(np.ascontiguousarray(np.swapaxes(b, -1, -2)), -1, -2)
        np.testing.assert_array_equal(grouped_mm(a2, b2, offs=offs), out)
        # out=
        buf = np.full(ref.shape, 7, dtype=dt)
        res = grouped_mm(a, b, offs=offs, out=buf)
        assert res is buf
        np.testing.assert_array_equal(buf, out)


def test_numpy_out_dtype_float32_from_float16():
    rng = np.random.default_rng(1)
    a, b, offs = _problems(rng, np.float16)[0]
    out = grouped_mm(a, b, offs=offs, out_dtype=np.float32)
    assert out.dtype == np.float32
    assert _rel(out, _ref_packed(a, b, offs)) <= NP_TOL[np.float32]


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64], ids=lambda d: d.__name__)
def test_list_numpy(dt):
    rng = np.random.default_rng(2)
    dims = [(4, 5, 6), (0, 3, 2), (3, 0, 4), (5, 2, 0), (1, 1, 1)]
    As = [rng.standard_normal((m, k)).astype(dt) for m, n, k in dims]
    Bs = [rng.standard_normal((k, n)).astype(dt) for m, n, k in dims]
    outs = grouped_mm(As, Bs)
    assert isinstance(outs, list) and len(outs) == len(dims)
    for o, a, b in zip(outs, As, Bs):
        assert isinstance(o, np.ndarray) and o.dtype == dt
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert o.shape == ref.shape
        assert _rel(o, ref) <= NP_TOL[dt]
    bufs = [np.full(o.shape, 3, dtype=dt) for o in outs]
    res = grouped_mm(As, Bs, out=bufs)
    for r, buf, o in zip(res, bufs, outs):
        assert r is buf
        np.testing.assert_array_equal(buf, o)


def test_numpy_non_contiguous_out():
    rng = np.random.default_rng(3)
    a, b, offs = _problems(rng, np.float64)[0]
    big = np.full((5, 20, 2), 9.0)
    view = big[:, :, 0].T  # [20, 5], strides (16, 320)
    grouped_mm(a, b, offs=offs, out=view)
    np.testing.assert_allclose(view, _ref_packed(a, b, offs), rtol=1e-12, atol=1e-12)
    assert (big[:, :, 1] == 9.0).all()
