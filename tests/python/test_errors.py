"""A catalogue of bad inputs: each raises ValueError/TypeError/RuntimeError whose message
names the offending argument, and leaves any ``out`` buffer bitwise untouched."""

from __future__ import annotations

from typing import Callable, List, NamedTuple

import numpy as np
import pytest
import torch
from groupmm import grouped_mm

I32 = torch.int32
SENTINEL = -1234.5


class Bad(NamedTuple):
    call: Callable[[], object]
    exc: type
    name: str  # must appear in the message
    bufs: List  # buffers that must stay bitwise untouched


CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def sentinel(*shape, dtype=torch.float32):
    return torch.full(shape, SENTINEL, dtype=dtype)


def x_w_offs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=gen).to(dtype)
    w = torch.randn(3, 4, 5, generator=gen).to(dtype)
    return x, w, torch.tensor([2, 2, 7], dtype=I32)


def packed(exc, name, a, b, offs, out=None, **kw):
    out = sentinel(10, 5) if out is None else out
    return Bad(lambda: grouped_mm(a, b, offs=offs, out=out, **kw), exc, name, [out])


# ---------------------------------------------------------------- shapes / ndim


@case
def a_1d():
    x, w, o = x_w_offs()
    return packed(ValueError, "a", x[:, 0], w, o)


@case
def a_4d():
    x, w, o = x_w_offs()
    return packed(ValueError, "a", x[None, None], w, o)


@case
def a_0d():
    x, w, o = x_w_offs()
    return packed(ValueError, "a", x[0, 0], w, o)


@case
def b_1d():
    x, w, o = x_w_offs()
    return packed(ValueError, "b", x, w[0, 0], o)


@case
def b_4d():
    x, w, o = x_w_offs()
    return packed(ValueError, "b", x, w[None], o)


@case
def k_mismatch_rows_form():
    x, w, o = x_w_offs()
    return packed(ValueError, "b", x, w[:, :3], o)


@case
def groups_not_len_offs():
    x, w, o = x_w_offs()
    return packed(ValueError, "b", x, w[:2], o)


@case
def groups_not_len_offs_columns_form():
    a, b = torch.randn(2, 4, 6), torch.randn(6, 10)
    out = sentinel(4, 10)
    return packed(ValueError, "a", a, b, torch.tensor([1, 2, 3], dtype=I32), out)


@case
def k_mismatch_columns_form():
    a, b = torch.randn(3, 4, 6), torch.randn(5, 10)
    return packed(ValueError, "b", a, b, torch.tensor([1, 2, 3], dtype=I32), sentinel(4, 10))


@case
def t_mismatch_reduction_form():
    a, b = torch.randn(4, 10), torch.randn(9, 5)
    return packed(ValueError, "b", a, b, torch.tensor([1, 2, 3], dtype=I32), sentinel(3, 4, 5))


@case
def batched_group_mismatch():
    a, b = torch.randn(3, 4, 6), torch.randn(2, 6, 5)
    return packed(ValueError, "b", a, b, None, sentinel(3, 4, 5))


# ---------------------------------------------------------------- offs


@case
def offs_int64():
    x, w, o = x_w_offs()
    return packed(TypeError, "offs", x, w, o.long())


@case
def offs_float():
    x, w, o = x_w_offs()
    return packed(TypeError, "offs", x, w, o.float())


@case
def offs_2d():
    x, w, o = x_w_offs()
    return packed(ValueError, "offs", x, w, o[None])


@case
def offs_0d():
    x, w, o = x_w_offs()
    return packed(ValueError, "offs", x, w, o[0])


@case
def offs_decreasing():
    x, w, _ = x_w_offs()
    return packed(ValueError, "offs", x, w, torch.tensor([2, 7, 5], dtype=I32))


@case
def offs_negative():
    x, w, _ = x_w_offs()
    return packed(ValueError, "offs", x, w, torch.tensor([-1, 2, 7], dtype=I32))


@case
def offs_past_the_end():
    x, w, _ = x_w_offs()
    return packed(ValueError, "offs", x, w, torch.tensor([2, 2, 11], dtype=I32))


@case
def offs_past_the_end_columns_form():
    a, b = torch.randn(3, 4, 6), torch.randn(6, 10)
    return packed(ValueError, "offs", a, b, torch.tensor([1, 2, 30], dtype=I32), sentinel(4, 10))


