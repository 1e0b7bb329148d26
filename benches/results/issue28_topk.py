# ruff: noqa: B023  (the lambdas are timed within the iteration that made them)
# The router's top-k: torch.topk, a full sort per row, and groupmm's row op
# (_rows.topk_ids, one warp per row; "native_same": its ids equal torch.topk's, the values
# being distinct), H100 (issue 28): h100_issue28_topk.jsonl (session 15: torch only),
# h100_issue28_topk_native.jsonl (session 16).
import json

import torch
from batch_timer import batch_ms
from groupmm import _rows


def t(f, reps=50):
    return batch_ms(f, reps, warmup=5) * 1000  # microseconds


print(torch.cuda.get_device_name())
for T in (4096, 16384, 65536):
    for E, k in ((32, 2), (64, 8), (128, 8), (256, 8), (256, 16)):
        p = torch.randn(T, E, device="cuda").softmax(-1)
        v1, i1 = p.topk(k, dim=-1)
        s, o = p.sort(dim=-1, descending=True)
        v2, i2 = s[:, :k], o[:, :k]
        same = torch.equal(v1, v2) and torch.equal(i1, i2)
        r = dict(
            T=T,
            E=E,
            k=k,
            topk_us=t(lambda: p.topk(k, dim=-1)),
            sort_us=t(lambda: p.sort(dim=-1, descending=True)),
            native_us=t(lambda: _rows.topk_ids(p, k)),
            sort_slice_same=same,
            native_same=torch.equal(_rows.topk_ids(p, k), i1),
        )
        print(json.dumps(r), flush=True)
