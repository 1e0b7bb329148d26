"""Does groupmm write every byte of its outputs? compute-sanitizer's initcheck cannot say:
it does not see bytes written by TMA stores (tests/programs/initcheck_tma.py shows it flags copies
of cuBLAS's and F.grouped_mm's outputs the same way), and the Hopper kernels write through
TMA. So this check poisons instead: before each call, blocks of every output's and
gradient's size are filled with NaN and freed, so torch's caching allocator hands them back
to groupmm's outputs; inputs are finite, so any NaN left in an output is a byte no kernel
wrote. Every form, both 16-bit dtypes and fp32, forward and backward, the list form, groups
around the 128-row tile, and the RowScale epilogue's kernel. Exits 1 on any NaN.

    python3 tests/programs/poison_outputs.py      # scripts/sanitize.sh runs it once per kernel path
"""

import sys

import groupmm
import torch

DEV = "cuda"


def poison(shapes, dtype):
    blocks = [
        torch.full(s, float("nan"), device=DEV, dtype=dtype) for s in shapes for _ in range(4)
    ]
    del blocks


def check(name, tensors, bad):
    for what, t in tensors:
        nan = torch.isnan(t.float())
        if bool(nan.any()):
            where = nan.nonzero()
            bad.append(
                f"{name}: {what} {list(t.shape)}: {int(nan.sum())} unwritten, "
                f"first at {where[0].tolist()}"
            )


def packed(name, a, b, offs, bad):
    a = a.detach().requires_grad_()
    b = b.detach().requires_grad_()
    shape = groupmm.grouped_mm(a.detach(), b.detach(), offs=offs).shape
    poison([a.shape, b.shape, shape], a.dtype)
    y = groupmm.grouped_mm(a, b, offs=offs)
    gy = torch.randn_like(y)
    poison([a.shape, b.shape, shape], a.dtype)
    y.backward(gy)
    check(name, [("out", y), ("grad a", a.grad), ("grad b", b.grad)], bad)


def main() -> int:
    torch.manual_seed(0)
    bad: list = []
    n = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        t = dict(device=DEV, dtype=dtype)
        for sizes in ([0, 1, 127, 128, 129, 0, 200], [5, 0, 9, 3], [0, 0, 0, 0], [300]):
            G = len(sizes)
            offs = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
            T = sum(sizes) + 5
            tag = f"{dtype} groups {sizes}"
            packed(
                f"{tag} [T,K]x[G,K,N]",
                torch.randn(T, 64, **t),
                torch.randn(G, 64, 128, **t),
                offs,
                bad,
            )
            packed(
                f"{tag} [T,K]x[G,N,K]^T",
                torch.randn(T, 64, **t),
                torch.randn(G, 128, 64, **t).transpose(1, 2),
                offs,
                bad,
            )
            packed(
                f"{tag} [M,T]x[T,N]", torch.randn(64, T, **t), torch.randn(T, 128, **t), offs, bad
            )
            packed(
                f"{tag} [G,M,K]x[K,T]",
                torch.randn(G, 64, 96, **t),
                torch.randn(96, T, **t),
                offs,
                bad,
            )
            n += 4
            if dtype != torch.float32:  # the RowScale epilogue kernel (16-bit only)
                for N in (128, 72):
                    x, w = torch.randn(T, 64, **t), torch.randn(G, 64, N, **t)
                    scale = torch.randn(T, device=DEV)
                    poison([(T, N)], dtype)
                    y = groupmm._native.product("row_scale", x, w, offs, (scale,))[0]
                    check(f"{tag} row_scaled_mm N={N}", [("out", y)], bad)
                    n += 1
        packed(
            f"{dtype} batched", torch.randn(3, 40, 64, **t), torch.randn(3, 64, 72, **t), None, bad
        )
        shapes = [(5, 64, 32), (17, 64, 32), (40, 64, 32), (0, 64, 8), (130, 64, 136)]
        As = [torch.randn(m, k, **t, requires_grad=True) for m, k, _ in shapes]
        Bs = [torch.randn(k, n_, **t, requires_grad=True) for _, k, n_ in shapes]
        poison([(m, n_) for m, _, n_ in shapes], dtype)
        ys = groupmm.grouped_mm(As, Bs)
        gs = [torch.randn_like(y) for y in ys]
        poison([(m, k) for m, k, _ in shapes] + [(k, n_) for _, k, n_ in shapes], dtype)
        torch.autograd.backward(ys, gs)
        check(
            f"{dtype} list",
            [(f"out {i}", y) for i, y in enumerate(ys)]
            + [(f"grad a {i}", x.grad) for i, x in enumerate(As)]
            + [(f"grad b {i}", x.grad) for i, x in enumerate(Bs)],
            bad,
        )
        n += 2
    torch.cuda.synchronize()
    for line in bad:
        print(line)
    print(f"poison outputs: {n} products forward and backward, {len(bad)} with unwritten bytes")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