@case
def offs_missing():
    x, w, _ = x_w_offs()
    return packed(ValueError, "offs", x, w, None)


@case
def offs_given_for_batched():
    a, b = torch.randn(3, 4, 6), torch.randn(3, 6, 5)
    return packed(ValueError, "offs", a, b, torch.tensor([1, 2, 3], dtype=I32), sentinel(3, 4, 5))


@case
def offs_python_list():
    x, w, _ = x_w_offs()
    return packed(TypeError, "offs", x, w, [2, 2, 7])


@case
def offs_numpy_with_tensors():
    x, w, o = x_w_offs()
    return packed(TypeError, "offs", x, w, o.numpy())


@case
def offs_on_meta():
    x, w, o = x_w_offs()
    return packed(RuntimeError, "offs", x, w, o.to("meta"))


# ---------------------------------------------------------------- dtypes / types


@case
def mixed_dtypes():
    x, w, o = x_w_offs()
    return packed(TypeError, "b", x, w.double(), o)


@case
def int64_inputs():
    x, w, o = x_w_offs()
    return packed(TypeError, "a", x.long(), w.long(), o, torch.zeros(10, 5, dtype=torch.long))


@case
def complex_inputs():
    x, w, o = x_w_offs()
    c = torch.complex64
    return packed(TypeError, "a", x.to(c), w.to(c), o, torch.zeros(10, 5, dtype=c))


@case
def bool_inputs():
    x, w, o = x_w_offs()
    return packed(TypeError, "a", x > 0, w, o)


@case
def a_not_a_tensor():
    _, w, o = x_w_offs()
    return packed(TypeError, "a", 3, w, o)


@case
def a_none():
    _, w, o = x_w_offs()
    return packed(TypeError, "a", None, w, o)


@case
def b_not_a_tensor():
    x, _, o = x_w_offs()
    return packed(TypeError, "b", x, "w", o)


@case
def numpy_a_torch_b():
    x, w, o = x_w_offs()
    return packed(TypeError, "b", x.numpy(), w, o.numpy(), np.full((10, 5), 1.0, np.float32))


@case
def torch_a_numpy_b():
    x, w, o = x_w_offs()
    return packed(TypeError, "b", x, w.numpy(), o)


@case
def out_dtype_float16_from_float32():
    x, w, o = x_w_offs()
    return packed(TypeError, "out_dtype", x, w, o, out_dtype=torch.float16)


@case
def out_dtype_float32_from_float64():
    x, w, o = x_w_offs(torch.float64)
    out = sentinel(10, 5, dtype=torch.float64)
    return packed(TypeError, "out_dtype", x, w, o, out, out_dtype=torch.float32)


@case
def out_dtype_not_a_dtype():
    x, w, o = x_w_offs()
    return packed(TypeError, "out_dtype", x, w, o, out_dtype="float32")


@case
def out_dtype_int():
    x, w, o = x_w_offs()
    return packed(TypeError, "out_dtype", x, w, o, out_dtype=torch.int32)


@case
def numpy_out_dtype_torch_dtype():
    x, w, o = x_w_offs()
    buf = np.full((10, 5), 1.0, np.float32)
    return packed(TypeError, "out_dtype", x.numpy(), w.numpy(), o.numpy(), buf, out_dtype=object)


# ---------------------------------------------------------------- out=


@case
def out_wrong_shape():
    x, w, o = x_w_offs()
    return packed(ValueError, "out", x, w, o, sentinel(10, 6))


@case
def out_wrong_dtype():
    x, w, o = x_w_offs()
    return packed(TypeError, "out", x, w, o, sentinel(10, 5, dtype=torch.float64))


@case
def out_wrong_dtype_with_out_dtype():
    x, w, o = x_w_offs(torch.bfloat16)
    out = sentinel(10, 5, dtype=torch.bfloat16)
    return packed(TypeError, "out", x, w, o, out, out_dtype=torch.float32)


@case
def out_overlaps_input():
    _, w, o = x_w_offs()
    big = torch.randn(10, 9)
    snapshot = big.clone()
    bad = packed(ValueError, "out", big[:, :4], w, o, big[:, 3:8])
    return bad._replace(bufs=[(big, snapshot)])


