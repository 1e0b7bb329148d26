"""bench_gpu.py's shapes and the plan of a run: the shape table (``SPECS``: MoE projections
by model, each with its routed rows; classes fine, larger, decode), the routings (the
expert sizes of :func:`counts_for`), the passes and their bytes, the rows of a run
(:func:`plan_rows`) and --dry-run's estimate of its wall time (:func:`estimate_s`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from harness.cli import comma_list
from harness.timing import calls_for, lead_for
from peers.quack import QUACK_CONFIGS


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


# Fine-grained first, then decode sizes, then larger experts: a run cut short by --budget-s
# or a timeout keeps the fine-grained rows, the hardest for a grouped GEMM.
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

#: name -> (E, K, N, T): the shape table as other benches read it (profile_gpu.py)
SHAPES = {k: (s.E, s.K, s.N, s.T) for k, s in SPECS.items()}

CLASSES = ("fine", "larger", "decode")
CLASS_TITLE = {"fine": "fine-grained", "larger": "larger experts", "decode": "decode sizes"}

PASSES = ("fwd", "dX", "dW", "fwd+bwd")
ROUTINGS = ("uniform", "skewed", "zipf12")

#: H200 figures of PEERS.md, used only by --dry-run's estimate
EST_RATE, EST_BW = 790e12, 4.3e12
#: assumed seconds of one quack JIT compile (one configuration, one pass form), --dry-run only
EST_QUACK_JIT_S = 10.0


def row_class(E: int, T: int, decode: bool = False) -> str:
    if decode:
        return "decode"
    return "fine" if T / E <= 256 else "larger"


def counts_for(E: int, T: int, routing: str) -> list:
    if routing == "uniform":
        base = [T // E] * E
        base[0] += T - sum(base)
        return base
    # Zipf-like over a fixed permutation: "skewed" exponent 1.1 with E//16 (≥1) experts
    # empty; "zipf12" exponent 1.2 with E//8 (≥1) empty (the varlen kernels' tuning routing).
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


def nbytes_for(pname: str, E: int, K: int, N: int, T: int, es: int) -> int:
    """Each operand read once, the output written once."""
    b = {
        "fwd": es * (T * K + E * K * N + T * N),
        "dX": es * (T * N + E * K * N + T * K),
        "dW": es * (T * K + T * N + E * K * N),
    }
    if pname == "fwd+bwd":
        return b["fwd"] + b["dX"] + b["dW"]
    return b[pname]


def pass_mult(pname: str) -> float:
    return 3.0 if pname == "fwd+bwd" else 1.0


def plan_rows(names, passes, routings, quick) -> list:
    rows = []
    for name in names:
        s = SPECS[name]
        T = effective_T(s, quick)
        for routing in routings:
            for p in passes:
                rows.append((name, s, T, routing, p))
    return rows


def estimate_s(plan, args, quack: bool) -> dict:
    """A rough wall-time estimate of a plan on an H200 (GPU time of every sample, the
    warm-ups and the quack selection, plus host overhead; quack's JIT compiles assumed at
    EST_QUACK_JIT_S each): the budget check of --dry-run, not a measurement."""
    gpu, host = 0.0, 0.0  # ms of GPU, s of host
    forms = set()
    for _name, s, T, _routing, p in plan:
        flops = pass_mult(p) * 2.0 * T * s.K * s.N
        byts = nbytes_for(p, s.E, s.K, s.N, T, 2)
        t = max(flops / (0.6 * EST_RATE), byts / (0.75 * EST_BW)) * 1e3  # ms
        impl = {
            "groupmm": (t, 0.03),
            "torch": (t, 0.03),
            "dense": (flops / (0.85 * EST_RATE) * 1e3, 0.01),
        }
        if not args.no_loop and p != "fwd+bwd":
            impl["loop"] = (max(1.5 * t, s.E * 0.006), s.E * 0.008)
        q = quack and p != "fwd+bwd"
        if q:
            impl["quack"] = (t, 0.1)
            forms.add(p)
        calls = {
            k: args.calls or calls_for(v[0], args.sample_ms, args.min_calls, args.max_calls)
            for k, v in impl.items()
        }
        lead = max(lead_for(h, g, calls[k]) for k, (g, h) in impl.items())
        for k, (g, h) in impl.items():
            gpu += (args.warmup + 4) * max(g, h) + args.rounds * (calls[k] * g + lead)
        if q:
            gpu += len(QUACK_CONFIGS) * (
                (args.warmup + 4) * max(t, 0.1) + args.select_rounds * (calls["quack"] * t + lead)
            )
        samples = len(impl) * args.rounds + (len(QUACK_CONFIGS) * args.select_rounds if q else 0)
        host += 0.2 + 0.002 * samples  # tensors, closures, events, outputs (seconds)
    jit = len(forms) * len(QUACK_CONFIGS) * EST_QUACK_JIT_S
    shapes = len({name for name, *_ in plan})
    total = gpu / 1e3 + host + jit + 10 + 0.5 * shapes  # + ceilings, host cost; allocations
    return {"rows": len(plan), "gpu_s": gpu / 1e3, "host_s": host, "jit_s": jit, "total_s": total}
