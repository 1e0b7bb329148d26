"""examples/expert_parallel.py with 2 processes on gloo (CPU) must match one process, with
the fused and the unfused expert path (tests/python/test_parallel.py tests the package's
expert parallelism itself, case by case)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "expert_parallel.py"


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
@pytest.mark.parametrize("path", ["--fused", "--unfused"])
def test_expert_parallel_gloo_two_ranks_matches_single_process(path: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--backend",
        "gloo",
        "--check",
        path,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"max error (\S+)", lines[-1])
    assert m, proc.stdout
    err = float(m.group(1))
    assert err <= 1e-10, proc.stdout  # float64 on gloo
    # Both routing cases ran; the skewed one leaves rank 1 with no tokens at all.
    assert any(line.startswith("[random] output") for line in lines), proc.stdout
    assert any(line.startswith("[skewed] output") for line in lines), proc.stdout
    assert "    rank 1: [0, 0]" in lines, proc.stdout
    assert f"{path[2:]}, tolerance" in proc.stdout, proc.stdout
