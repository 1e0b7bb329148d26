# ruff: noqa: B023  (run is timed within the iteration that made it)
# The gathered varlen-K weight gradients (the fused layer's _native.gather_k_mm), GK_OP=dw_in:
# x[src]^T . d_pre (A gathered), GK_OP=dw_out: act^T . d_out[src] (B gathered), in the
# configuration GROUPMM_SM90_GATHER_K names (co192: cooperative 128 x 192; co256: cooperative
# 128 x 256), T = 16384 tokens, uniform top-k routing (k distinct experts a token), bf16.
# One process per configuration, run alternated (issue 28, session 17, H100:
# h100_bf16_issue28_gather_k_dwin.jsonl, ..._dwout.jsonl). With GK_SAVE=path the first
# process saves its outputs and the later ones report their largest difference to them.
import json
import os
import sys

import torch
from batch_timer import batch_ms
from groupmm import _native

SHAPES = {  # name: (d_model, d_ff, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "olmoe": (2048, 1024, 64, 8),
    "fine-1536-256-e128-k8": (1536, 256, 128, 8),
    "fine-2048-256-e256-k16": (2048, 256, 256, 16),
    "fine-4096-512-e256-k8": (4096, 512, 256, 8),
    "fine-768-1024-e32-k2": (768, 1024, 32, 2),
}
T = 16384
cfg = os.environ.get("GROUPMM_SM90_GATHER_K", "auto")
OP = os.environ.get("GK_OP", "dw_in")  # dw_in (x gathered) or dw_out (dY gathered)
save = os.environ.get("GK_SAVE")
ref = torch.load(save) if save and os.path.exists(save) else None
outs = {}
for name, (d, f, e, k) in SHAPES.items():
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(T, e, device="cuda", generator=g)
    expert = scores.topk(k, dim=-1).indices.flatten()
    order = torch.argsort(expert, stable=True)
    src = (order // k).to(torch.int32)
    offs = torch.bincount(expert, minlength=e).cumsum(0).to(torch.int32)
    if OP == "dw_in":  # x[src]^T . d_pre: A gathered, [d, 2f] per expert
        a = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(T * k, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g)
    else:  # act^T . d_out[src]: B gathered, [f, d] per expert
        a = torch.randn(T * k, f, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(T, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def run():
        return _native.gather_k_mm(a, b, offs, src, OP == "dw_out", False)

    out = run()
    ms = batch_ms(run, reps=10, warmup=3)
    flops = 2.0 * T * k * d * (2 * f if OP == "dw_in" else f)
    r = {"config": cfg, "op": OP, "shape": name, "ms": ms, "tflops": flops / ms / 1e9}
    if ref is not None and name in ref:
        r["max_abs_diff_vs_saved"] = (out.float() - ref[name].cuda().float()).abs().max().item()
    outs[name] = out.cpu()
    print(json.dumps(r), flush=True)
if save and ref is None:
    torch.save(outs, save)
print(torch.cuda.get_device_name(), file=sys.stderr)
