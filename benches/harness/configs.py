"""The configurations the benches measure, one table each: MoE layers (``CONFIGS``,
selected by names and groups), the grouped-GEMM shapes of bench_gpu.py (``SPECS``), and how
tokens are routed over experts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from harness.cli import comma_list

#: name -> (d_model, d_ff, experts, top_k)
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


#: bench_ep.py's routings; Zipf exponent of the skewed one's expert popularity
EP_ROUTINGS = ("uniform", "skewed")
ZIPF_S = 1.0
#: the EP benches' configs: the MoE configs and a tiny one for gloo on the CPU
EP_CONFIGS = {**CONFIGS, "tiny": (16, 32, 8, 2)}


def ep_configs(arg: str) -> dict:
    """``{name: (d, d_ff, E, k)}`` of a comma list of EP_CONFIGS names, in its order."""
    bad = [n for n in comma_list(arg) if n not in EP_CONFIGS]
    if bad:
        raise SystemExit(f"unknown config {bad[0]!r}; known: {', '.join(EP_CONFIGS)}")
    return {n: EP_CONFIGS[n] for n in comma_list(arg)}


def make_routing(T: int, E: int, k: int, kind: str, gen: torch.Generator) -> tuple:
    """``(ids [T, k] int64, weights [T, k] float64)``: each token's k experts distinct,
    ``uniform`` or ``skewed`` (Zipf popularity 1/(e+1)^ZIPF_S over the expert id e, drawn
    without replacement); weights the softmax of random logits."""
    if kind == "uniform":
        ids = torch.rand(T, E, generator=gen).topk(k, dim=1).indices
    elif kind == "skewed":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** ZIPF_S
        ids = torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
    else:
        raise ValueError(f"routing: expected one of {EP_ROUTINGS}, found {kind!r}")
    weights = torch.randn(T, k, generator=gen, dtype=torch.float64).softmax(-1)
    return ids.long(), weights


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


# -------------------------------------------------------------------------------------- GEMM shapes


class Spec(NamedTuple):
    E: int  # experts (local experts for an expert-parallel shard)
    K: int  # reduction size of the forward product
    N: int  # output columns of the forward product
    T: int  # routed rows (tokens x top-k)
    model: str
    proj: str
    tokens: int  # tokens of the batch (per rank for a shard)
    topk: int
    decode: bool = False


# fine-grained first (a run cut short keeps the hardest rows), then decode, then larger
SPECS = {
    # --- fine-grained (≤ 256 routed rows per expert on average)
    "qwen3-up": Spec(128, 2048, 768, 32768, "Qwen3-30B-A3B", "up, one half", 4096, 8),
    "qwen3-down": Spec(128, 768, 2048, 32768, "Qwen3-30B-A3B", "down", 4096, 8),
    "qwen3-30b-up": Spec(128, 2048, 1536, 32768, "Qwen3-30B-A3B", "up (gate+up)", 4096, 8),
    "small64": Spec(64, 1024, 1024, 8192, "synthetic", "square", 1024, 8),
    "olmoe-up": Spec(64, 2048, 2048, 16384, "OLMoE-1B-7B", "up (gate+up)", 2048, 8),
    "olmoe-down": Spec(64, 1024, 2048, 16384, "OLMoE-1B-7B", "down", 2048, 8),
    "qwen3-235b-up": Spec(128, 4096, 3072, 32768, "Qwen3-235B-A22B", "up (gate+up)", 4096, 8),
    "qwen3-235b-down": Spec(128, 1536, 4096, 32768, "Qwen3-235B-A22B", "down", 4096, 8),
    "dsv2-up": Spec(160, 5120, 3072, 24576, "DeepSeek-V2", "up (gate+up)", 4096, 6),
    "dsv2-down": Spec(160, 1536, 5120, 24576, "DeepSeek-V2", "down", 4096, 6),
    # --- decode sizes (a handful of rows per expert: reading the weights bounds them)
    "qwen3-30b-up-dec": Spec(128, 2048, 1536, 512, "Qwen3-30B-A3B", "up (gate+up)", 64, 8, True),
    "qwen3-30b-down-dec": Spec(128, 768, 2048, 512, "Qwen3-30B-A3B", "down", 64, 8, True),
    "olmoe-up-dec": Spec(64, 2048, 2048, 256, "OLMoE-1B-7B", "up (gate+up)", 32, 8, True),
    "olmoe-down-dec": Spec(64, 1024, 2048, 256, "OLMoE-1B-7B", "down", 32, 8, True),
    "gpt-oss-up-dec": Spec(32, 2880, 5760, 256, "gpt-oss-20b", "up (gate+up)", 64, 4, True),
    "dsv3-local-up-dec": Spec(
        32, 7168, 4096, 512, "DeepSeek-V3, 32 of 256 experts", "up (gate+up)", 64, 8, True
    ),
    # --- larger experts
    "gpt-oss-up": Spec(32, 2880, 5760, 16384, "gpt-oss-20b", "up (gate+up)", 4096, 4),
    "gpt-oss-down": Spec(32, 2880, 2880, 16384, "gpt-oss-20b", "down", 4096, 4),
    "gpt-oss-up-8k": Spec(32, 2880, 5760, 32768, "gpt-oss-20b", "up (gate+up)", 8192, 4),
    "dsv2-up-16k": Spec(160, 5120, 3072, 98304, "DeepSeek-V2", "up (gate+up)", 16384, 6),
    "qwen3-30b-up-16k": Spec(128, 2048, 1536, 131072, "Qwen3-30B-A3B", "up (gate+up)", 16384, 8),
    "qwen3-30b-down-16k": Spec(128, 768, 2048, 131072, "Qwen3-30B-A3B", "down", 16384, 8),
    "dsv3-local-up": Spec(
        32, 7168, 4096, 32768, "DeepSeek-V3, 32 of 256 experts", "up (gate+up)", 4096, 8
    ),
    "dsv3-local-down": Spec(
        32, 2048, 7168, 32768, "DeepSeek-V3, 32 of 256 experts", "down", 4096, 8
    ),
    "mixtral-up": Spec(8, 4096, 14336, 32768, "Mixtral-8x7B", "up, one half", 16384, 2),
    "mixtral-down": Spec(8, 14336, 4096, 32768, "Mixtral-8x7B", "down", 16384, 2),
    "dsv3-up": Spec(
        32, 7168, 2048, 65536, "DeepSeek-V3, 32 of 256 experts", "up, one half", 8192, 8
    ),
    "dsv3-down": Spec(32, 2048, 7168, 65536, "DeepSeek-V3, 32 of 256 experts", "down", 8192, 8),
}

#: the seven shapes of the original benchmark table (docs/performance.md's tables)
LEGACY = ("mixtral-up", "mixtral-down", "dsv3-up", "dsv3-down", "qwen3-up", "qwen3-down", "small64")

#: name -> (E, K, N, T)
SHAPES = {k: (s.E, s.K, s.N, s.T) for k, s in SPECS.items()}

CLASSES = ("fine", "larger", "decode")
CLASS_TITLE = {"fine": "fine-grained", "larger": "larger experts", "decode": "decode sizes"}

GEMM_PASSES = ("fwd", "dX", "dW", "fwd+bwd")
GEMM_ROUTINGS = ("uniform", "skewed", "zipf12")


def row_class(E: int, T: int, decode: bool = False) -> str:
    if decode:
        return "decode"
    return "fine" if T / E <= 256 else "larger"


def counts_for(E: int, T: int, routing: str) -> list:
    """Rows per expert: uniform, or Zipf over a fixed permutation (``zipf12``: exponent 1.2,
    E/8 experts empty; ``skewed``: 1.1, E/16 empty)."""
    if routing == "uniform":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    expo, frac = (1.2, 8) if routing == "zipf12" else (1.1, 16)
    empty = max(1, E // frac)
    live = E - empty
    w = [1.0 / (r + 1) ** expo for r in range(live)]
    s = sum(w)
    c = [int(T * x / s) for x in w]
    c[0] += T - sum(c)
    g = torch.Generator().manual_seed(E)
    perm = torch.randperm(E, generator=g).tolist()
    out = [0] * E
    for i, cnt in enumerate(c + [0] * empty):
        out[perm[i]] = cnt
    return out


def select_shapes(arg: str) -> list:
    """Shape names from a comma list of names and groups (all, legacy, fine, larger,
    decode), in SPECS order, each once."""
    want = set()
    for tok in comma_list(arg):
        if tok == "all":
            want.update(SPECS)
        elif tok == "legacy":
            want.update(LEGACY)
        elif tok in CLASSES:
            want.update(k for k, s in SPECS.items() if row_class(s.E, s.T, s.decode) == tok)
        elif tok in SPECS:
            want.add(tok)
        else:
            groups = "all, legacy, " + ", ".join(CLASSES)
            raise SystemExit(f"unknown shape {tok!r}; groups: {groups}; shapes: {', '.join(SPECS)}")
    return [k for k in SPECS if k in want]


def effective_T(spec: Spec, quick: bool) -> int:
    """Routed rows measured: --quick divides all but decode sizes by 8."""
    return spec.T if (spec.decode or not quick) else max(spec.E, spec.T // 8)
