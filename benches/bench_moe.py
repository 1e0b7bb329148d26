"""Whole MoE layers: groupmm's ``MoELayer`` against SonicMoE, the same layer on
``F.grouped_mm`` and the plain layer most code writes, in one process, same weights and
routing, the implementations of a row timed interleaved.

    python3 benches/bench_moe.py [--configs layer|layer-wide|fine|legacy|extra|all|NAME,...]
        [--tokens 4096,16384] [--routing router,uniform,skewed] [--passes fwd+bwd,fwd]
        [--rounds 10] [--no-sonic] [--budget-s SECONDS] [--json out.json] [--md out.md]
        [--png out.png]
    python3 benches/bench_moe.py --dry-run [...]     # the rows and a time estimate; no GPU
    python3 benches/bench_moe.py --from-json a.json[,b.json] [--json merged.json] [--md out.md]
        [--png out.png]                              # render (and merge) results; no GPU
    python3 benches/bench_moe.py --tiny              # one tiny config, T = 64 (a smoke run)

Implementations (every one is router -> dispatch -> SwiGLU experts -> weighted combine):

- ``fused``: ``groupmm.moe.MoELayer`` as it runs by default (``groupmm.fused.expert_block``:
  the up projection with SwiGLU and the "dgated" backward in one native call each, the
  other glue in one-pass row kernels);
- ``groupmm``: ``MoELayer(fused=False)``'s path (permute, ``GroupedExperts``, unpermute);
- ``torch-gmm``: that unfused path with ``torch.nn.functional.grouped_mm`` swapped in for
  the two grouped products (groupmm's glue, torch's GEMMs);
- ``plain``: ``F.grouped_mm`` with the glue most MoE code writes: ``x[src]`` to dispatch,
  ``y[inverse]`` and a weighted sum to combine (autograd's ``index_put`` backward, i.e.
  an ``index_add``);
- ``sonicmoe``: SonicMoE's ``sonicmoe.functional.moe_TC_softmax_topk_layer`` (optional:
  when it does not import, its column is "-" and the output says why), called as
  ``../shared/PEERS.md`` shows, on copies of the same weights made once before timing:
  router ``[E, d]`` as it is; ``w1`` ``(E, 2F, d)`` = ``w_in.transpose(1, 2)`` (rows
  ``[gate; up]``, ``concat_layout=True``) and ``w2`` ``(E, d, F)`` =
  ``w_out.transpose(1, 2)``, both handed over as ``.permute(1, 2, 0)``
  (``peer_sonicmoe.sonic_weights``; ``sonic_layout_reference`` is the layer those tensors
  define).

Configs (d_model, d_ff, experts, top-k), ``--configs`` takes names and groups:
``layer`` (the default) Qwen3-30B-A3B (2048, 768, 128, 8), OLMoE
(2048, 1024, 64, 8), Qwen3-235B-A22B (4096, 1536, 128, 8), gpt-oss-20b-like SwiGLU (2880,
2880, 32, 4); ``extra`` DeepSeek-V2-Lite's routed experts (2048, 1408, 64, 6); ``fine``
(fine-grained settings: narrow experts, top-k 2-16, up to 256 experts, the names spell out
d, F, E, k); ``layer-wide`` (layer + extra + GLM-4.5-Air-like (4096, 1408, 128, 8) + fine);
``legacy`` (older names and sizes) qwen3 (2048, 768, 128, 8), olmoe, dsv3-local (7168, 2048, 32,
8: the experts one rank holds under expert parallelism), mixtral (4096, 14336, 8, 2).

Routing: ``router`` (default): each implementation routes with the
layer's router, Qwen3 style: softmax over all experts in float32, top-k, renormalised
(SonicMoE: ``is_softmax_over_topk=False, norm_topk_probs=True``). ``uniform`` (experts drawn
uniformly, a token's k experts distinct) and ``skewed`` (Zipf 1.2 over experts, E/8 experts
empty) fix the experts and weight them with the router's renormalised probabilities at
those experts; SonicMoE's layer always routes with its own router, so it is not measured
there.

Passes: ``fwd+bwd`` (default): forward and backward of a fixed random output gradient, the
gradients of the parameters and of x set to None before each step; ``fwd``: forward under
``torch.no_grad``.

Timing (benches/timing.py, ``round_robin``; these GPUs' clocks drift by up to ~10 % within
seconds, ../shared/PEERS.md "Timing on these GPUs"): SonicMoE JIT-compiles and autotunes on
its first call per shape (minutes), so each row first runs one SonicMoE step on its own
(its wall seconds are reported as ``sonic_warm_s``); then the implementations of the row run
round-robin over ``--rounds`` rounds, the start rotating each round; a sample is CUDA events
around N back-to-back steps (N chosen per implementation so a sample lasts about
``--sample-ms``), each sample after the same GPU spin so the host has enqueued it. Reported:
the median per implementation, its spread (min-max over the rounds), and fused's speed over
each other implementation as a ratio of medians and round by round (min-max).

Memory: per implementation, one step after the timing, every gradient set to None first:
``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()`` minus
``torch.cuda.memory_allocated()`` just before the step (the parameters of every
implementation, x and the output gradient): the peak bytes a step allocates, parameter
gradients included.

Check: each implementation's output, and after the memory step its gradients of x, the
router weight and the expert weights (SonicMoE's mapped back to groupmm's layout), as
relative Frobenius differences to fused's (``rel_diff``, ``grad_rel_diff``).

Outputs: a line per row as it finishes, then the table and a summary of the measured
ratios (fused's speed over SonicMoE's: min, geomean, max; peak memory over SonicMoE's);
--json and --md rewritten after every row (a run cut short keeps what ran), --png at the
end (matplotlib, optional). Each names the device, the torch and CUDA versions,
SonicMoE's, quack's and nvidia-cutlass-dsl's versions where importable and groupmm's
``build_info()``. --from-json renders result files without a GPU (also the files of this
bench before round-robin timing); several, comma-separated, are merged into one table
(e.g. a table measured in two device commands), naming each command and any difference in
device or versions between them.

Code: the configs in benches/moe_configs.py, the layers and one row's measurement in
benches/moe_layers.py, rows, summary and rendering in benches/moe_report.py, SonicMoE's
adapter in benches/peer_sonicmoe.py, the timer and the result files in benches/timing.py
and benches/report.py.
"""

