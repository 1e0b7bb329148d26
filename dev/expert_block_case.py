"""One routed SwiGLU expert block, forward and backward, twice, for a kernel profiler:

    ncu --kernel-name regex:varlen_kernel --launch-count 12 --section SpeedOfLight \
        python3 dev/expert_block_case.py [--tokens 4096] [--dims 2048,768] [--experts 128,8]

bf16, uniform top-k routing, ``groupmm.fused.expert_block`` (six grouped products per
pass: SwiGLU up, down, dgated, the two weight gradients and the input gradient)."""

import argparse

import torch
from groupmm._glue import routes
from groupmm.fused import expert_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dims", default="2048,768", help="D,F: model and expert widths")
    ap.add_argument("--experts", default="128,8", help="E,k: experts and top-k")
    args = ap.parse_args()
    (d, f), (e, k) = map(int, args.dims.split(",")), map(int, args.experts.split(","))
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(args.tokens, d, **kw, requires_grad=True)
    w_in = (torch.randn(e, d, 2 * f, **kw) / d**0.5).requires_grad_()
    w_out = (torch.randn(e, f, d, **kw) / f**0.5).requires_grad_()
    r = routes(
        torch.rand(args.tokens, e, device="cuda").topk(k, dim=1).indices, e, index_dtype=torch.int32
    )
    weights = torch.rand(args.tokens, k, device="cuda", requires_grad=True)
    for _ in range(2):
        out = expert_block(x, w_in, w_out, r.offs, r.src, r.inverse, weights)
        out.backward(torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
