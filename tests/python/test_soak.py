"""Soak on CPU through ``tests/programs/soak.py`` (a fresh process, so RSS means something):
forward+backward calls on small MoE shapes, memory must reach a steady state.

Measured on the 2-core CI machine (load ~3 from parallel builds): ~1800 calls/s, so
100k calls take ~55 s: that runs when ``CI`` is set; 20k calls (~15 s) otherwise.
``GROUPMM_SOAK_CALLS`` overrides both (e.g. 1000000 for a ~10 min soak)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # every test here is a soak: `-m "not slow"` skips them

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "programs", "soak.py")


def _soak(tmp_path, calls, *extra, device="cpu"):
    path = tmp_path / "soak.json"
    cmd = [sys.executable, SCRIPT, "--calls", str(calls), "--device", device, "--json", str(path)]
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=600, check=False)
    print(proc.stdout, proc.stderr)
    return proc, json.loads(path.read_text())


def _check(proc, r, calls):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("PASS")
    assert r["ok"] and r["calls"] == calls
    assert r["rss_growth_mib"] <= 8.0
    assert r["gc_objects_end"] - r["gc_objects_warm"] < 1000  # no Python object leak


CALLS = int(os.environ.get("GROUPMM_SOAK_CALLS", 100_000 if os.environ.get("CI") else 20_000))


def test_soak_cpu(tmp_path):
    proc, r = _soak(tmp_path, CALLS)
    _check(proc, r, CALLS)


@pytest.mark.cuda
def test_soak_cuda(tmp_path):
    """RSS and torch.cuda.memory_allocated() reach a steady state on the GPU too."""
    proc, r = _soak(tmp_path, CALLS, device="cuda")
    _check(proc, r, CALLS)
    assert r["cuda_alloc_growth_mib"] <= 1.0


def test_soak_catches_a_leak(tmp_path):
    """The check is live: 16 KiB leaked per call over 3000 calls (~47 MiB) fails it."""
    proc, r = _soak(tmp_path, 3_000, "--inject-leak-bytes", "16384")
    assert proc.returncode == 1 and proc.stdout.strip().endswith("FAIL")
    assert r["rss_growth_mib"] > 8.0
