"""Small CUDA cases for compute-sanitizer (memcheck, racecheck, synccheck, initcheck; run by
scripts/sanitize.sh): every form and dtype, forward and backward, the list form (the
smallest calls among them), K = 0, 16-bit groups at the varlen tile's boundaries, and bad
offs (decreasing, negative, past the end) that must never read or write out of bounds;
the MoE glue's row kernels (every op and dtype, vectorised and scalar widths, padding rows,
out-of-range indices), the router's top-k kernel (every dtype and values-per-lane width,
rows ending mid-warp and mid-block, NaN and infinities), the gathered products, and a fused
MoE layer's forward and backward.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/programs/sanitize_cases.py
"""

import os
import sys

import groupmm
import torch


def main() -> int:
    dev = "cuda"
    torch.manual_seed(0)
    n = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for counts in ([5, 0, 9, 3], [0, 0, 0, 0], [1, 2, 3, 4]):
            G = len(counts)
            T = sum(counts) + 2
            offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
            K, N, M = 24, 17, 9
            cases = [
                (torch.randn(T, K), torch.randn(G, K, N), offs),
                (torch.randn(M, T), torch.randn(T, N), offs),
                (torch.randn(G, M, K), torch.randn(K, T), offs),
                (torch.randn(G, M, K), torch.randn(G, K, N), None),
            ]
            for a, b, o in cases:
                a = a.to(dev, dtype).requires_grad_()
                b = b.to(dev, dtype).requires_grad_()
                y = groupmm.grouped_mm(a, b, offs=o)
                y.backward(torch.randn_like(y))
                n += 1
        As = [
            torch.randn(m, k, device=dev, dtype=dtype) for m, k in [(3, 5), (0, 4), (6, 0), (7, 9)]
        ]
        Bs = [
            torch.randn(k, n_, device=dev, dtype=dtype)
            for k, n_ in [(5, 2), (4, 3), (0, 5), (9, 8)]
        ]
        groupmm.grouped_mm(As, Bs)
        n += 1
    bf = torch.bfloat16
    # the smallest calls: a one-group and a three-group list, a small packed product
    groupmm.grouped_mm(
        [torch.randn(8, 64, device=dev, dtype=bf)], [torch.randn(64, 64, device=dev, dtype=bf)]
    )
    groupmm.grouped_mm(
        [torch.randn(m, 64, device=dev, dtype=bf) for m in (5, 17, 40)],
        [torch.randn(64, 32, device=dev, dtype=bf) for _ in range(3)],
    )
    offs = torch.tensor([5, 22, 62], device=dev, dtype=torch.int32)
    groupmm.grouped_mm(
        torch.randn(96, 64, device=dev, dtype=bf),
        torch.randn(3, 64, 32, device=dev, dtype=bf),
        offs=offs,
    )
    n += 3
    # 16-byte-aligned 16-bit groups around the 128-row tile (the varlen / sm90 paths)
    for dtype in (torch.bfloat16, torch.float16):
        sizes = [0, 1, 127, 128, 129, 0, 200]
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        T = sum(sizes) + 5
        a = torch.randn(T, 64, device=dev, dtype=dtype, requires_grad=True)
        b = torch.randn(len(sizes), 64, 128, device=dev, dtype=dtype, requires_grad=True)
        groupmm.grouped_mm(a, b, offs=offs).backward(torch.randn(T, 128, device=dev, dtype=dtype))
        n += 1
    x = torch.randn(20, 16, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3, 16, 8, device=dev, dtype=torch.bfloat16)
    for bad in ([5, 3, 20], [-4, 10, 12], [5, 10, 10_000], [2**31 - 1, -(2**31), 7]):
        offs = torch.tensor(bad, dtype=torch.int32, device=dev)
        for a, b in [
            (x, w),  # [T,K] x [G,K,N]
            (x.t().contiguous(), x),  # [K,T] x [T,K] -> [G,K,K]
            (w.transpose(1, 2).contiguous(), x.t().contiguous()),  # [G,8,16] x [16,20]
        ]:
            try:
                groupmm.grouped_mm(a, b, offs=offs)
            except ValueError as e:  # the flag of the previous call, reported now
                assert "offs" in str(e)
                groupmm.grouped_mm(a, b, offs=offs)
            torch.cuda.synchronize()
            n += 1
        groupmm._native.take_offs_error(0)
    n += gathered(dev)
    n += moe_rows(dev)
    n += topk(dev)
    n += row_scaled(dev)
    torch.cuda.synchronize()
    print(f"sanitize cases: {n} calls done")
    return 0


