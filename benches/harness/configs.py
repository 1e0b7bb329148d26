"""The MoE layer configurations the benches measure, one table: bench_moe.py times whole
layers at them, profile_moe.py profiles and counts their bytes, bench_ep.py shards them
over GPUs. Also the workload vocabulary of those benches: how tokens are routed
(``ROUTINGS``, :func:`routing` for the fixed ones) and which passes a step runs
(``PASSES``).

Configs (d_model, d_ff, experts, top-k), selected by names and groups
(:func:`select_configs`): ``layer`` (four published MoE models' layers), ``extra``,
``fine`` (fine-grained settings), ``layer-wide`` (``layer`` + ``extra`` + GLM-4.5-Air-like
+ ``fine``), ``legacy`` (older names and sizes), ``all`` (every distinct config once);
``TINY`` for smoke runs.
"""

from __future__ import annotations

import torch

from harness.cli import comma_list

#: name -> (d_model, d_ff, experts, top_k); profile_moe.py and bench_ep.py unpack these four
CONFIGS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "dsv2-lite": (2048, 1408, 64, 6),
    "qwen3": (2048, 768, 128, 8),
    "dsv3-local": (7168, 2048, 32, 8),
    "mixtral": (4096, 14336, 8, 2),
    "glm45-air": (4096, 1408, 128, 8),
    # fine-grained settings (narrow experts, wide top-k, long sequences: the
    # settings SonicMoE is benchmarked on)
    "fine-1536-256-e128-k8": (1536, 256, 128, 8),
    "fine-1536-512-e256-k16": (1536, 512, 256, 16),
    "fine-1536-256-e256-k16": (1536, 256, 256, 16),
    "fine-2048-256-e256-k16": (2048, 256, 256, 16),
    "fine-4096-512-e256-k8": (4096, 512, 256, 8),
    "fine-768-1024-e32-k2": (768, 1024, 32, 2),
}
MODELS = {
    "qwen3-30b-a3b": "Qwen3-30B-A3B",
    "olmoe": "OLMoE-1B-7B",
    "qwen3-235b-a22b": "Qwen3-235B-A22B",
    "gpt-oss-20b": "gpt-oss-20b-like SwiGLU",
    "dsv2-lite": "DeepSeek-V2-Lite routed experts",
    "qwen3": "Qwen3-30B-A3B-like (earlier runs' name)",
    "dsv3-local": "DeepSeek-V3, 32 of 256 experts",
    "mixtral": "Mixtral-8x7B-like",
    "glm45-air": "GLM-4.5-Air-like",
    "fine-1536-256-e128-k8": "fine-grained d 1536, F 256, E 128, k 8",
    "fine-1536-512-e256-k16": "fine-grained d 1536, F 512, E 256, k 16",
    "fine-1536-256-e256-k16": "fine-grained d 1536, F 256, E 256, k 16",
    "fine-2048-256-e256-k16": "fine-grained d 2048, F 256, E 256, k 16",
    "fine-4096-512-e256-k8": "fine-grained d 4096, F 512, E 256, k 8",
    "fine-768-1024-e32-k2": "d 768, F 1024, E 32, k 2",
    "tiny": "tiny",
}
GROUPS = {
    "layer": ("qwen3-30b-a3b", "olmoe", "qwen3-235b-a22b", "gpt-oss-20b"),
    "extra": ("dsv2-lite",),
    "legacy": ("qwen3", "olmoe", "dsv3-local", "mixtral"),
    "fine": (
        "fine-1536-256-e128-k8",
        "fine-1536-512-e256-k16",
        "fine-2048-256-e256-k16",
        "fine-4096-512-e256-k8",
        "fine-768-1024-e32-k2",
    ),
}
# the wide table: the layer configs, DeepSeek-V2-Lite, GLM-4.5-Air and the fine-grained ones
GROUPS["layer-wide"] = GROUPS["layer"] + GROUPS["extra"] + ("glm45-air",) + GROUPS["fine"]
# every distinct config once ("qwen3" has qwen3-30b-a3b's sizes)
GROUPS["all"] = GROUPS["layer-wide"] + ("fine-1536-256-e256-k16", "dsv3-local", "mixtral")
TINY = {"tiny": (64, 32, 8, 2)}

#: how tokens are routed: the layer's router, or fixed experts (:func:`routing`)
ROUTINGS = ("router", "uniform", "skewed")
#: what a step runs: forward and backward, or the forward alone
PASSES = ("fwd+bwd", "fwd")


def select_configs(arg: str) -> list:
    """Config names from a comma list of names and groups, in CONFIGS order, each once."""
    want = set()
    for tok in comma_list(arg):
        if tok in GROUPS:
            want.update(GROUPS[tok])
        elif tok in CONFIGS:
            want.add(tok)
        else:
            raise SystemExit(
                f"unknown config {tok!r}; groups: {', '.join(GROUPS)}; "
                f"configs: {', '.join(CONFIGS)}"
            )
    return [c for c in CONFIGS if c in want]


def routing(T: int, E: int, k: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] fixed expert ids, each token's k distinct (``uniform`` or ``skewed``)."""
    if kind == "uniform":
        # k distinct experts per token, every expert T*k/E times (up to rounding)
        base = torch.randperm(T * k, generator=gen) % E
        ids = base.view(T, k)
        shift = torch.arange(k).view(1, k)
        return (ids[:, :1] + shift * max(E // k, 1)) % E
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p[torch.randperm(E, generator=gen)[: E // 8]] = 0  # E/8 experts empty
    p = p[torch.randperm(E, generator=gen)]
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
