"""quack (the grouped GEMM of SonicMoE), as bench_gpu.py calls it: how it is imported
(:func:`load_quack`, optional: absent, the bench says why), the configurations the bench
chooses among per row (``QUACK_CONFIGS``, ../shared/PEERS.md: its default and three forced
ones; :func:`quack_candidates`) and the host cost of one call (:func:`quack_host_cost`).
"""

from __future__ import annotations

import torch
from harness.report import dist_version, error_text

#: quack's configurations (PEERS.md): name -> (tile_m, tile_n, pingpong), None = its default
QUACK_CONFIGS = {
    "default 128x192 pp 2x1": None,
    "128x128 pp 1x1": (128, 128, True),
    "128x192 pp 1x1": (128, 192, True),
    "128x256 coop 1x1": (128, 256, False),
}


def load_quack():
    """quack's gemm entry points and version, or (None, why)."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm, gemm_tuned
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return None, error_text(e, 100, first_line=False)
    ver = {
        "quack": dist_version(("quack-kernels",), "quack", unknown="unknown"),
        "cutlass": dist_version(("nvidia-cutlass-dsl",)),  # None: installed without metadata
    }
    return {"GemmConfig": GemmConfig, "gemm": gemm, "tuned": gemm_tuned, "version": ver}, None


def quack_candidates(Q, a, b, kind, cu, oshape) -> dict:
    """config name -> callable computing the product with that configuration."""
    kw = {"cu_seqlens_m": cu} if kind == "m" else {"cu_seqlens_k": cu}
    cands = {}
    for name, cfg in QUACK_CONFIGS.items():
        if cfg is None:
            cands[name] = lambda: Q["gemm"](a, b, tuned=False, **kw)
            continue
        tm, tn, pp = cfg
        try:
            c = Q["GemmConfig"](
                tile_m=tm,
                tile_n=tn,
                pingpong=pp,
                cluster_m=1,
                cluster_n=1,
                is_dynamic_persistent=False,
                device_capacity=9,
            )
        except Exception:  # noqa: BLE001 - a config this quack cannot express: left out
            continue
        out = torch.empty(oshape, device=a.device, dtype=a.dtype)
        cands[name] = lambda c=c, out=out: Q["tuned"].fn(a, b, out, config=c, **kw)
    return cands


def quack_host_cost(Q, n=500):
    """Host µs per call of quack's default configuration on the same small packed forward."""
    from harness.timing import per_call_us

    E, K, N, T = 8, 128, 128, 256
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, T + 1, T // E, device="cuda", dtype=torch.int32)
    return per_call_us(lambda: Q["gemm"](x, w, cu_seqlens_m=cu, tuned=False), n)
