r"""Training steps of a torchtitan MoE model: torchtitan's own MoE layers against the same
model with its MoE layers on groupmm (``groupmm.integrations.torchtitan.enable_moe``).

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node W benches/bench_torchtitan.py \
        [--configs qwen3-30b-a3b,mixtral] [--layers 2] [--tokens-per-gpu 8192] \
        [--steps 50] [--compile] [--json OUT] [--md OUT]
    python3 benches/bench_torchtitan.py --from-json OUT.json [--md OUT.md]   # no GPU
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
        benches/bench_torchtitan.py --device cpu --tiny --steps 5      # gloo smoke run

A step: forward, cross-entropy, backward, the expert-bias update and ``AdamW.step``, EP = W;
the implementations take turns each step.
"""

from __future__ import annotations

import sys
import traceback

import groupmm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness.cli import add_doc_args, comma_list, init_ranks, leave, line_buffered_stdout, parser
from harness.report import (
    dist_version,
    error_text,
    fmt,
    from_json,
    one_file,
    started,
    write_outputs,
)
from harness.timing import Clock, Mark, rr_orders, spread
from peers.torchtitan import build_models, setup_parallel

#: d_model, moe hidden, experts, top-k, heads, kv heads, head dim
CONFIGS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, 32, 4, 128),
    "mixtral": (4096, 14336, 8, 2, 32, 8, 128),
    "tiny": (64, 32, 8, 2, 4, 2, 16),
}
IMPLS = ("torchtitan", "groupmm")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument("--configs", default="qwen3-30b-a3b,mixtral", help="comma list")
    p.add_argument("--tiny", action="store_true", help="the tiny config (CPU smoke run)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--tokens-per-gpu", type=int, help="default 8192 (cuda), 64 (cpu)")
    p.add_argument("--seq-len", type=int, help="default 2048 (cuda), 32 (cpu)")
    p.add_argument("--vocab", type=int, help="default 32768 (256 for tiny)")
    p.add_argument("--steps", type=int, default=50, help="timed steps (the loss curve)")
    p.add_argument("--warmup", type=int, default=3, help="steps per implementation first")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data-batches", type=int, default=4, help="random batches, cycled")
    p.add_argument("--compile", action="store_true", help="torchtitan's apply_compile")
    p.add_argument("--compile-backend", default="inductor", help="e.g. aot_eager (CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"))
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 (cuda), fp32 (cpu)")
    p.add_argument("--attention", choices=("flex", "sdpa"), help="default flex (cuda)")
    add_doc_args(p, every="config", merge=False)
    args = p.parse_args(argv)
    args.configs = "tiny" if args.tiny else args.configs
    bad = [c for c in comma_list(args.configs) if c not in CONFIGS]
    bad += [i for i in comma_list(args.impls) if i not in IMPLS]
    if bad or args.steps < 1 or args.warmup < 0:
        p.error(f"unknown {bad}" if bad else "--steps >= 1, --warmup >= 0")
    return args


# --------------------------------------------------------------------------- a step


def time_moe_layers(model, clock, stamps: dict) -> None:
    """Stamps around every MoE module of ``model``: ``fi``/``fo`` (its input, output in
    the forward), ``bo``/``bi`` (their gradients in the backward)."""

    def stamp(t, fwd, bwd):
        def add(key):
            return lambda: stamps.setdefault(key, []).append(clock.stamp())

        return Mark.apply(t, add(fwd), add(bwd))

    for block in model.layers.values():
        block.moe.register_forward_pre_hook(lambda m, a: (stamp(a[0], "fi", "bi"),))
        block.moe.register_forward_hook(lambda m, a, out: stamp(out, "fo", "bo"))


def moe_ms(clock, stamps: dict):
    n = len(stamps.get("fi", ()))
    if not n or not all(len(stamps.get(k, ())) == n for k in ("fo", "bo", "bi")):
        return None
    fwd = sum(clock.ms(a, b) for a, b in zip(stamps["fi"], stamps["fo"]))
    return fwd + sum(clock.ms(a, b) for a, b in zip(stamps["bo"], stamps["bi"]))


