"""dev/ep_overlap.py and benches/profile_ep.py on the CPU: their pure parts (the rows a
rank receives, the markdown of a result, a trace's kernel time by category and the GPU's
idle gaps) against independent computations; the GPU runs themselves need NCCL."""

from __future__ import annotations

import itertools

import torch
from conftest import load_bench, load_dev

overlap = load_dev("ep_overlap")
profile_ep = load_bench("profile_ep")


def test_received_rows_counts_one_copy_per_token_and_rank():
    """The rows one rank sends: for each token, the number of distinct ranks among its k
    experts (rank = expert // (E / W)), summed, rounded down to a multiple of W."""
    for T, E, k, W in [(97, 8, 2, 2), (64, 16, 4, 4), (50, 8, 8, 2)]:
        gen = torch.Generator().manual_seed(T)
        got = overlap.received_rows(T, E, k, W, gen)
        ids = torch.rand(T, E, generator=torch.Generator().manual_seed(T)).topk(k, dim=1).indices
        want = sum(len({int(e) // (E // W) for e in row}) for row in ids)
        assert got == want // W * W
        assert T <= got + W and got <= T * min(k, W)


def test_overlap_markdown_has_every_row_and_ratio():
    med = {"gemm": 2.0, "a2a": 1.0, "serial": 3.0, "overlap": 2.4, "ideal": 2.0}
    row = {"config": "x", "d_model": 8, "d_ff": 4, "experts": 4, "top_k": 2, "rows": 10}
    row.update(a2a_mb_per_rank=1.0, groupmm={"median_ms": med}, torch={"median_ms": med})
    doc = {"device": "dev", "world": 2, "torch": "t", "tokens_per_gpu": 5, "argv": "cmd"}
    doc["rows"] = [row]
    md = overlap.render_md(doc)
    lines = [ln for ln in md.splitlines() if ln.startswith("| x (8, 4, 4, 2)")]
    assert len(lines) == 2
    assert all(ln.endswith(f"| {2.4 / 3.0:.3f} |") for ln in lines)


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_summarize_categories_and_idle_gaps():
    """Kernel time by category and the gaps between kernels (overlapping kernels leave no
    gap), against a direct sum over the same events."""
    events = [
        _kernel("void gmm::varlen::varlen_kernel<...>", 100, 50),
        _kernel("ncclDevKernel_SendRecv(...)", 170, 20),
        _kernel("void gmm::rows_kernels::gather_sum<...>", 180, 30),  # overlaps nccl
        _kernel("Memcpy DtoH", 260, 5, cat="gpu_memcpy"),
        _kernel("void at::native::fill<...>", 300, 10),
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 1000},
    ]
    s = profile_ep.summarize(events)
    assert s["gemm"] == 0.050 and s["nccl"] == 0.020 and s["rows"] == 0.030
    assert abs(s["other"] - 0.015) < 1e-12
    gpu = sorted((e for e in events if e["cat"] != "cpu_op"), key=lambda e: e["ts"])
    busy = set()
    for e in gpu:
        busy.update(range(e["ts"], e["ts"] + e["dur"]))
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    assert abs(s["span"] - span / 1e3) < 1e-12
    assert abs(s["idle"] - (span - len(busy)) / 1e3) < 1e-12


def test_summarize_empty_trace():
    s = profile_ep.summarize([])
    assert all(v == 0.0 for v in s.values())
    assert set(s) == set(itertools.chain(profile_ep.CATEGORIES, ("idle", "span")))
