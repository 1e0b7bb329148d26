"""Shared helpers for the Python tests: the independent float64 reference, problem
builders, tolerances, hypothesis profiles and the ``cuda`` marker.

The reference is written from ARCHITECTURE.md's definition of each form (a per-group loop of
``@`` in float64 torch) and never calls groupmm.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import List, Optional, Sequence

# torch.compile's on-disk caches (inductor's FX graph and AOT autograd caches under
# /tmp/torchinductor_<user>) do not key on a custom op's Python body: a graph cached by
# another build of groupmm (e.g. an op called with an argument it no longer takes) would
# replay here. Each test session compiles into its own directory unless one is given.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="groupmm-inductor-"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

# --------------------------------------------------------------------------- hypothesis

settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

#: examples for the fuzz test: thousands in CI (~30 s on 2 cores), a quick pass locally
FUZZ_EXAMPLES = int(os.environ.get("GROUPMM_FUZZ_EXAMPLES", 4000 if os.environ.get("CI") else 200))

# --------------------------------------------------------------------------- devices


def _cuda_build() -> bool:
    import groupmm

    return bool(groupmm.build_info().get("cuda"))


#: a GPU and a groupmm built with CUDA (a CPU-only build refuses cuda tensors by design)
HAS_CUDA = torch.cuda.is_available() and _cuda_build()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
#: ``pytestmark`` of a module whose every test needs the GPU
CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of groupmm"),
]


def pytest_collection_modifyitems(config, items):
    """Skip ``cuda`` tests when there is no GPU."""
    if HAS_CUDA:
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU and a CUDA build of groupmm")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


# --------------------------------------------------------------------------- forms

I32 = torch.int32
F64 = torch.float64
FORMS = ["2d3d", "2d2d", "3d2d", "3d3d"]  # a.dim() b.dim(); see ARCHITECTURE.md's table
ALL_FORMS = ["list", *FORMS]

#: relative Frobenius error allowed against the float64 reference, per input dtype
TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
}


def ends_of(offs: Optional[torch.Tensor]) -> List[int]:
    return [] if offs is None else [int(v) for v in offs.cpu().tolist()]


def ref_packed(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor]) -> torch.Tensor:
    """float64 reference of a packed product, differentiable w.r.t. ``a`` and ``b``."""
    a, b = a.to(F64), b.to(F64)
    ends = ends_of(offs)
    nd = (a.dim(), b.dim())
    if nd == (2, 3):  # [T, K] x [G, K, N] -> [T, N]: group g owns rows start:end
        parts, start = [], 0
        for g, end in enumerate(ends):
            parts.append(a[start:end] @ b[g])
            start = end
        parts.append(a.new_zeros(a.shape[0] - start, b.shape[2]))
        return torch.cat(parts, 0)
    if nd == (2, 2):  # [M, T] x [T, N] -> [G, M, N]: group g reduces over start:end
        parts, start = [], 0
        for end in ends:
            parts.append(a[:, start:end] @ b[start:end])
            start = end
        if not parts:
            return a.new_zeros(0, a.shape[0], b.shape[1])
        return torch.stack(parts)
    if nd == (3, 2):  # [G, M, K] x [K, N] -> [M, N]: group g owns columns start:end
        parts, start = [], 0
        for g, end in enumerate(ends):
            parts.append(a[g] @ b[:, start:end])
            start = end
        parts.append(a.new_zeros(a.shape[1], b.shape[1] - start))
        return torch.cat(parts, 1)
    if nd == (3, 3):  # [G, M, K] x [G, K, N] -> [G, M, N]
        if a.shape[0] == 0:
            return a.new_zeros(0, a.shape[1], b.shape[2])
        return torch.stack([a[g] @ b[g] for g in range(a.shape[0])])
    raise AssertionError(f"not a form: {nd}")


def ref_list(As: Sequence[torch.Tensor], Bs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [a.to(F64) @ b.to(F64) for a, b in zip(As, Bs)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``x`` against ``ref`` (absolute when ref is ~0)."""
    x, ref = x.detach().to(F64).cpu(), ref.detach().to(F64).cpu()
    assert x.shape == ref.shape, (x.shape, ref.shape)
    num = torch.linalg.vector_norm(x - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    return num / den if den > 1e-30 else num


def assert_close_rel(
    x: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = ""
) -> None:
    err = rel_err(x, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def ref_grads(ref: torch.Tensor, inputs: Sequence[torch.Tensor], go: torch.Tensor):
    """Gradients of ``(ref * go).sum()`` w.r.t. ``inputs``, zeros where unused."""
    if not ref.requires_grad:
        return [torch.zeros_like(t) for t in inputs]
    gs = torch.autograd.grad(ref, list(inputs), go, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(gs, inputs)]


def grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t) if t.grad is None else t.grad


# --------------------------------------------------------------------------- builders


def random_offs(gen: torch.Generator, groups: int, extent: int, full: bool = False) -> torch.Tensor:
    """Sorted random group ends in 0..=extent (repeats = empty groups; last < extent
    leaves a tail); ``full`` makes the last end equal ``extent``."""
    if groups == 0:
        return torch.zeros(0, dtype=I32)
    v = torch.randint(0, extent + 1, (groups,), generator=gen).sort().values
    if full:
        v[-1] = extent
    return v.to(I32)


def make_packed(
    form: str,
    groups: int,
    m: int,
    n: int,
    k: int,
    extent: int,
    *,
    dtype=F64,
    seed: int = 0,
    offs: Optional[Sequence[int]] = None,
    device="cpu",
):
    """Operands ``(a, b, offs)`` of a packed form. ``extent`` is T (2d3d, 2d2d) or
    N_total (3d2d); ``m``/``n``/``k`` are the per-group dims the form does not group."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).to(device)

    if offs is None:
        o = random_offs(gen, groups, extent)
    else:
        o = torch.tensor(list(offs), dtype=I32)
    o = o.to(device)
    if form == "2d3d":
        return rnd(extent, k), rnd(groups, k, n), o
    if form == "2d2d":
        return rnd(m, extent), rnd(extent, n), o
    if form == "3d2d":
        return rnd(groups, m, k), rnd(k, extent), o
    if form == "3d3d":
        return rnd(groups, m, k), rnd(groups, k, n), None
    raise AssertionError(form)


def make_list(dims: Sequence[Sequence[int]], *, dtype=F64, seed: int = 0, device="cpu"):
    """``As, Bs`` for per-group ``(m, n, k)``."""
    gen = torch.Generator().manual_seed(seed)
    As = [torch.randn(m, k, generator=gen, dtype=F64).to(dtype).to(device) for m, n, k in dims]
    Bs = [torch.randn(k, n, generator=gen, dtype=F64).to(dtype).to(device) for m, n, k in dims]
    return As, Bs


#: hand-picked problems per packed form: empty groups, K = 0, tails past offs[-1], G = 0
PACKED_CASES = {
    "2d3d": [
        dict(groups=3, m=0, n=5, k=4, extent=10, offs=[2, 2, 7]),  # empty group + tail
        dict(groups=2, m=0, n=3, k=0, extent=6, offs=[2, 4]),  # K = 0 + tail
        dict(groups=4, m=0, n=2, k=3, extent=5, offs=[0, 0, 5, 5]),  # leading/trailing empty
        dict(groups=0, m=0, n=3, k=2, extent=4, offs=[]),  # G = 0: all rows are tail
    ],
    "2d2d": [
        dict(groups=3, m=4, n=5, k=0, extent=10, offs=[2, 2, 7]),
        dict(groups=2, m=3, n=0, k=0, extent=6, offs=[0, 6]),
        dict(groups=3, m=2, n=3, k=0, extent=5, offs=[1, 1, 1]),
        dict(groups=1, m=0, n=3, k=0, extent=4, offs=[3]),
    ],
    "3d2d": [
        dict(groups=3, m=4, n=0, k=6, extent=10, offs=[2, 2, 7]),
        dict(groups=2, m=3, n=0, k=0, extent=6, offs=[1, 5]),
        dict(groups=3, m=2, n=0, k=3, extent=5, offs=[0, 5, 5]),
        dict(groups=0, m=2, n=0, k=3, extent=4, offs=[]),
    ],
    "3d3d": [
        dict(groups=3, m=4, n=5, k=6, extent=0),
        dict(groups=2, m=3, n=2, k=0, extent=0),
        dict(groups=2, m=0, n=2, k=3, extent=0),
        dict(groups=0, m=2, n=2, k=3, extent=0),
    ],
}

LIST_CASES = [
    [(2, 3, 4), (0, 2, 5), (3, 1, 0), (1, 4, 2)],
    [(4, 4, 4)],
    [(0, 0, 0), (2, 0, 3), (0, 3, 2)],
    [],
]


def packed_case_ids():
    return [
        pytest.param(form, i, id=f"{form}-{i}")
        for form, cases in PACKED_CASES.items()
        for i in range(len(cases))
    ]


BENCHES = Path(__file__).resolve().parents[2] / "benches"


def load_bench(name):
    """A module of benches/ by its import name (``bench_gpu``, ``harness.timing``,
    ``peers.sonicmoe``): benches/ goes first on sys.path, as it does when a bench runs as
    ``python3 benches/<name>.py``, so every test gets the same module objects."""
    if str(BENCHES) not in sys.path:
        sys.path.insert(0, str(BENCHES))
    mod = importlib.import_module(name)
    path = BENCHES.joinpath(*name.split("."))
    assert Path(mod.__file__) in (path.with_suffix(".py"), path / "__init__.py"), mod
    return mod


def load_dev(name):
    """A module of dev/ by its import name, dev/ on sys.path after benches/."""
    load_bench("harness")
    dev = BENCHES.parent / "dev"
    if str(dev) not in sys.path:
        sys.path.insert(1, str(dev))
    mod = importlib.import_module(name)
    assert Path(mod.__file__) == dev / f"{name}.py", mod
    return mod


class WallClockEvent:
    """A stand-in for ``torch.cuda.Event`` on the CPU, for the benches' tests: ``record``
    reads the wall clock, ``elapsed_time`` gives milliseconds (at least 1e-6)."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return max((other.t - self.t) * 1e3, 1e-6)


def dev_override(name: str):
    """The value of kernel-choice override ``name`` (``GROUPMM_SM90_*``) in effect: the
    environment's in a development build (``GROUPMM_DEV_KNOBS=1``), else None (a product
    build never reads them)."""
    import groupmm

    return os.environ.get(name) if groupmm.build_info().get("dev_knobs") else None


def outputs_in_fresh_process(module: str, env: dict, path) -> list:
    """``module._outputs()`` (a test module of this folder) computed in a fresh Python
    process with ``env`` added to the environment, saved to ``path`` and loaded here: for
    the kernel choices a development build reads from the environment once per process.
    Skips in a product build, where those overrides and the kernels only they reach are
    not compiled."""
    import groupmm

    if not groupmm.build_info().get("dev_knobs"):
        pytest.skip("kernel-choice overrides need a development build (GROUPMM_DEV_KNOBS=1)")
    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {here!r})
        from {module} import _outputs
        torch.save(_outputs(), {str(path)!r})
        """
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env=dict(os.environ, **env), timeout=300
    )
    return torch.load(path)


def ragged_routes(T: int, k: int, E: int, gen: torch.Generator, device="cuda"):
    """``(offs, src)`` of a routed product over ``R = T*k`` rows for the kernel-configuration
    tests: int32 group ends drawn from ``gen`` with an empty expert (``E // 2``), a one-row
    one (expert 1) and 7 routed rows past ``offs[-1]``, and int32 ``src`` uniform over the
    ``T`` tokens."""
    R = T * k
    counts = torch.randint(0, 2 * R // E + 1, (E,), generator=gen)
    counts[E // 2] = 0
    counts[1] = 1
    offs = counts.cumsum(0).clamp(max=R - 7).to(device, torch.int32)
    src = torch.randint(0, T, (R,), generator=gen).to(device, torch.int32)
    return offs, src
