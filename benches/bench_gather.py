"""The gathered up projection of an MoE layer (bf16, uniform top-k routing), ms per call:

- ``gemm(a)``: groupmm's grouped GEMM on rows gathered beforehand (the GEMM alone);
- ``sel+gmm``: ``x.index_select(0, src)`` then that GEMM;
- ``gather_mm``: ``groupmm._native.gather_mm(x, w, offs, src)`` — on Hopper by default
  the varlen kernel that reads the rows through ``src`` itself; with
  ``GROUPMM_SM90_GATHER=0`` (and elsewhere) the engine's row gather then the GEMM;
- ``sel+F.gmm``: ``index_select`` then ``torch.nn.functional.grouped_mm``.

    cd benches && python3 bench_gather.py                      # default path
    cd benches && GROUPMM_SM90_GATHER=0 python3 bench_gather.py

Timing: benches/timing.py (CUDA events, calls back to back, median of 20 after 5).
benches/NOTES-gpu.md run 10 has the results.
"""

import math

import groupmm
import torch
import torch.nn.functional as F
from groupmm import _native
from timing import median_ms  # benches/timing.py, same folder

# name, tokens T, top-k, experts E, d_model D, up-projection width N (= 2 d_ff)
CONFIGS = [
    ("qwen3", 4096, 8, 128, 2048, 1536),
    ("qwen3", 16384, 8, 128, 2048, 1536),
    ("olmoe", 4096, 8, 64, 2048, 2048),
    ("dsv3-local", 4096, 8, 32, 7168, 4096),
    ("mixtral", 4096, 2, 8, 4096, 28672),
]


def row(name: str, T: int, k: int, E: int, D: int, N: int) -> str:
    """One configuration's line of the table."""
    bf = torch.bfloat16
    torch.manual_seed(0)
    R = T * k
    x = torch.randn(T, D, device="cuda", dtype=bf)
    w = torch.randn(E, D, N, device="cuda", dtype=bf) / math.sqrt(D)
    expert = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)]).flatten()
    order = torch.argsort(expert, stable=True)
    src = (order // k).to(torch.int32)
    offs = torch.bincount(expert, minlength=E).cumsum(0).to(torch.int32)
    a = x.index_select(0, src)
    same = torch.equal(_native.gather_mm(x, w, offs, src), groupmm.grouped_mm(a, w, offs=offs))
    t_gemm = median_ms(lambda: groupmm.grouped_mm(a, w, offs=offs), 20, 5)
    t_sel = median_ms(lambda: groupmm.grouped_mm(x.index_select(0, src), w, offs=offs), 20, 5)
    t_gat = median_ms(lambda: _native.gather_mm(x, w, offs, src), 20, 5)
    t_tor = median_ms(lambda: F.grouped_mm(x.index_select(0, src), w, offs=offs), 20, 5)
    tf = 2.0 * R * D * N / (t_gat * 1e-3) / 1e12
    return (
        f"{name:12} {T:6d} {t_gemm:8.3f} {t_sel:8.3f} {t_gat:9.3f} {t_tor:9.3f} {tf:11.0f} "
        f"{t_sel / t_gat:10.2f}   {'bitwise equal' if same else 'DIFFERS'}"
    )


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; bf16; ms")
    print(
        f"{'config':12} {'T':>6} {'gemm(a)':>8} {'sel+gmm':>8} {'gather_mm':>9} "
        f"{'sel+F.gmm':>9} {'TF/s gather':>11} {'vs sel+gmm':>10}"
    )
    for cfg in CONFIGS:
        print(row(*cfg), flush=True)


if __name__ == "__main__":
    main()