def batch(args, rank: int, step: int, dev, vocab: int):
    """Step ``step``'s tokens and labels on ``rank``: one of ``--data-batches`` fixed
    random batches per rank, in turn (a model can learn them: the loss curve falls)."""
    gen = torch.Generator().manual_seed(1_000_003 * (step % args.data_batches) + rank)
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen).to(dev)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, tokens, labels, positions, masks):
    opt.zero_grad(set_to_none=True)
    logits = model(tokens, positions, masks)
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    W = dist.get_world_size()
    with torch.no_grad():
        if W > 1:  # the gradient of the ranks' mean loss: data parallelism's average
            for p in model.parameters():
                if p.grad is None:
                    continue
                if type(p.grad) is torch.Tensor:  # replicated: average over the ranks
                    dist.all_reduce(p.grad)
                    p.grad.div_(W)
                else:  # the experts' shards: already summed over every rank's tokens
                    _plain(p.grad).div_(W)
        update_expert_bias(model)
    opt.step()
    return loss.detach()


def update_expert_bias(model) -> None:
    """torchtitan's aux-loss-free balancing update (its optimizer pre-hook): the counts
    summed over the ranks, ``bias += coeff * sign(mean - counts)`` centred, counts zeroed."""
    for block in model.layers.values():
        moe = block.moe
        if moe.load_balance_coeff is None:
            continue
        counts = _plain(moe.tokens_per_expert_E).float()
        if dist.get_world_size() > 1:
            dist.all_reduce(counts)
        delta = moe.load_balance_coeff * torch.sign(counts.mean() - counts)
        _plain(moe.expert_bias_E).add_((delta - delta.mean()).to(moe.expert_bias_E.dtype))
        _plain(moe.tokens_per_expert_E).zero_()


def _plain(t):
    return t.to_local() if hasattr(t, "to_local") else t


# --------------------------------------------------------------------------- a config


def run_config(name, args, ctx) -> dict:
    dev, dtype, rank, W, clock = ctx["dev"], ctx["dtype"], ctx["rank"], ctx["W"], ctx["clock"]
    spec = CONFIGS[name]
    impls = comma_list(args.impls)
    if spec[2] % W:
        raise SystemExit(f"{name}: {spec[2]} experts do not divide over {W} ranks")
    models, notes = build_models(args, spec, ctx["pdims"], impls, dev, dtype)
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=args.lr, foreach=False) for k, m in models.items()
    }
    stamps = {k: {} for k in impls}
    if not args.compile:
        for k, m in models.items():
            time_moe_layers(m, clock, stamps[k])
    positions = torch.arange(args.seq_len, device=dev).expand(args.batch, args.seq_len)
    masks = None
    if args.attention == "flex":
        masks = next(iter(models.values())).get_attention_masks(positions)
    row = {"config": name, "spec": spec, "notes": notes, "impls": {}, "errors": {}}
    steps_ms, moe, losses = ({k: [] for k in impls} for _ in range(3))
    order = rr_orders(len(impls), args.warmup + args.steps)
    for i, turn in enumerate(order):
        step = max(0, i - args.warmup)  # warm-up steps repeat step 0's data
        tokens, labels = batch(args, rank, step, dev, args.vocab)
        for j in turn:
            k = impls[j]
            if k in row["errors"]:
                continue
            stamps[k].clear()
            clock.sync()
            dist.barrier()
            t0 = clock.stamp()
            try:
                loss = train_step(models[k], opts[k], tokens, labels, positions, masks)
            except Exception as e:  # noqa: BLE001 - reported in the row; every rank raises
                row["errors"][k] = error_text(e)
                continue
            t1 = clock.stamp()
            clock.sync()
            if i < args.warmup:
                continue
            ms = torch.tensor([clock.ms(t0, t1), moe_ms(clock, stamps[k]) or -1.0], device=dev)
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)
            steps_ms[k].append(ms[0].item())
            if ms[1] >= 0:
                moe[k].append(ms[1].item())
            losses[k].append(loss.float().item())
    tokens_all = args.batch * args.seq_len * W
    for k in impls:
        if k in row["errors"] or not steps_ms[k]:
            continue
        sp = spread(steps_ms[k])
        row["impls"][k] = {
            "step_ms": sp["median"],
            "spread": sp,
            "tokens_per_s": tokens_all / sp["median"] * 1e3,
            "moe_ms": spread(moe[k])["median"] if moe[k] else None,
            "losses": losses[k],
            "samples": steps_ms[k],
        }
    ref = row["impls"].get("torchtitan")
    for r in row["impls"].values():
        if ref is not None:
            r["speedup"] = ref["step_ms"] / r["step_ms"]
            r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
    del models, opts
    return row


# --------------------------------------------------------------------------- outputs