def row_scaled(dev) -> int:
    """The RowScale epilogue kernel (groups around the 128-row tile, empty groups, rows
    past the last group, N not a multiple of the tile), forward only: its backward is plain
    products (above) and torch ops, whose reads of a TMA-written output initcheck would
    report (tests/programs/initcheck_tma.py); the kernel's every output byte is checked by
    poison_outputs.py instead."""
    n = 0
    for dtype in (torch.bfloat16, torch.float16):
        for sizes, K, N in (([0, 1, 127, 128, 129, 0, 200], 64, 128), ([300, 5], 200, 72)):
            offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
            R = sum(sizes) + 5
            x = torch.randn(R, K, device=dev, dtype=dtype)
            w = torch.randn(len(sizes), K, N, device=dev, dtype=dtype)
            groupmm._native.product("row_scale", x, w, offs, (torch.randn(R, device=dev),))
            n += 1
    return n


def _flagged(fn, *args, **kwargs) -> None:
    """Runs ``fn(*args, **kwargs)``, a call whose indices may be out of range: its own
    later launches may already report it (the deferred flag, read at every submission),
    else the flag is taken here, so that the next case starts clean."""
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        assert "routing index out of range" in str(e), e
    torch.cuda.synchronize()
    groupmm._native.take_offs_error(0)


def gathered(dev) -> int:
    """The gathered products: ``_native.gather_mm`` (groups around the 128-row tile, rows
    past the last group, both weight majors), the weight gradients on gathered rows
    (``_native.gather_k_mm``: either operand gathered, both output layouts, token counts
    around the 64-token k-block), the dgated product reading ``dy`` through ``src``, with
    repeated and out-of-range indices (reported through the deferred flag), and the SwiGLU
    up projection on gathered and packed rows; the gathering varlen kernels by default, the
    row gather then the TMA kernels under a development build's GROUPMM_SM90_GATHER=0 (sanitize.sh's
    "gather-first" path); the up projection with gate and up as two weights."""
    n = 0
    for dtype in (torch.bfloat16, torch.float16):
        sizes = [0, 1, 127, 128, 129, 0, 200]
        offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        R, T, K, N = sum(sizes) + 5, 70, 72, 264
        x = torch.randn(T, K, device=dev, dtype=dtype)
        index = torch.randint(-3, T + 3, (R,), device=dev, dtype=torch.int32)
        for w in (
            torch.randn(len(sizes), K, N, device=dev, dtype=dtype),
            torch.randn(len(sizes), N, K, device=dev, dtype=dtype).transpose(1, 2),
        ):
            _flagged(groupmm._native.gather_mm, x, w, offs, index)
            n += 1
        rows_k = torch.randn(R, K, device=dev, dtype=dtype)
        rows_n = torch.randn(R, N, device=dev, dtype=dtype)
        y = torch.randn(T, N, device=dev, dtype=dtype)
        for transposed in (False, True):
            _flagged(groupmm._native.gather_k_mm, x, rows_n, offs, index, False, transposed)
            _flagged(groupmm._native.gather_k_mm, rows_k, y, offs, index, True, transposed)
            n += 2
        F = 64
        w_out = torch.randn(len(sizes), F, N, device=dev, dtype=dtype)
        pre = torch.randn(R, 2 * F, device=dev, dtype=dtype)
        scale = torch.rand(R, device=dev)
        _flagged(groupmm._native.product, "dgated", y, w_out, offs, (pre, scale), src=index)
        n += 1
        # the SwiGLU up projection, gathered and packed, both weight majors: F = 200 crosses
        # the 128 x 256 tile's 128 gate columns and ends inside a 64-column chunk
        F2 = 200
        for w in (
            torch.randn(len(sizes), K, 2 * F2, device=dev, dtype=dtype),
            torch.randn(len(sizes), 2 * F2, K, device=dev, dtype=dtype).transpose(1, 2),
        ):
            _flagged(groupmm._native.product, "swiglu", x, w, offs, (), index)
            groupmm._native.product("swiglu", rows_k, w, offs, ())
            n += 2
        # the same with gate and up as two weights (torchtitan's w1 / w3), both majors
        for gate, up in (
            [torch.randn(len(sizes), K, F2, device=dev, dtype=dtype) for _ in range(2)],
            [
                torch.randn(len(sizes), F2, K, device=dev, dtype=dtype).transpose(1, 2)
                for _ in range(2)
            ],
        ):
            _flagged(groupmm._native.product, "swiglu", x, gate, offs, (up,), index)
            groupmm._native.product("swiglu", rows_k, gate, offs, (up,))
            n += 2
    return n


