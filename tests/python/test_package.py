"""The package's layers (python/groupmm/): the fake kernels raise the Rust shape rule's
errors (the eager messages, concrete and symbolic shapes) and keep symbolic sizes
symbolic; a compiled call reports a dtype error from the kernel; the numpy path works
without torch; the eager path never enters the dispatcher; ``GroupedMM`` works when
used directly."""

from __future__ import annotations

import subprocess
import sys

import groupmm
import groupmm._library
import numpy as np
import pytest
import torch
from conftest import I32, make_packed, ref_grads, ref_packed
from groupmm import grouped_mm
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx


def _offs(g: int | None, extent: int = 6):
    return None if g is None else torch.linspace(1, extent, g).round().to(I32)


#: (a shape, b shape, number of groups or None) that the shape rule refuses
BAD_PACKED = {
    "a-1d": ((6,), (2, 6, 3), 2),
    "a-4d": ((1, 1, 6, 4), (2, 4, 3), 2),
    "2d3d-groups": ((6, 4), (3, 4, 5), 2),
    "2d3d-k": ((6, 4), (2, 5, 5), 2),
    "2d3d-no-offs": ((6, 4), (2, 4, 5), None),
    "2d2d-t": ((3, 6), (5, 4), 2),
    "3d2d-groups": ((3, 4, 6), (6, 5), 2),
    "3d2d-k": ((2, 4, 6), (5, 6), 2),
    "3d3d-offs": ((2, 4, 6), (2, 6, 5), 2),
    "3d3d-batch": ((2, 4, 6), (3, 6, 5), None),
}

GOOD_PACKED = {
    "2d3d": ((7, 4), (2, 4, 5), 2),
    "2d2d": ((3, 7), (7, 5), 2),
    "3d2d": ((2, 3, 4), (4, 7), 2),
    "3d3d": ((2, 3, 4), (2, 4, 5), None),
}


def _eager_error(a, b, offs) -> Exception:
    with pytest.raises((ValueError, TypeError)) as e:
        grouped_mm(a, b, offs=offs)
    return e.value


@pytest.mark.parametrize("name", list(BAD_PACKED))
def test_fake_kernel_raises_the_eager_shape_error(name):
    sa, sb, g = BAD_PACKED[name]
    a, b, offs = torch.randn(sa), torch.randn(sb), _offs(g)
    eager = _eager_error(a, b, offs)
    with FakeTensorMode() as mode:
        fa, fb = mode.from_tensor(a), mode.from_tensor(b)
        fo = None if offs is None else mode.from_tensor(offs)
        for op in (
            lambda: torch.ops.groupmm.grouped_mm(fa, fb, fo, None),
            lambda: torch.ops.groupmm.grouped_mm_out(fa, fb, fo, None, fa.new_empty(1)),
        ):
            with pytest.raises(type(eager)) as fake:
                op()
            assert str(fake.value) == str(eager)


@pytest.mark.parametrize("name", list(BAD_PACKED))
def test_symbolic_trace_raises_the_eager_shape_error(name):
    sa, sb, g = BAD_PACKED[name]
    a, b, offs = torch.randn(sa), torch.randn(sb), _offs(g)
    eager = _eager_error(a, b, offs)
    with pytest.raises(type(eager)) as traced:
        make_fx(lambda a, b, o: grouped_mm(a, b, offs=o), tracing_mode="symbolic")(a, b, offs)
    assert str(traced.value) == str(eager)


@pytest.mark.parametrize("name", list(GOOD_PACKED))
def test_symbolic_trace_keeps_sizes_symbolic(name):
    sa, sb, g = GOOD_PACKED[name]
    a, b, offs = torch.randn(sa), torch.randn(sb), _offs(g)
    gm = make_fx(lambda a, b, o: grouped_mm(a, b, offs=o), tracing_mode="symbolic")(a, b, offs)
    (out,) = [n for n in gm.graph.nodes if n.op == "output"][0].args[0:1]
    shape = out.meta["val"].shape
    eager = grouped_mm(a, b, offs=offs)
    assert [int(d) for d in shape] == list(eager.shape)
    # every output size stays a symbol: the fake kernel did not specialise on a size
    assert not any(isinstance(d, int) for d in shape), shape


@pytest.mark.parametrize("name", list(GOOD_PACKED))
def test_fake_kernels_output_shapes(name):
    sa, sb, g = GOOD_PACKED[name]
    a, b, offs = torch.randn(sa), torch.randn(sb), _offs(g)
    out = grouped_mm(a, b, offs=offs)
    grad = torch.randn_like(out)
    with FakeTensorMode() as mode:
        fa, fb, fg = mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(grad)
        fo = None if offs is None else mode.from_tensor(offs)
        assert torch.ops.groupmm.grouped_mm(fa, fb, fo, None).shape == out.shape
        da, db = torch.ops.groupmm.grouped_mm_backward(fg, fa, fb, fo, True, False)
        assert da.shape == a.shape and db.shape == (0,)


