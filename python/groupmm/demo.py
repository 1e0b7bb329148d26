"""``python -m groupmm.demo``: a forward, a backward and a gradcheck, each checked
against plain torch, printing what was checked.

Runs on CUDA when a GPU is present and this build has CUDA (see
``groupmm.build_info()``), and always on CPU.
"""

import argparse
import sys

import torch

import groupmm


def _reference(x, w, offs):
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def _run(device: str) -> bool:
    ok = True
    torch.manual_seed(0)
    E, T, K, N = 4, 48, 16, 24
    counts = torch.tensor([10, 0, 30, 5])  # expert 1 empty; 3 rows past the last end
    offs = torch.cumsum(counts, 0).to(torch.int32).to(device)
    dt = torch.float32
    x = torch.randn(T, K, device=device, dtype=dt, requires_grad=True)
    w = torch.randn(E, K, N, device=device, dtype=dt, requires_grad=True)

    y = groupmm.grouped_mm(x, w, offs=offs)
    ref = _reference(x.detach().double(), w.detach().double(), offs.cpu())
    err = (y.double() - ref.to(device)).abs().max().item()
    good = err < 1e-4 and y.grad_fn is not None
    ok &= good
    print(
        f"[{device}] forward  x[{T},{K}] @ w[{E},{K},{N}] (offs={offs.tolist()}): "
        f"max |err| vs float64 torch = {err:.2e}, grad_fn={type(y.grad_fn).__name__}  "
        f"{'ok' if good else 'FAIL'}"
    )

    gy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), gy)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    dx_ref, dw_ref = torch.autograd.grad(_reference(xr, wr, offs.cpu()), (xr, wr), gy.double())
    ex = (dx.double() - dx_ref).abs().max().item()
    ew = (dw.double() - dw_ref).abs().max().item()
    empty_zero = bool((dw[1] == 0).all())
    good = ex < 1e-4 and ew < 1e-4 and empty_zero
    ok &= good
    print(
        f"[{device}] backward dX err {ex:.2e}, dW err {ew:.2e}, empty expert dW exactly 0: "
        f"{empty_zero}  {'ok' if good else 'FAIL'}"
    )

    xs = torch.randn(9, 3, dtype=torch.float64, device=device, requires_grad=True)
    ws = torch.randn(3, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    o = torch.tensor([2, 2, 7], dtype=torch.int32, device=device)
    good = torch.autograd.gradcheck(lambda a, b: groupmm.grouped_mm(a, b, offs=o), (xs, ws))
    As = [
        torch.randn(m, k, dtype=torch.float64, device=device, requires_grad=True)
        for m, k in [(2, 3), (0, 2), (4, 1)]
    ]
    Bs = [
        torch.randn(k, n, dtype=torch.float64, device=device, requires_grad=True)
        for k, n in [(3, 5), (2, 2), (1, 3)]
    ]
    good &= torch.autograd.gradcheck(
        lambda *t: tuple(groupmm.grouped_mm(list(t[:3]), list(t[3:]))), (*As, *Bs)
    )
    ok &= good
    print(
        f"[{device}] gradcheck float64, packed [T,K]x[G,K,N] and list form (an empty group): "
        f"{'ok' if good else 'FAIL'}"
    )
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = p.parse_args(argv)
    info = groupmm.build_info()
    print(
        f"groupmm {info['version']}: cuda={info['cuda']} archs={info['cuda_archs']} "
        f"cutlass={info['cutlass']}; torch {torch.__version__}"
    )
    devices = ["cpu"]
    if args.device == "cuda" or (
        args.device == "auto" and info["cuda"] and torch.cuda.is_available()
    ):
        devices.append("cuda")
    if args.device == "cpu":
        devices = ["cpu"]
    ok = all([_run(d) for d in devices])
    print("demo: all checks passed" if ok else "demo: SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