@case
def out_overlaps_itself():
    x, w, o = x_w_offs()
    return packed(ValueError, "out", x, w, o, sentinel(1, 5).expand(10, 5))


@case
def out_with_input_requiring_grad():
    x, w, o = x_w_offs()
    return packed(RuntimeError, "out", x.requires_grad_(True), w, o)


@case
def out_requiring_grad():
    x, w, o = x_w_offs()
    return packed(RuntimeError, "out", x, w, o, sentinel(10, 5).requires_grad_(True))


@case
def out_numpy_for_tensors():
    x, w, o = x_w_offs()
    return packed(TypeError, "out", x, w, o, np.full((10, 5), SENTINEL, np.float32))


@case
def out_tensor_for_numpy():
    x, w, o = x_w_offs()
    return packed(TypeError, "out", x.numpy(), w.numpy(), o.numpy(), sentinel(10, 5))


@case
def out_read_only_numpy():
    x, w, o = x_w_offs()
    buf = np.full((10, 5), SENTINEL, np.float32)
    buf.setflags(write=False)
    return packed(ValueError, "out", x.numpy(), w.numpy(), o.numpy(), buf)


@case
def out_a_list_for_packed():
    x, w, o = x_w_offs()
    return packed(TypeError, "out", x, w, o, [sentinel(10, 5)])


@case
def bias_given():
    x, w, o = x_w_offs()
    return packed(ValueError, "bias", x, w, o, bias=torch.zeros(5))


@case
def meta_device():
    x, w, o = x_w_offs()
    return packed(RuntimeError, "a", x.to("meta"), w.to("meta"), o.to("meta"))


@case
def mixed_devices_meta_b():
    x, w, o = x_w_offs()
    return packed(RuntimeError, "b", x, w.to("meta"), o)


@case
def sparse_a():
    x, w, o = x_w_offs()
    return packed(TypeError, "a", x.to_sparse(), w, o)


@case
def sparse_b():
    x, w, o = x_w_offs()
    return packed(TypeError, "b", x, w.to_sparse(), o)


@case
def sparse_csr_list_entry():
    As, Bs, outs = list_ops()
    return listed(TypeError, "Bs[0]", As, [Bs[0].to_sparse_csr(), Bs[1]], outs)


@case
def out_lazily_negated():
    x, w, o = x_w_offs()
    base = sentinel(10, 5)
    snapshot = base.clone()
    bad = packed(ValueError, "out", x, w, o, torch._neg_view(base))
    return bad._replace(bufs=[(base, snapshot)])


@case
def out_inference_tensor_outside_inference_mode():
    x, w, o = x_w_offs()
    with torch.inference_mode():
        out = sentinel(10, 5)
    return packed(RuntimeError, "out", x, w, o, out)


@case
def list_out_inference_tensor():
    As, Bs, outs = list_ops()
    with torch.inference_mode():
        outs[1] = sentinel(5, 1)
    return listed(RuntimeError, "out[1]", As, Bs, outs)


@case
def list_sparse_entry():
    As, Bs, outs = list_ops()
    return listed(TypeError, "As[1]", [As[0], As[1].to_sparse()], Bs, outs)


# ---------------------------------------------------------------- list form


def list_ops(dims=((2, 3, 4), (5, 1, 2))):
    gen = torch.Generator().manual_seed(1)
    As = [torch.randn(m, k, generator=gen) for m, n, k in dims]
    Bs = [torch.randn(k, n, generator=gen) for m, n, k in dims]
    outs = [sentinel(m, n) for m, n, k in dims]
    return As, Bs, outs


def listed(exc, name, As, Bs, outs, **kw):
    return Bad(lambda: grouped_mm(As, Bs, out=outs, **kw), exc, name, list(outs))


@case
def list_length_mismatch():
    As, Bs, outs = list_ops()
    return listed(ValueError, "Bs", As, Bs[:1], outs)


@case
def list_3d_entry():
    As, Bs, outs = list_ops()
    return listed(ValueError, "As[1]", [As[0], As[1][None]], Bs, outs)


@case
def list_k_mismatch():
    As, Bs, outs = list_ops()
    return listed(ValueError, "Bs[1]", As, [Bs[0], Bs[1][:1]], outs)