from __future__ import annotations

import sys
import time

import groupmm
import torch
from groupmm.moe import MoELayer
from harness.cli import (
    add_output_args,
    add_rr_args,
    budget_spent,
    check_lists,
    check_rr_args,
    line_buffered_stdout,
    no_cuda,
    parser,
)
from harness.configs import CONFIGS, MODELS, PASSES, ROUTINGS, TINY, select_configs
from harness.report import (
    from_json,
    record,
    run_doc,
    write_png,
)
from harness.report import write_outputs as report_write
from harness.timing import calls_for, lead_for, rr_settings
from moe_layers import run_row
from moe_report import (
    IMPLS,
    describe_env,
    format_row,
    label,
    merge_docs,
    print_table,
    render_md,
    render_png,
    summarize,
    upgrade_legacy,
)
from peers.sonicmoe import load_sonic, peer_versions, sonic_weights

#: where the rows run (the CPU tests point it at the CPU)
DEV = "cuda"

#: --dry-run's model of an H200 (PEERS.md): dense bf16 rate, the fraction of it a layer
#: step reaches, each implementation's time over fused's, and SonicMoE's warm-up (assumed)
EST_RATE, EST_EFF = 790e12, 0.4
EST_FACTOR = {"fused": 1.0, "groupmm": 1.05, "torch-gmm": 1.15, "plain": 1.5, "sonicmoe": 1.0}
EST_SONIC_FIRST_S, EST_SONIC_SHAPE_S = 300.0, 60.0


