"""Train a small Mixture-of-Experts transformer with groupmm on a synthetic task.

The task is generated here (no downloads): each sequence is ``L`` random digits, a
separator, then the same digits reversed; the model is trained as a causal language
model and scored on the reversed half. A model that only learned digit frequencies
sits at ``ln(V)`` (about 2.3 for 10 digits); reversing needs attention, and the MoE
feed-forward layers do the rest.

Model: token + position embeddings, two pre-norm blocks of causal self-attention and a
``groupmm.moe.MoELayer`` (top-2 of 4 SwiGLU experts), final norm, LM head.

Examples::

    python examples/train_moe.py --steps 60 --device cpu --plot moe_loss.png
    python examples/train_moe.py --steps 60 --compare-loop   # grouped_mm vs per-expert loop

With ``--compare-loop`` a second copy of the model (same initial weights, same batches)
runs its experts as a Python loop of per-expert ``nn.Linear`` layers; the two loss
curves are printed side by side, plotted together, and their maximum difference is
reported.

The last line printed is ``final loss <value>`` (mean loss over the reversed half at
the last step).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from groupmm.moe import MoELayer
from torch import nn

VOCAB = 11  # digits 0-9 and the separator
SEP = 10


# --------------------------------------------------------------------------- data


def make_batch(
    gen: torch.Generator, batch: int, length: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``inputs`` and ``targets`` ([batch, 2*length]) for the reversal task.

    Targets are -100 (ignored) except where the next token is part of the reversed half.
    """
    digits = torch.randint(0, 10, (batch, length), generator=gen)
    sep = torch.full((batch, 1), SEP)
    seq = torch.cat([digits, sep, digits.flip(1)], dim=1)  # [B, 2L+1]
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, :length] = -100  # positions whose next token is still in the prompt
    return inputs.to(device), targets.to(device)


# --------------------------------------------------------------------------- model


class LoopMoELayer(nn.Module):
    """Reference MoE layer: the same router, experts as a loop of ``nn.Linear``.

    Built from a :class:`~groupmm.moe.MoELayer` with its weights copied, so both start
    identical; ``grouped_mm`` is never called.
    """

    def __init__(self, moe: MoELayer) -> None:
        super().__init__()
        ge = moe.experts
        if ge.activation != "swiglu" or ge.b_in is not None:
            raise ValueError("LoopMoELayer mirrors swiglu experts without bias")
        self.router = copy.deepcopy(moe.router)
        self.d_ff = ge.d_ff
        self.gate = nn.ModuleList()
        self.up = nn.ModuleList()
        self.down = nn.ModuleList()
        factory = {"device": ge.w_in.device, "dtype": ge.w_in.dtype}
        with torch.no_grad():
            for e in range(ge.num_experts):
                g = nn.Linear(ge.d_model, ge.d_ff, bias=False, **factory)
                u = nn.Linear(ge.d_model, ge.d_ff, bias=False, **factory)
                d = nn.Linear(ge.d_ff, ge.d_model, bias=False, **factory)
                g.weight.copy_(ge.w_in[e, :, : ge.d_ff].T)
                u.weight.copy_(ge.w_in[e, :, ge.d_ff :].T)
                d.weight.copy_(ge.w_out[e].T)
                self.gate.append(g)
                self.up.append(u)
                self.down.append(d)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        route = self.router(flat)
        out = torch.zeros_like(flat)
        for e in range(len(self.gate)):
            tok, slot = torch.where(route.expert_ids == e)  # host sync; fine here
            if tok.numel() == 0:
                continue
            xe = flat[tok]
            ye = self.down[e](F.silu(self.gate[e](xe)) * self.up[e](xe))
            out = out.index_add(0, tok, ye * route.weights[tok, slot, None])
        self.aux_loss = route.aux_loss
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, moe: nn.Module) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.n_heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.ln2(x))


