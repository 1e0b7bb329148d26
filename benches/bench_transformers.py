r"""groupmm inside Hugging Face transformers: experts implementation "groupmm" against
transformers' "grouped_mm", "eager" and "sonicmoe" (when it loads), same model and inputs.

    python benches/bench_transformers.py [--json out.json] [--reps 10] [--tokens 4096,16384]
    python benches/bench_transformers.py --device cpu --tiny      # a quick run anywhere
    python benches/bench_transformers.py --configs qwen3-30b-a3b --tokens 4096 --layers 2 \
        --profile-host --json out.json                            # host vs GPU time
    python benches/bench_transformers.py --from-json out.json [--md out.md]  # no GPU

Models of ``--layers`` decoder layers with random weights (Qwen3-30B-A3B-sized,
OLMoE-sized). Passes: the whole layer and its MoE block alone, forward and forward +
backward; median ms of ``--reps`` steps, the best of ``--rounds`` rounds. "eager" runs at
the smallest T only. ``--profile-host``: per step the host's wall and CPU time, the
profiled host time, the direct aten ops, the GPU's busy time and kernels, and host / GPU
(> 1: the host is the bottleneck).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness.cli import add_doc_args, parser  # noqa: E402
from harness.report import error_text, from_json, md_row, one_file, rel_diff, started, write_outputs  # noqa: E402  # noqa: E402
from harness.timing import median_ms  # noqa: E402


def _config(cls, hidden, inter, experts, k, heads, kv, **extra):
    """(config class, its keyword arguments)."""
    kw = dict(hidden_size=hidden, intermediate_size=inter, num_experts=experts)
    kw.update(num_experts_per_tok=k, num_attention_heads=heads, num_key_value_heads=kv)
    return cls, {**kw, **extra}


QWEN3 = dict(moe_intermediate_size=768, head_dim=128, norm_topk_prob=True)
CONFIGS = {
    "qwen3-30b-a3b": _config("Qwen3MoeConfig", 2048, 6144, 128, 8, 32, 4, **QWEN3),
    "olmoe-1b-7b": _config("OlmoeConfig", 2048, 1024, 64, 8, 16, 16),
}
QWEN3_TINY = dict(moe_intermediate_size=32, head_dim=16)
TINY = {
    "qwen3-tiny": _config("Qwen3MoeConfig", 64, 128, 16, 4, 4, 2, **QWEN3_TINY),
    "olmoe-tiny": _config("OlmoeConfig", 64, 48, 8, 4, 4, 4),
}
#: every model's vocabulary and special tokens
BASE = dict(vocab_size=256, max_position_embeddings=32768, pad_token_id=0, bos_token_id=1)
IMPLS = ["groupmm", "grouped_mm", "eager", "sonicmoe"]
PASSES = ["layer fwd", "layer fwd+bwd", "moe fwd", "moe fwd+bwd"]


def build_model(cls_name: str, kwargs: dict, device: str, dtype, seed: int, layers: int = 1):
    import transformers

    config = getattr(transformers, cls_name)(
        num_hidden_layers=layers, eos_token_id=2, **BASE, **kwargs
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype)


def tidy(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def set_impl(model, impl: str) -> None:
    if impl == "groupmm":
        from groupmm.integrations.transformers import enable

        enable(model)
    else:
        model.set_experts_implementation(impl)


def steps(model, tokens: int, device: str, dtype: torch.dtype, seed: int):
    """The four passes as closures over fixed inputs."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = model.config.hidden_size
    ids = torch.randint(3, 256, (1, tokens), generator=gen).to(device)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    x_grad = x.clone().requires_grad_(True)
    go_logits = torch.randn(1, tokens, 256, generator=gen).to(device=device, dtype=dtype)
    go_x = torch.randn(1, tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    block = model.model.layers[0].mlp  # the first layer's MoE block
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731

    def layer_fwd():
        with torch.no_grad():
            model(ids)

    def layer_step():
        model.zero_grad(set_to_none=True)
        model(ids).logits.backward(go_logits)

    def moe_fwd():
        with torch.no_grad():
            block(x)

    def moe_step():
        model.zero_grad(set_to_none=True)
        x_grad.grad = None
        first(block(x_grad)).backward(go_x)

    def moe_out():
        with torch.no_grad():
            return first(block(x)).float()

    return dict(zip(PASSES, (layer_fwd, layer_step, moe_fwd, moe_step))), moe_out


STEP_MARK = "bench_transformers.step"


def _union_ms(spans) -> float:
    """Total length in ms of the union of ``(start_ns, end_ns)`` intervals."""
    total, end = 0, -math.inf
    for a, b in sorted(spans):
        total += max(0, b - max(a, end))
        end = max(end, b)
    return total / 1e6


def _direct_ops(events) -> int:
    """aten ops not called from inside another aten op."""
    n = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        n += parent is None
    return n


def host_times(step, device: str, steps: int) -> dict:
    """Median wall and CPU ms of one ``step()`` over ``steps``, each from an idle device."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    host, cpu = [], []
    for _ in range(steps):
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    sync()
    return {"host_ms": statistics.median(host), "cpu_ms": statistics.median(cpu)}


def device_profile(step, device: str, steps: int) -> dict:
    """Medians over ``steps`` profiled ``step()``s: host and device ms, kernels, ops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_MARK):
                step()
            sync()
    raw = prof.profiler.kineto_results.events()
    marks = sorted(
        (e.start_ns(), e.end_ns())
        for e in raw
        if e.name() == STEP_MARK and e.device_type() == DeviceType.CPU
    )
    device_spans = [
        (e.start_ns(), e.end_ns())
        for e in raw
        if e.device_type() == DeviceType.CUDA and not e.is_user_annotation()
        if e.name() != STEP_MARK
    ]
    prof_host, gpu, gpu_sum, kernels = [], [], [], []
    for i, (start, end) in enumerate(marks):
        stop = marks[i + 1][0] if i + 1 < len(marks) else float("inf")
        mine = [(a, b) for a, b in device_spans if start <= a < stop]
        prof_host.append((end - start) / 1e6)
        gpu.append(_union_ms(mine))
        gpu_sum.append(sum(b - a for a, b in mine) / 1e6)
        kernels.append(len(mine))
    med = statistics.median
    return {
        "prof_host_ms": med(prof_host) if prof_host else None,
        "gpu_ms": med(gpu) if gpu else 0.0,
        "gpu_sum_ms": med(gpu_sum) if gpu_sum else 0.0,
        "kernels": med(kernels) if kernels else 0,
        "ops": _direct_ops(prof.events()) / max(len(marks), 1),
    }