def plan_rows(configs: dict, tokens, routings, passes) -> list:
    """The rows of a run, in the order they run: per config, per T, per routing, per pass."""
    rows = []
    for name, (d, f, E, k) in configs.items():
        for T in tokens:
            for routing in routings:
                for p in passes:
                    rows.append(
                        {
                            "config": name,
                            "model": MODELS.get(name, name),
                            "d_model": d,
                            "d_ff": f,
                            "experts": E,
                            "top_k": k,
                            "T": T,
                            "routing": routing,
                            "pass": p,
                        }
                    )
    return rows


# ----------------------------------------------------------------------------------------
# the plan's estimate (--dry-run; no GPU)


def step_flops(row: dict) -> float:
    """FLOPs of one fwd+bwd (or fwd) step of the experts: 2·T·k·d·3F forward (up 2F,
    down F), three times that with the backward."""
    fwd = 2.0 * row["T"] * row["top_k"] * row["d_model"] * 3 * row["d_ff"]
    return fwd * (3.0 if row["pass"] == "fwd+bwd" else 1.0)


def estimate_s(plan, args, sonic: bool) -> dict:
    """A rough wall-time estimate of a plan on an H200: every implementation's warm-up,
    samples and check steps at EST_EFF of the dense rate (scaled by EST_FACTOR), a second
    of host work per row, and SonicMoE's warm-up at the assumed EST_SONIC_FIRST_S for the
    first row and EST_SONIC_SHAPE_S for every other. A budget check, not a measurement."""
    gpu, warm, host = 0.0, 0.0, 0.0
    impls = [k for k in IMPLS if sonic or k != "sonicmoe"]
    for row in plan:
        t_f = step_flops(row) / (EST_EFF * EST_RATE) * 1e3  # ms
        ms = {k: t_f * EST_FACTOR[k] for k in impls}
        if row["routing"] != "router":
            ms.pop("sonicmoe", None)
        calls = {
            k: args.calls or calls_for(v, args.sample_ms, args.min_calls, args.max_calls)
            for k, v in ms.items()
        }
        lead = max(lead_for(2.0, v, calls[k]) for k, v in ms.items())  # ~2 ms host per step
        for k, v in ms.items():
            # warm-up, round_robin's host/GPU estimate (4 steps), output check, memory step
            gpu += (args.warmup + 6) * v + args.rounds * (calls[k] * v + lead)
        if "sonicmoe" in ms:
            warm += EST_SONIC_FIRST_S if warm == 0.0 else EST_SONIC_SHAPE_S
        host += 1.0
    total = gpu / 1e3 + warm + host + (15.0 if sonic else 0.0)  # + SonicMoE's import
    return {
        "rows": len(plan),
        "gpu_s": gpu / 1e3,
        "sonic_warm_s": warm,
        "host_s": host,
        "total_s": total,
    }


# ----------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = parser(__doc__)
    p.add_argument(
        "--configs",
        default="layer",
        help="comma list of config names and groups: layer (default), layer-wide, fine, "
        "extra, legacy, all",
    )
    p.add_argument("--tokens", default="4096,16384", help="comma list of T (tokens)")
    p.add_argument("--routing", default="router", help="router (default), uniform, skewed")
    p.add_argument("--passes", default="fwd+bwd", help="fwd+bwd (default), fwd")
    p.add_argument("--tiny", action="store_true", help="one tiny config, T = 64 (a smoke run)")
    add_rr_args(p, rounds=10, sample_ms=25.0, min_calls=2, max_calls=10, unit="steps", reps=True)
    p.add_argument("--no-sonic", action="store_true", help="leave SonicMoE out even if installed")
    add_output_args(p, png=True)
    p.add_argument("--replot", help="old name of --from-json")
    args = p.parse_args(argv)
    args.from_json = args.from_json or args.replot
    check_rr_args(p, args)
    check_lists(p, (args.routing, ROUTINGS), (args.passes, PASSES))
    return args


def write_outputs(doc: dict, args) -> None:
    """JSON and markdown of the result document (report.write_outputs)."""
    report_write(doc, args.json, args.md, render_md)