class MoETransformer(nn.Module):
    def __init__(
        self,
        seq_len: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        num_experts: int = 4,
        top_k: int = 2,
        d_ff: int = 128,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, MoELayer(d_model, d_ff, num_experts, top_k))
            for _ in range(n_layers)
        )
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def aux_loss(self) -> torch.Tensor:
        return sum(blk.moe.aux_loss for blk in self.blocks)  # type: ignore[return-value]

    def to_loop(self) -> MoETransformer:
        """A copy whose MoE layers run as per-expert ``nn.Linear`` loops."""
        twin = copy.deepcopy(self)
        for blk in twin.blocks:
            blk.moe = LoopMoELayer(blk.moe)
        return twin


# --------------------------------------------------------------------------- training


def progress(it: Iterable[int], total: int, desc: str) -> Iterator[int]:
    """tqdm when installed, else a one-line bar on stderr."""
    try:
        from tqdm import tqdm
    except ImportError:
        start = time.perf_counter()
        for i in it:
            yield i
            done = i + 1
            bar = "#" * (30 * done // total)
            rate = done / max(time.perf_counter() - start, 1e-9)
            sys.stderr.write(f"\r{desc} [{bar:<30}] {done}/{total} {rate:5.1f} it/s")
            sys.stderr.flush()
        sys.stderr.write("\n")
    else:
        yield from tqdm(it, total=total, desc=desc)


def train(
    model: MoETransformer,
    args: argparse.Namespace,
    device: torch.device,
    desc: str,
) -> list[float]:
    """Train ``model`` for ``args.steps`` steps; returns the task loss of every step."""
    gen = torch.Generator().manual_seed(args.seed + 1)  # same batches for every model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    for _ in progress(range(args.steps), args.steps, desc):
        inputs, targets = make_batch(gen, args.batch, args.length, device)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + model.aux_loss()).backward()
        opt.step()
        losses.append(loss.item())
    return losses


def save_plot(path: str, curves: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--"]
    for i, (name, ys) in enumerate(curves.items()):
        ax.plot(range(1, len(ys) + 1), ys, styles[i % 2], label=name)
    ax.axhline(math.log(10), color="grey", lw=0.8, ls=":", label="ln 10 (no reversal)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (reversed half)")
    ax.set_title("MoE transformer on sequence reversal")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=8, help="digits per sequence")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op CPU threads (default 1: this model is too small to gain "
        "from more, and spinning idle threads slow it down on a busy machine)",
    )
    p.add_argument("--plot", default="moe_loss.png", help="loss-curve PNG ('' to skip)")
    p.add_argument(
        "--compare-loop",
        action="store_true",
        help="also train a per-expert nn.Linear loop twin and compare the curves",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda given but CUDA is not available")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = MoETransformer(seq_len=2 * args.length).to(device, getattr(torch, args.dtype))
    twin = model.to_loop() if args.compare_loop else None
    n_params = sum(t.numel() for t in model.parameters())
    print(f"model: {n_params} parameters on {device}, {args.dtype}")

    start = time.perf_counter()
    losses = train(model, args, device, "grouped_mm")
    elapsed = time.perf_counter() - start
    first, last = losses[0], losses[-1]
    print(f"grouped_mm: {args.steps} steps in {elapsed:.1f} s, loss {first:.3f} -> {last:.3f}")
    curves = {"grouped_mm": losses}

    if twin is not None:
        start = time.perf_counter()
        loop_losses = train(twin, args, device, "loop")
        elapsed = time.perf_counter() - start
        print(f"loop:       {args.steps} steps in {elapsed:.1f} s")
        curves["per-expert loop"] = loop_losses
        for step in sorted({0, args.steps // 4, args.steps // 2, args.steps - 1}):
            print(
                f"  step {step + 1:4d}: grouped_mm {losses[step]:.6f}  loop {loop_losses[step]:.6f}"
            )
        diff = max(abs(a - b) for a, b in zip(losses, loop_losses))
        print(f"max abs difference between the loss curves: {diff:.3e}")

    if args.plot:
        save_plot(args.plot, curves)
        print(f"loss curve saved to {args.plot}")
    print(f"final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