def topk(dev) -> int:
    """The router's top-k kernel (rows.cu, launch_topk): every dtype, every values-per-lane
    width (E up to 32, 64, ..., 1024, and E not a multiple of 32), k = 1, 8, 33 (two store
    groups) and E, row counts that end mid-block (8 rows a block), NaN and infinities."""
    from groupmm import _rows

    n = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for e in (1, 31, 33, 64, 100, 256, 300, 1000, 1024):
            for tokens in (0, 5, 3001):
                scores = torch.randn(tokens, e, device=dev, dtype=dtype)
                if tokens:
                    scores[0, e // 2] = float("nan")
                    scores[-1, 0] = float("inf")
                    scores[-1, e - 1] = float("-inf")
                for k in sorted({1, 8, 33, e} & set(range(1, e + 1))):
                    _rows.topk_ids(scores, k)
                    n += 1
    return n


def moe_rows(dev) -> int:
    """The row ops of groupmm._rows and the fused expert ops, forward and backward."""
    from groupmm import _rows
    from groupmm._glue import routes
    from groupmm.fused import expert_block, expert_down, expert_up

    n = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for cols in (8, 13):  # 16-byte vectors / one element
            pre = torch.randn(11, 2 * cols, device=dev, dtype=dtype)
            grad = torch.randn(11, cols, device=dev, dtype=dtype)
            _rows.swiglu(pre)
            _rows.swiglu_backward(grad, pre)
            inv = torch.tensor([[0, 4], [7, 2], [9, 12], [-1, 3]], device=dev)  # 12, -1: bad
            y = torch.randn(10, cols, device=dev, dtype=dtype)  # rows 1, 5, 6, 8: padding
            g = torch.randn(4, cols, device=dev, dtype=dtype)
            ws = (None, torch.rand(4, 2, device=dev, dtype=dtype), torch.rand(4, 2, device=dev))
            for w in ws:
                _rows.gather_sum(y, inv, w)
                _rows.scatter_rows(g, inv, w, 10)
            _rows.row_dots(g, y, inv, torch.float32)
            n += 8
            # GatherSum's other kernel shapes (rows.cu): k = 1 (copy, scaled), 2, wide k, and
            # a problem over one wave of resident threads; one bad index each
            for k, tokens in ((1, 5), (2, 5), (8, 5), (16, 5), (6, 3000)):
                rows = tokens * k + 2
                inv = torch.randperm(rows, device=dev)[: tokens * k].view(tokens, k)
                inv[0, 0] = rows
                y = torch.randn(rows, cols * (64 if tokens > 100 else 1), device=dev, dtype=dtype)
                for w in (None, torch.rand(tokens, k, device=dev)):
                    _rows.gather_sum(y, inv, w)
                    n += 1
    torch.cuda.synchronize()
    groupmm._native.take_offs_error(0)  # the bad indices' deferred flag
    # The fused path with a fixed routing (no router's cuBLAS GEMM). Not under initcheck:
    # the row kernels there read GEMM outputs written by TMA stores, which initcheck does
    # not see (header of sanitize.sh; 3236 such reports, all in swiglu reading the
    # varlen GEMM's output); the row kernels' reads are checked by the calls above.
    if os.environ.get("SAN_TOOL") == "initcheck":
        return n
    E, k, T, D, F = 8, 2, 37, 64, 32
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(dev)
    r = routes(ids, E)
    bf = torch.bfloat16
    x = torch.randn(T, D, device=dev, dtype=bf, requires_grad=True)
    w_in = torch.randn(E, D, 2 * F, device=dev, dtype=bf, requires_grad=True)
    w_out = torch.randn(E, F, D, device=dev, dtype=bf, requires_grad=True)
    weights = torch.rand(T, k, device=dev, requires_grad=True)
    out = expert_down(
        expert_up(x, w_in, r.offs, r.src, r.inverse), w_out, r.offs, r.inverse, weights
    )
    out.backward(torch.randn_like(out))
    # the whole block: the SwiGLU and dgated epilogue kernels, dw_in through gather_k_mm
    out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
    out.backward(torch.randn_like(out))
    return n + 2


if __name__ == "__main__":
    sys.exit(main())