@case
def list_dtype_differs_between_groups():
    As, Bs, outs = list_ops()
    return listed(TypeError, "As[1]", [As[0], As[1].double()], [Bs[0], Bs[1].double()], outs)


@case
def list_bs_not_a_list():
    As, Bs, outs = list_ops()
    return listed(TypeError, "Bs", As, Bs[0], outs)


@case
def list_entry_not_a_tensor():
    As, Bs, outs = list_ops()
    return listed(TypeError, "Bs[0]", As, [1.0, Bs[1]], outs)


@case
def list_numpy_and_torch():
    As, Bs, _ = list_ops()
    outs = [np.full((2, 4), 1.0, np.float32), np.full((5, 1), 1.0, np.float32)]
    return listed(TypeError, "Bs[0]", [a.numpy() for a in As], Bs, outs)


@case
def list_offs_given():
    As, Bs, outs = list_ops()
    return listed(ValueError, "offs", As, Bs, outs, offs=torch.tensor([1, 2], dtype=I32))


@case
def list_bad_out_dtype():
    As, Bs, outs = list_ops()
    return listed(TypeError, "out_dtype", As, Bs, outs, out_dtype=torch.float16)


@case
def list_out_wrong_length():
    As, Bs, outs = list_ops()
    return Bad(lambda: grouped_mm(As, Bs, out=outs[:1]), ValueError, "out", outs)


@case
def list_out_wrong_shape():
    As, Bs, outs = list_ops()
    outs[1] = sentinel(5, 2)
    return listed(ValueError, "out[1]", As, Bs, outs)


@case
def list_out_wrong_dtype():
    As, Bs, outs = list_ops()
    outs[0] = sentinel(2, 4, dtype=torch.float64)
    return listed(TypeError, "out[0]", As, Bs, outs)


@case
def list_out_a_tensor():
    As, Bs, outs = list_ops()
    return Bad(lambda: grouped_mm(As, Bs, out=outs[0]), TypeError, "out", outs)


@case
def list_out_entry_not_a_tensor():
    As, Bs, outs = list_ops()
    return Bad(lambda: grouped_mm(As, Bs, out=[outs[0], 3]), TypeError, "out[1]", outs)


@case
def list_outs_alias_each_other():
    As, Bs, outs = list_ops(((2, 3, 4), (2, 3, 4)))
    return listed(ValueError, "out[1]", As, Bs, [outs[0], outs[0]])


@case
def list_out_overlaps_input():
    As, Bs, outs = list_ops(((2, 3, 4), (2, 3, 4)))
    snapshot = As[1].clone()
    bad = listed(ValueError, "out[1]", As, Bs, [outs[0], As[1][:, :3]])
    return bad._replace(bufs=[outs[0], (As[1], snapshot)])


@case
def list_with_grad_and_out():
    As, Bs, outs = list_ops()
    As[0].requires_grad_(True)
    return listed(RuntimeError, "out", As, Bs, outs)


@case
def list_on_meta():
    As, Bs, outs = list_ops()
    return listed(RuntimeError, "As[0]", [a.to("meta") for a in As], Bs, outs)


# ---------------------------------------------------------------- the test


def test_catalogue_is_large():
    assert len(CASES) >= 20


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name):
    bad = CASES[name]()
    snapshots = []
    bufs = [x for b in bad.bufs for x in (b if isinstance(b, list) else [b])]
    for buf in bufs:
        if isinstance(buf, tuple):  # (buffer, snapshot taken before the inputs were cut)
            snapshots.append(buf)
        elif isinstance(buf, np.ndarray):
            snapshots.append((buf, buf.copy()))
        else:
            snapshots.append((buf, buf.detach().clone()))
    with pytest.raises((ValueError, TypeError, RuntimeError)) as info:
        bad.call()
    assert isinstance(info.value, bad.exc), f"{type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert bad.name in msg, f"message does not name {bad.name!r}: {msg}"
    assert "internal error" not in msg and "panic" not in msg
    for buf, snap in snapshots:
        if isinstance(buf, np.ndarray):
            assert buf.tobytes() == snap.tobytes(), "out buffer was written"
        else:
            same = torch.equal(buf.detach().view(torch.uint8), snap.view(torch.uint8))
            assert same, "out buffer was written"