def add_device_profiles(rows, configs, impls, device, dtype, args) -> None:
    """Each row's :func:`device_profile` per implementation, and host over GPU."""
    for name, (cls_name, kwargs) in configs.items():
        mine = [r for r in rows if r["config"] == name]
        model = build_model(cls_name, kwargs, device, dtype, seed=0, layers=args.layers)
        for tokens in sorted({r["T"] for r in mine}):
            closures, _ = steps(model, tokens, device, dtype, seed=1)
            at_t = [r for r in mine if r["T"] == tokens]
            for impl in impls:
                here = [r for r in at_t if isinstance(r["host"].get(impl), dict)]
                if not here:
                    continue
                set_impl(model, impl)
                for r in here:
                    h = r["host"][impl]
                    try:
                        h.update(device_profile(closures[r["pass"]], device, args.profile_steps))
                    except Exception as err:
                        r["host"][impl] = error_text(err)
                        continue
                    h["host_over_gpu"] = h["host_ms"] / h["gpu_ms"] if h["gpu_ms"] else None
        del model
        tidy(device)


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny configs and T (CPU smoke run)")
    ap.add_argument("--tokens", default=None, help="comma-separated T (default 4096,16384)")
    ap.add_argument("--configs", default=None, help="comma-separated config names")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--passes", default=",".join(PASSES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="best median over rounds")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    add_doc_args(ap, every="run", merge=False)
    ap.add_argument("--layers", type=int, default=1, help="decoder layers of each model")
    host_help = "also host vs GPU time per step (torch.profiler; module docstring)"
    ap.add_argument("--profile-host", action="store_true", help=host_help)
    ap.add_argument("--profile-steps", type=int, default=5, help="steps profiled per pass")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.profile_steps < 1:
        ap.error("--layers and --profile-steps: expected a positive int")
    return args