def dry_run(plan, configs, args) -> int:
    """--dry-run: the rows and a rough estimate of the wall time; no GPU."""
    for r in plan:
        print(
            f"{r['config']:15} T={r['T']:<6} {r['routing']:7} {r['pass']:7} "
            f"d={r['d_model']:<5} d_ff={r['d_ff']:<5} E={r['experts']:<3} k={r['top_k']} "
            f"rows/expert {r['T'] * r['top_k'] / r['experts']:7.1f}  "
            f"{step_flops(r) / 1e12:6.2f} TFLOP/step  {r['model']}"
        )
    est = estimate_s(plan, args, sonic=not args.no_sonic)
    sonic = ""
    if est["sonic_warm_s"]:
        sonic = (
            f", SonicMoE warm-ups ~{est['sonic_warm_s']:.0f} s (assumed "
            f"{EST_SONIC_FIRST_S:.0f} s for the first row, {EST_SONIC_SHAPE_S:.0f} s per "
            "later row: JIT compile and autotune, cached on disk afterwards)"
        )
    print(
        f"{est['rows']} rows over {len(configs)} configs; estimated wall on an H200 "
        f"~{est['total_s']:.0f} s (timed steps ~{est['gpu_s']:.0f} s{sonic}, host "
        f"~{est['host_s']:.0f} s; a rough model, not a measurement)"
    )
    return 0


def main(argv=None) -> int:
    line_buffered_stdout()
    args = parse_args(argv)
    if args.from_json:
        doc = from_json(args, merge_docs, print_table, render_md, upgrade_legacy)
        write_png(render_png, doc, args.png)
        return 0

    configs = TINY if args.tiny else {c: CONFIGS[c] for c in select_configs(args.configs)}
    tokens = [64] if args.tiny else [int(t) for t in args.tokens.split(",")]
    plan = plan_rows(configs, tokens, args.routing.split(","), args.passes.split(","))
    if args.dry_run:
        return dry_run(plan, configs, args)
    if no_cuda():
        return 2
    t_start = time.perf_counter()
    dev = torch.device(DEV)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    S, why = (None, "--no-sonic") if args.no_sonic else load_sonic()
    doc = run_doc("moe-2", argv)
    doc.update(
        dtype=str(dtype).replace("torch.", ""),
        groupmm=groupmm.build_info(),
        sonicmoe=S is not None,
        sonicmoe_why=why,
        versions=peer_versions(),
        timer={**rr_settings(args), "sonic_warmup": "one step per row before timing"},
        rows=[],
        skipped=[],
    )
    for ln in describe_env(doc):
        print(ln)
    n_rows = len(plan)
    done = 0
    for cname, (d, f, E, k) in configs.items():
        mine = [r for r in plan if r["config"] == cname]
        spent = budget_spent(args, t_start)
        if spent:
            doc["skipped"] += [{"row": label(r), "why": spent} for r in mine]
            print(f"skip {cname}: budget of {args.budget_s:g} s spent")
            continue
        print(f"== {cname}: d={d} d_ff={f} E={E} k={k} ({MODELS.get(cname, cname)})")
        torch.manual_seed(0)
        layer = MoELayer(d, f, E, k, aux_loss_coef=0.0, device=dev, dtype=dtype)
        sonic_w = sonic_weights(layer) if S is not None else None  # copied once, untimed
        for r in mine:
            spent = budget_spent(args, t_start)
            if spent:
                doc["skipped"].append({"row": label(r), "why": spent})
                print(f"skip {label(r)}: budget spent")
                continue
            try:
                row = run_row(r, layer, S, sonic_w, why, args, dev, dtype)
            except torch.cuda.OutOfMemoryError as e:
                doc["skipped"].append({"row": label(r), "why": f"out of memory: {str(e)[:80]}"})
                print(f"skip {label(r)}: out of memory")
                continue
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            done += 1
            record(doc, t_start, summarize, lambda d: write_outputs(d, args), row)
            print(f"[{done:3}/{n_rows} {doc['elapsed_s']:5.0f}s] " + format_row(row))
            for who, err in row["errors"].items():
                print(f"      {who}: {err}")
        del layer, sonic_w
    record(doc, t_start, summarize, lambda d: write_outputs(d, args))
    print_table(doc)
    print(f"wall {doc['elapsed_s']:.0f} s")
    write_png(render_png, doc, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