def format_line(row, k) -> str:
    r = row["impls"][k]
    return (
        f"   {k:<11} step {r['step_ms']:9.2f} ms  {r['tokens_per_s']:11.0f} tok/s  "
        f"moe {fmt(r['moe_ms']):>9} ms  x{fmt(r.get('speedup')):>5}  "
        f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}  "
        f"max |dloss| {fmt(r.get('max_loss_diff'), '.2e')}"
    )


def render_md(doc) -> str:
    """One run's table; a file of named runs (``runs``), each run's under its name."""
    if isinstance(doc.get("runs"), dict):
        return "\n".join(f"## {k}\n\n" + render_md(d) for k, d in doc["runs"].items())
    out = [
        f"# torchtitan MoE training steps: torchtitan vs groupmm ({doc['device']}, "
        f"EP = {doc['world']})",
        "",
        f"`{' '.join(doc['argv'])}`",
        "",
        f"torch {doc['torch']}, torchtitan {doc['torchtitan']}, dtype {doc['dtype']}, "
        f"{doc['layers']} layers, {doc['tokens_per_gpu']} tokens per GPU, compile "
        f"{doc['compile']}, {doc['steps']} steps after {doc['warmup']} warm-up each.",
        "",
        "| config | impl | step ms | spread (q1-q3) | tokens/s | MoE fwd+bwd ms | "
        "vs torchtitan | loss first -> last | max abs loss diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in doc["rows"]:
        for k, r in row["impls"].items():
            sp = r["spread"]
            out.append(
                f"| {row['config']} | {k} | {r['step_ms']:.2f} | {sp['q1']:.2f}-{sp['q3']:.2f} "
                f"| {r['tokens_per_s']:.0f} | {fmt(r['moe_ms'])} | {fmt(r.get('speedup'))}x | "
                f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} | "
                f"{fmt(r.get('max_loss_diff'), '.2e')} |"
            )
        for k, why in row["errors"].items():
            out.append(f"| {row['config']} | {k} | failed: {why} | | | | | | |")
        out += [f"\n{note}" for note in row["notes"]]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        from_json(args, one_file, lambda doc: print(render_md(doc)), render_md)
        return 0
    dev = init_ranks(args.device, 300)  # a plain `python3 bench_torchtitan.py`: one rank
    cuda = dev.type == "cuda"
    rank, W = dist.get_rank(), dist.get_world_size()
    args.attention = args.attention or ("flex" if cuda else "sdpa")
    args.tokens_per_gpu = args.tokens_per_gpu or (8192 if cuda else 64)
    args.seq_len = min(args.seq_len or (2048 if cuda else 32), args.tokens_per_gpu)
    args.batch = max(1, args.tokens_per_gpu // args.seq_len)
    args.vocab = args.vocab or (256 if args.configs == "tiny" else 32768)
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    code = 0
    try:
        ctx = dict(dev=dev, dtype=dtype, rank=rank, W=W, clock=Clock(cuda))
        ctx["pdims"] = setup_parallel(W, not cuda) if W > 1 else None
        doc = dict(
            schema="torchtitan-1",
            complete=False,
            argv=[f"torchrun --nproc-per-node {W} benches/bench_torchtitan.py", *sys.argv[1:]],
            started=started(),
            device=torch.cuda.get_device_name(dev) if cuda else "cpu",
            world=W,
            torch=torch.__version__,
            torchtitan=dist_version(("torchtitan",), "torchtitan"),
            groupmm=groupmm.build_info(),
            dtype=str(dtype).replace("torch.", ""),
            tokens_per_gpu=args.batch * args.seq_len,
            rows=[],
            **{k: getattr(args, k) for k in ("layers", "seq_len", "vocab", "compile")},
            **{k: getattr(args, k) for k in ("attention", "steps", "warmup")},
        )
        for name in comma_list(args.configs):
            if rank == 0:
                print(f"== {name} {CONFIGS[name]}, EP={W}, {doc['tokens_per_gpu']} tokens/GPU")
            row = run_config(name, args, ctx)
            if rank == 0:
                for k in row["impls"]:
                    print(format_line(row, k))
                for k, why in row["errors"].items():
                    print(f"   {k}: {why}")
                    code = 1
                doc["rows"].append(row)
                write_outputs(doc, args.json, args.md, render_md)
        doc["complete"] = True
        if rank == 0:
            write_outputs(doc, args.json, args.md, render_md)
            print(render_md(doc))
    except Exception as e:  # noqa: BLE001 - print on every rank, then leave
        print(f"[rank {rank}] {error_text(e)}", file=sys.stderr)
        traceback.print_exc()
        code = 1
    leave(code)


if __name__ == "__main__":
    sys.exit(main())
