# ruff: noqa: B023, E731  (each lambda is timed within the iteration that made it)
# The DGated product of the fused layer's backward (_native.dgated_mm: p = dy[src] . w_out^T
# with dSwiGLU, the router-weight scale and its row sums in the epilogue) in the
# configuration GROUPMM_SM90_DGATED names (pp128: ping-pong 128 x 128; co256: cooperative
# 128 x 256), bf16, uniform top-k routing (k distinct random experts a token), ops dg_g (dy
# read through src in the GEMM) and dg_p (packed dy), one JSON line per shape. One process
# per configuration, run alternated (issue 28, session 18, H100:
# h100_bf16_issue28_dgated_co256.jsonl). With DG_SAVE=prefix every shape's outputs are saved
# to prefix_<shape>.pt (compare two configurations' files with torch.equal).
#
#   GROUPMM_SM90_DGATED=co256 python3 benches/results/issue28_dgated.py co256 dg_g qwen3,olmoe
import json
import math
import os
import sys

import torch
from batch_timer import batch_ms, uniform_routes
from groupmm import _native

SHAPES = {  # name: (T, k, E, D, F)
    "qwen3": (16384, 8, 128, 2048, 768),
    "olmoe": (16384, 8, 64, 2048, 1024),
    "fine": (16384, 8, 128, 1536, 256),
    "k16": (16384, 16, 256, 1536, 512),
    "q235": (16384, 8, 128, 4096, 1536),
    "gptoss": (16384, 4, 32, 2880, 2880),
    "qwen3_4k": (4096, 8, 128, 2048, 768),
    "mixep": (16384, 2, 4, 4096, 14336),  # one rank's Mixtral experts under EP = 2
}


tag, ops, names = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
for name in names:
    T, k, E, D, F = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    d_out = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w_out = torch.randn(E, F, D, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(F)
    src, offs = uniform_routes(T, k, E, g, "cuda")
    R = T * k
    pre = torch.randn(R, 2 * F, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = torch.rand(R, device="cuda", dtype=torch.float32, generator=g)
    dys = d_out.index_select(0, src)
    fn = {
        "dg_g": lambda: _native.dgated_mm(d_out, w_out, offs, pre, scale, src, None),
        "dg_p": lambda: _native.dgated_mm(dys, w_out, offs, pre, scale, None, None),
    }
    if os.environ.get("DG_SAVE"):
        outs = {o: [x.float().cpu() for x in fn[o]()] for o in fn}
        torch.save(outs, os.environ["DG_SAVE"] + "_" + name + ".pt")
    row = dict(tag=tag, cfg=name, T=T, unit="ms", device=torch.cuda.get_device_name())
    for o in ops:
        row[o] = batch_ms(fn[o], reps=10)
    print(json.dumps(row), flush=True)
