"""Determinism on CPU: the same inputs give bitwise-identical outputs and gradients,
run to run and whatever the number of rayon threads (each output element is computed
by one task, in a fixed order)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_list, make_packed
from groupmm import grouped_mm

DIMS = {
    "2d3d": dict(groups=6, m=0, n=96, k=160, extent=700),
    "2d2d": dict(groups=6, m=80, n=96, k=0, extent=700),
    "3d2d": dict(groups=6, m=80, n=0, k=160, extent=700),
    "3d3d": dict(groups=6, m=80, n=96, k=160, extent=0),
}


def _run_all(dtype):
    """Forward and both gradients of every form plus a list call."""
    results = []
    for form, dims in DIMS.items():
        a, b, offs = make_packed(form, **dims, dtype=dtype, seed=11)
        a.requires_grad_(True)
        b.requires_grad_(True)
        out = grouped_mm(a, b, offs=offs)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        da, db = torch.autograd.grad(out, (a, b), go)
        results += [out.detach(), da, db]
    As, Bs = make_list([(300, 200, 150), (0, 5, 5), (77, 33, 513)], dtype=dtype, seed=12)
    results += grouped_mm(As, Bs)
    return results


def _bits(t):
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bitwise_identical_run_to_run(dtype):
    first = _run_all(dtype)
    for _ in range(3):
        again = _run_all(dtype)
        assert len(first) == len(again)
        for x, y in zip(first, again):
            assert torch.equal(_bits(x), _bits(y))


def test_bitwise_identical_across_thread_counts(tmp_path):
    """A fresh process with RAYON_NUM_THREADS=1 computes the same bits as this one."""
    path = tmp_path / "one_thread.pt"
    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {here!r})
        import groupmm
        from test_determinism import _run_all, DTYPES
        assert groupmm.build_info()["cpu_threads"] == 1
        torch.save({{str(d): _run_all(d) for d in DTYPES[:2]}}, {str(path)!r})
        """
    )
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    single = torch.load(path)
    for d in DTYPES[:2]:
        for x, y in zip(_run_all(d), single[str(d)]):
            assert x.shape == y.shape
            assert torch.equal(_bits(x), _bits(y)), d