def time_passes(model, closures, moe_out, passes, impls, skip_eager, args) -> tuple:
    """``{pass: {impl: ms or why not}}``, the best of ``--rounds`` rounds of every
    implementation, and each implementation's MoE output."""
    results = {p: {} for p in passes}
    outs = {}
    if "eager" in impls and skip_eager:  # eager (a loop) is slow
        for p in passes:
            results[p]["eager"] = "skipped (slow)"
    for _ in range(args.rounds):
        for impl in impls:
            if any(isinstance(results[p].get(impl), str) for p in passes):
                continue
            try:
                set_impl(model, impl)
                if impl not in outs:
                    outs[impl] = moe_out()
            except Exception as err:  # a missing or failing implementation
                for p in passes:
                    results[p][impl] = error_text(err)
                continue
            for p in passes:
                try:
                    ms = median_ms(closures[p], args.reps, args.warmup, cuda=args.device == "cuda")
                except Exception as err:
                    results[p][impl] = error_text(err)
                    continue
                prev = results[p].get(impl)
                results[p][impl] = ms if prev is None else min(prev, ms)
            tidy(args.device)
    return results, outs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        from_json(args, one_file, lambda doc: print(render_md(doc)), render_md)
        return 0

    import groupmm
    import transformers
    from groupmm.integrations.transformers import register

    register()
    device, dtype = args.device, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    configs = TINY if args.tiny else CONFIGS
    if args.configs:
        configs = {k: v for k, v in {**CONFIGS, **TINY}.items() if k in args.configs.split(",")}
    default_tokens = "64,256" if args.tiny else "4096,16384"
    tokens_list = [int(t) for t in (args.tokens or default_tokens).split(",")]
    impls = args.impls.split(",")
    passes = args.passes.split(",")

    env = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "groupmm": groupmm.build_info(),
        **{k: getattr(args, k) for k in ("dtype", "reps", "warmup", "rounds", "layers")},
    }
    print(f"# {env['device']} | torch {env['torch']} | transformers {env['transformers']}")
    doc = {"schema": "transformers/1", "argv": sys.argv[1:] if argv is None else list(argv)}
    doc.update(started=started(), env=env, impls=impls, rows=[])
    rows = doc["rows"]
    t_start = time.perf_counter()
    for name, (cls_name, kwargs) in configs.items():
        model = build_model(cls_name, kwargs, device, dtype, seed=0, layers=args.layers)
        for tokens in tokens_list:
            closures, moe_out = steps(model, tokens, device, dtype, seed=1)
            slow = tokens > min(tokens_list)
            results, outs = time_passes(model, closures, moe_out, passes, impls, slow, args)
            host = {p: {} for p in passes}
            for impl in impls if args.profile_host else []:
                if any(isinstance(results[p].get(impl), str) for p in passes):
                    continue
                set_impl(model, impl)
                for p in passes:
                    try:
                        host[p][impl] = host_times(closures[p], device, args.profile_steps)
                    except Exception as err:
                        host[p][impl] = error_text(err)
                tidy(device)
            diff = rel_diff(outs.get("groupmm"), outs.get("grouped_mm"))
            for p in passes:
                row = {"config": name, "T": tokens, "pass": p, "ms": results[p], "rel_diff": diff}
                rows.append({**row, "host": host[p]} if args.profile_host else row)
        del model
        tidy(device)
    # the profiled steps come after every host time above: once torch.profiler has run in
    # the process (CUPTI attached), every later launch costs more host time
    if args.profile_host:
        add_device_profiles(rows, configs, impls, device, dtype, args)
    env["seconds"] = round(time.perf_counter() - t_start, 1)
    print(render_md(doc) + f"# {env['seconds']} s")
    write_outputs(doc, args.json, args.md, render_md)
    return 0


def cell(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else ("n/a" if v is None else str(v)[:40])


def table_head(head) -> list:
    return [md_row(head), "|" + "---|" * len(head)]


#: the --profile-host table's columns: heading, field
HOST_COLUMNS = {"host ms": "host_ms", "cpu ms": "cpu_ms", "prof host ms": "prof_host_ms"}
HOST_COLUMNS.update({"GPU ms": "gpu_ms", "GPU sum": "gpu_sum_ms", "kernels": "kernels"})
HOST_COLUMNS.update({"ops": "ops", "host/GPU": "host_over_gpu"})


def render_md(doc) -> str:
    """The time table, then (``--profile-host``) one line per pass and implementation."""
    rows = doc["rows"]
    impls = doc.get("impls") or list(dict.fromkeys(i for r in rows for i in r["ms"]))
    out = table_head(["config", "T", "pass", *impls, "grouped_mm/groupmm", "rel diff"])
    notes = {}
    for r in rows:
        failed = {i: v for i, v in r["ms"].items() if isinstance(v, str) and v[:7] != "skipped"}
        for impl, v in failed.items():
            notes.setdefault(impl, v)
        cells = ["failed" if i in failed else cell(r["ms"].get(i)) for i in impls]
        a, b = r["ms"].get("groupmm"), r["ms"].get("grouped_mm")
        ratio = f"{b / a:.2f}x" if isinstance(a, float) and isinstance(b, float) else "n/a"
        diff = "n/a" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"
        out.append(md_row([r["config"], str(r["T"]), r["pass"], *cells, ratio, diff]))
    out += [f"# {impl}: {err}" for impl, err in notes.items()]
    if any("host" in r for r in rows):
        out += ["", *table_head(["config", "T", "pass", "impl", *HOST_COLUMNS])]
    fields = HOST_COLUMNS.values()
    for r in rows:
        for impl in impls:
            h = r.get("host", {}).get(impl)
            if h is None:
                continue
            if isinstance(h, str):
                cells = ["failed: " + h[:60]] + [""] * (len(HOST_COLUMNS) - 1)
            else:
                cells = [cell(h[k]) if k != "kernels" else str(round(h[k])) for k in fields]
            out.append(md_row([r["config"], str(r["T"]), r["pass"], impl, *cells]))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