def test_fake_list_kernels_raise_the_eager_errors():
    As = [torch.randn(2, 3), torch.randn(4, 5)]
    Bs = [torch.randn(3, 2), torch.randn(4, 5)]  # K of group 1 is wrong
    with pytest.raises(ValueError) as eager:
        grouped_mm(As, Bs)
    with FakeTensorMode() as mode:
        fA, fB = [mode.from_tensor(x) for x in As], [mode.from_tensor(x) for x in Bs]
        with pytest.raises(ValueError) as fake:
            torch.ops.groupmm.grouped_mm_list(fA, fB, None)
        assert str(fake.value) == str(eager.value)
        with pytest.raises(ValueError) as fake:
            torch.ops.groupmm.grouped_mm_list(fA, fB[:1], None)
        assert str(fake.value).startswith("As and Bs: expected sequences of the same length")
        good = torch.ops.groupmm.grouped_mm_list(fA[:1], fB[:1], torch.float64)
        assert [tuple(o.shape) for o in good] == [(2, 2)] and good[0].dtype == torch.float64


def test_compiled_dtype_mismatch_is_the_kernels_type_error():
    torch._dynamo.reset()
    x, w = torch.randn(6, 4), torch.randn(2, 4, 3, dtype=torch.float64)
    offs = torch.tensor([2, 6], dtype=I32)
    with pytest.raises(TypeError) as eager:
        grouped_mm(x, w, offs=offs)
    f = torch.compile(lambda x, w, o: grouped_mm(x, w, offs=o), fullgraph=True, backend="eager")
    with pytest.raises(TypeError) as compiled:
        f(x, w, offs)
    assert str(compiled.value) == str(eager.value)
    assert str(eager.value).startswith("b: expected dtype torch.float32")


def test_eager_calls_do_not_enter_the_dispatcher(monkeypatch):
    """Plain eager tensors go straight to Rust: forward, backward, no grad, out=."""

    def trap(*args, **kwargs):
        raise AssertionError("the eager path called a torch.ops.groupmm op")

    for name in ("mm_op", "mm_backward_op", "mm_out_op", "list_op", "list_backward_op"):
        monkeypatch.setattr(groupmm._library, name, trap)
    a, b, offs = make_packed("2d3d", groups=3, m=4, n=5, k=6, extent=9, offs=[2, 2, 7], seed=2)
    out = grouped_mm(a, b, offs=offs)
    grouped_mm(a, b, offs=offs, out=torch.empty_like(out))
    a.requires_grad_(True)
    b.requires_grad_(True)
    y = grouped_mm(a, b, offs=offs)
    go = torch.randn_like(y)
    da, db = torch.autograd.grad(y, (a, b), go)
    ra, rb = ref_grads(ref_packed(a, b, offs), (a, b), go)
    torch.testing.assert_close(da, ra, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(db, rb, rtol=1e-11, atol=1e-11)


def test_grouped_mm_function_called_directly():
    """``GroupedMM.apply(a, b, offs, out_dtype)`` (the public shim, outside grouped_mm)
    works, double backward included."""
    from groupmm import GroupedMM

    a, b, offs = make_packed("2d3d", groups=2, m=3, n=4, k=5, extent=6, offs=[1, 6], seed=4)
    a.requires_grad_(True)
    b.requires_grad_(True)
    y = GroupedMM.apply(a, b, offs, None)
    ref = ref_packed(a, b, offs)
    torch.testing.assert_close(y, ref, rtol=1e-11, atol=1e-11)
    go = torch.randn_like(ref)
    da, db = torch.autograd.grad(y, (a, b), go, create_graph=True)
    ra, rb = ref_grads(ref, (a, b), go)
    torch.testing.assert_close(da, ra, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(db, rb, rtol=1e-11, atol=1e-11)
    assert da.grad_fn is not None  # differentiable again (double backward)
    assert torch.autograd.gradgradcheck(lambda a, b: GroupedMM.apply(a, b, offs, None), (a, b))


def test_numpy_face_argument_rules():
    from groupmm import _numpy

    a, b = np.ones((4, 3)), np.ones((2, 3, 5))
    offs = np.array([1, 4], dtype=np.int32)
    np.testing.assert_array_equal(_numpy.grouped_mm(a, b, offs), grouped_mm(a, b, offs))
    with pytest.raises(ValueError, match="^bias: not supported"):
        _numpy.grouped_mm(a, b, offs, bias=np.ones(5))
    with pytest.raises(ValueError, match="^offs: must be None for the list form"):
        _numpy.grouped_mm([a], [b[0]], offs)
    out = _numpy.grouped_mm([a], [b[0]])
    assert isinstance(out, list) and out[0].shape == (4, 5)


def test_numpy_only_install():
    """Without torch, ``groupmm.grouped_mm`` is the numpy face and never imports torch."""
    code = """
import sys


class NoTorch:  # as if torch were not installed
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")


sys.meta_path.insert(0, NoTorch())
import numpy as np
import groupmm
from groupmm import _numpy
assert groupmm.grouped_mm is _numpy.grouped_mm
a = np.arange(12.0).reshape(4, 3)
b = np.arange(30.0).reshape(2, 3, 5)
out = groupmm.grouped_mm(a, b, np.array([1, 4], dtype=np.int32))
ref = np.concatenate([a[:1] @ b[0], a[1:] @ b[1]])
np.testing.assert_allclose(out, ref)
[o] = groupmm.grouped_mm([a], [b[0]])
np.testing.assert_allclose(o, a @ b[0])
assert "torch" not in sys.modules
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
