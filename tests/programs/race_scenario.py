"""A racecheck scenario: a short random fuzz over every form and dtype, then 200
small forward+backward calls (x [1000, 64], w [16, 64, 64], bf16). The process once
exited abnormally under racecheck during the loop; it now runs to the end (0 hazards,
exit 0, cuda/NOTES.md).

    compute-sanitizer --tool racecheck python3 tests/programs/race_scenario.py
"""

import random
import sys

import groupmm
import torch

dev = "cuda"
random.seed(0)
torch.manual_seed(0)
n = 0
for i in range(20):
    dt = random.choice([torch.bfloat16, torch.float16, torch.float32, torch.float64])
    G = random.randint(1, 6)
    K, N = random.choice([16, 64, 72]), random.choice([8, 64, 136])
    counts = [random.randint(0, 40) for _ in range(G)]
    T = sum(counts) + random.randint(0, 5)
    offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
    form = i % 4
    if form == 0:
        a, b, o = torch.randn(T, K), torch.randn(G, K, N), offs
    elif form == 1:
        a, b, o = torch.randn(K, T), torch.randn(T, N), offs
    elif form == 2:
        a, b, o = torch.randn(G, 9, K), torch.randn(K, T), offs
    else:
        a, b, o = torch.randn(G, 9, K), torch.randn(G, K, N), None
    a = a.to(dev, dt).requires_grad_()
    b = b.to(dev, dt).requires_grad_()
    groupmm.grouped_mm(a, b, offs=o).sum().backward()
    n += 1
torch.cuda.synchronize()
print(f"fuzz: {n} cases done", flush=True)
x = torch.randn(1000, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(16, 64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
offs = torch.linspace(0, 1000, 17, device=dev)[1:].to(torch.int32)
for i in range(200):
    y = groupmm.grouped_mm(x, w, offs=offs)
    y.backward(torch.ones_like(y))
    if i % 50 == 0:
        torch.cuda.synchronize()
        print(f"loop {i}", flush=True)
torch.cuda.synchronize()
print("loop: 200 calls done", flush=True)
sys.exit(0)
