"""Does compute-sanitizer's initcheck see bytes written by TMA stores? (Measured on an H200
with compute-sanitizer 2025.3.1: no.) Each step prints a marker and the
tool's reports land between the markers. Run and count per step:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --show-backtrace no \
        --print-limit 1000000 python3 tests/programs/initcheck_tma.py > log 2>&1
    awk '/^@@ begin/{s=$0; n=0; next} /Uninitialized/{n++} /^@@ end/{print s, n}' log

A copy of an output that a TMA store wrote is reported whole as a "cudaMemcpy source"
uninitialized access, whoever wrote it: groupmm's varlen kernel, torch's F.grouped_mm and
cuBLAS alike, while the same output written into a zeroed `out=` is clean.
"""

import sys

import groupmm
import torch
import torch.nn.functional as F

dev = "cuda"
torch.manual_seed(0)
bf = torch.bfloat16


def step(name, fn):
    print(f"@@ begin {name}", flush=True)
    out = fn()
    torch.cuda.synchronize()
    print(f"@@ end {name}", flush=True)
    return out


x = torch.randn(512, 64, device=dev, dtype=bf)
w = torch.randn(4, 64, 128, device=dev, dtype=bf)
offs = torch.tensor([100, 300, 400, 500], device=dev, dtype=torch.int32)
y = step("groupmm varlen fwd (TMA store)", lambda: groupmm.grouped_mm(x, w, offs=offs))
print("y", hex(y.data_ptr()), y.numel() * 2, "bytes; NaN:", bool(torch.isnan(y).any()), flush=True)
step("clone of it (cudaMemcpy D2D)", lambda: y.clone())
step("sum of it (a kernel reads it)", lambda: y.float().sum())
step("copy to host (cudaMemcpy D2H)", lambda: y.cpu())
yt = step("torch F.grouped_mm fwd", lambda: F.grouped_mm(x, w, offs=offs))
print("yt", hex(yt.data_ptr()), yt.numel() * 2, "bytes", flush=True)
step("clone of torch's output", lambda: yt.clone())
z = step("torch.mm (cuBLAS)", lambda: x @ w[0])
step("clone of torch.mm's output", lambda: z.clone())
yz = torch.zeros(512, 128, device=dev, dtype=bf)
step("groupmm varlen fwd into zeroed out=", lambda: groupmm.grouped_mm(x, w, offs=offs, out=yz))
step("clone of the zeroed out=", lambda: yz.clone())
# the sanitize case that reported: 75,520-byte (dX) and 114,688-byte (dW) copies
sizes = [0, 1, 127, 128, 129, 0, 200]
offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
T = sum(sizes) + 5
a = torch.randn(T, 64, device=dev, dtype=bf, requires_grad=True)
b = torch.randn(len(sizes), 64, 128, device=dev, dtype=bf, requires_grad=True)
ptrs = {}
a.register_hook(lambda g: ptrs.__setitem__("a", g.data_ptr()))
b.register_hook(lambda g: ptrs.__setitem__("b", g.data_ptr()))
yy = groupmm.grouped_mm(a, b, offs=offs)
gy = torch.randn(T, 128, device=dev, dtype=bf)
step("backward of the sanitize case", lambda: yy.backward(gy))
print(
    "grad stolen (no copy):",
    ptrs["a"] == a.grad.data_ptr(),
    ptrs["b"] == b.grad.data_ptr(),
    "a.grad",
    hex(a.grad.data_ptr()),
    "b.grad",
    hex(b.grad.data_ptr()),
    flush=True,
)
sys.exit(0)
