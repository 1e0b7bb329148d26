"""dev/profile_moe.py on the CPU: kernel categories, per-category sums, the row
summaries, the markdown (dev/profile_kernels.py), argument parsing, and main()'s flow
with the profiler, CUDA and SonicMoE stood in for (the GPU run itself is the lead's)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from conftest import load_bench, load_dev

configs = load_bench("harness.configs")
sonic = load_bench("peers.sonicmoe")
prof = load_dev("profile_moe")  # puts benches/ on sys.path itself, after dev/
prof_report = load_dev("profile_kernels")

# kernel names as torch.profiler shows them in a GPU profile; SonicMoE's quack
# GEMM prefixes as public traces show them, its top-k's name assumed from CuTe DSL's naming
VARLEN = (
    "void gmm::varlen::varlen_kernel<gmm::varlen::Cfg<cutlass::bfloat16_t, "
    "(gmm::varlen::Mode)0, true, 192, (gmm::varlen::Epi)1>>(gmm::varlen::Params)"
)
NVJET = "nvjet_sm90_tst_128x128_64x6_1x2_h_bz_TNT"
TORCH_GMM = (
    "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel"
    "13GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS_4gemm10collective"
)
QUACK_UP = "kernel_cutlass_kernel_quackgemm_actGemmGatedSm90_object_at__TiledMMA_CopyAtom_0"
QUACK_DGATED = "kernel_cutlass_kernel_quackgemm_dactGemmDGatedSm90_object_at__tensorptrbf16_0"
SONIC_TOPK = "kernel_cutlass_kernel_sonicmoefunctionaltopk_softmaxTopK_Softmax_object_at__0"
GATHER_SUM = (
    "void gmm::(anonymous namespace)::gather_sum<__nv_bfloat16, __nv_bfloat16, 8>"
    "(__nv_bfloat16 const*, int const*, __nv_bfloat16 const*, __nv_bfloat16*, long, long, "
    "long, long, int*)"
)
SCATTER_ROWS = (
    "void gmm::(anonymous namespace)::scatter_rows<__nv_bfloat16, __nv_bfloat16, 8>"
    "(__nv_bfloat16 const*, int const*, __nv_bfloat16 const*, __nv_bfloat16*, long, long, long)"
)
VGATHER = (
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, "
    "long, long, bool)"
)
RADIX = (
    "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<"
    "at_cuda_detail::cub::detail::radix::policy_hub<long, long, unsigned int>::Policy900>"
)
BINARY = (
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
    "at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
    "at::native::binary_internal::MulFunctor<float>>>(at::TensorIteratorBase&, "
    "at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
    "at::native::binary_internal::MulFunctor<float>> const&)::{lambda(int)#1}>(int, "
    "at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::BFloat16>>)"
)

CASES = [
    (VARLEN, "gemm"),
    (NVJET, "gemm"),
    (TORCH_GMM, "gemm"),
    ("void at::cuda::detail::prepare_grouped_gemm_data<c10::BFloat16, float>(...)", "gemm"),
    (QUACK_UP, "gemm"),
    (QUACK_DGATED, "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)", "gemm"),
    ("void gmm::build_packed_args(gmm::PackedDesc)", "gemm"),
    # CuTe DSL names every kernel kernel_cutlass_*: the top-k is routing, not a GEMM
    (SONIC_TOPK, "routing"),
    (RADIX, "routing"),
    (
        "void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortHistogramKernel<...>",
        "routing",
    ),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(...)", "routing"),
    ("void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(...)", "routing"),
    ("_softmax_bwd_scatter_small_kernel", "routing"),
    ("_bitmatrix_metadata_compute_stage2", "routing"),
    ("_compute_col_partial_sum_kernel", "routing"),
    ("gmm::(anonymous namespace)::invert(int const*, int*, long, long, int*)", "routing"),
    (GATHER_SUM, "rows"),
    (SCATTER_ROWS, "rows"),
    (VGATHER, "rows"),
    ("token_gather_sum_kernel", "rows"),
    ("void gmm::(anonymous namespace)::row_dots<__nv_bfloat16, __nv_bfloat16, 8>(...)", "rows"),
    ("void (anonymous namespace)::indexing_backward_kernel<c10::BFloat16, 8>(...)", "rows"),
    ("void at::native::index_elementwise_kernel<128, 4, ...>(long, ...)", "rows"),
    (
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<at::native::"
        "(anonymous namespace)::OpaqueType<2u>, unsigned int, 2, 64, 64, 16, 16>(...)",
        "rows",
    ),
    (
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()() "
        "const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, "
        "unsigned int>>(int, ...)",
        "rows",
    ),
    ("void at::native::_scatter_gather_elementwise_kernel<128, 8, ...>(int, ...)", "rows"),
    (BINARY, "elementwise"),
    (
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::"
        "BFloat16>, std::array<char*, 3ul>>(int, at::native::CUDAFunctor_add<c10::BFloat16>, ...)",
        "elementwise",
    ),
    (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
        "func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()>>>(...)",
        "elementwise",
    ),
    (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
        "elementwise",
    ),
    ("void gmm::(anonymous namespace)::swiglu<__nv_bfloat16, 8>(...)", "elementwise"),
    # the grouped GEMM's own zeroing of empty groups' outputs
    ("void gmm::zero_fill(gmm::GemmSet, int)", "gemm"),
    ("Memset (Device)", "elementwise"),
    ("my_custom_kernel", "other"),
]


@pytest.mark.parametrize("name,cat", CASES)
def test_classify(name, cat):
    assert prof_report.classify(name) == cat
    assert prof_report.classify(name.upper()) == cat  # case-insensitive


def test_patterns_are_one_table_in_category_order():
    # matched in this order (gemm first, routing before rows), shown in CATEGORIES order
    cats = [c for c, _ in prof_report.KERNEL_PATTERNS]
    assert cats == ["gemm", "routing", "rows", "elementwise"]
    assert set(cats) | {"other"} == set(prof_report.CATEGORIES)
    pats = [p for _, ps in prof_report.KERNEL_PATTERNS for p in ps]
    assert all(p == p.lower() for p in pats)  # matched against the lower-cased name
    assert "cutlass" not in pats  # CuTe DSL names every kernel kernel_cutlass_*


# ---------------------------------------------------------------------- tables and sums

#: (name, device µs over 4 steps, calls over 4 steps), as profile_steps returns them
EVENTS = [
    (GATHER_SUM, 4300.0, 16),
    (VARLEN, 7000.0, 8),
    (NVJET, 100.0, 4),
    (RADIX, 120.0, 16),
    (BINARY, 400.0, 6),  # 1.5 calls a step
    ("my_custom_kernel", 40.0, 4),
    (SCATTER_ROWS, 1044.0, 4),
    ("no device time", 0.0, 4),
]


def test_kernel_table_per_step_longest_first():
    ks = prof_report.kernel_table(EVENTS, steps=4)
    assert [k["name"] for k in ks] == [
        VARLEN,
        GATHER_SUM,
        SCATTER_ROWS,
        BINARY,
        RADIX,
        NVJET,
        "my_custom_kernel",
    ]
    v = ks[0]
    assert v == {"name": VARLEN, "ms": 1.75, "count": 2, "category": "gemm"}
    assert ks[1]["ms"] == pytest.approx(1.075) and ks[1]["count"] == 4
    assert ks[3]["count"] == 1.5 and ks[3]["category"] == "elementwise"
    assert ks[0]["name"] == VARLEN  # whole, untruncated
    with pytest.raises(ValueError):
        prof_report.kernel_table(EVENTS, steps=0)


def test_by_category_and_row_sums():
    ks = prof_report.kernel_table(EVENTS, steps=4)
    cats = prof_report.by_category(ks)
    assert list(cats) == list(prof_report.CATEGORIES)
    assert cats["gemm"] == pytest.approx(1.75 + 0.025)
    assert cats["rows"] == pytest.approx(1.075 + 0.261)
    assert cats["routing"] == pytest.approx(0.03)
    assert cats["elementwise"] == pytest.approx(0.1)
    assert cats["other"] == pytest.approx(0.01)
    row = prof_report.make_row("qwen3", 4096, "fused", ks, routing="router")
    assert row["total_ms"] == pytest.approx(sum(e[1] for e in EVENTS) / 4e3)
    assert row["total_ms"] == pytest.approx(sum(cats.values()))
    assert row["routing"] == "router" and row["kernels"] == ks
    assert prof_report.by_category([]) == dict.fromkeys(prof_report.CATEGORIES, 0.0)


def test_summary_line_and_kernel_block():
    row = prof_report.make_row(
        "qwen3", 4096, "fused", prof_report.kernel_table(EVENTS, 4), routing="router"
    )
    assert prof_report.summary_line(row) == (
        "qwen3 T=4096 fused: 3.251 ms = 1.775 gemm + 1.336 rows + 0.030 routing "
        "+ 0.100 elementwise + 0.010 other"
    )
    lines = prof_report.kernel_block(row, top=3, width=40)
    assert lines[0] == "== fused: qwen3 T=4096 router: 3.251 ms of kernels per step"
    assert lines[1] == f"   1.750 ms    2x  gemm        {VARLEN[:40]}"
    assert lines[2].startswith("   1.075 ms    4x  rows        void gmm::")
    assert lines[4] == "   0.165 ms in 4 more kernels"  # 0.1 + 0.03 + 0.025 + 0.01
    assert len(lines) == 5
    lines = prof_report.kernel_block(row, top=22)
    assert len(lines) == 8 and "   0.100 ms  1.5x  elementwise" in lines[4]


# ---------------------------------------------------------------------- markdown


def _cat_row(config, T, impl, **ms):
    """A row whose kernels are one per category with the given ms."""
    names = {
        "gemm": VARLEN,
        "rows": GATHER_SUM,
        "routing": RADIX,
        "elementwise": BINARY,
        "other": "x",
    }
    ks = [{"name": names[c], "ms": v, "count": 1, "category": c} for c, v in ms.items()]
    return prof_report.make_row(config, T, impl, ks, routing="router")


def _doc(rows, **kw):
    doc = {
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "command": ["--configs", "layer", "--md", "o.md"],
        "routing": "router",
        "steps": 5,
        "warmup": 3,
        "rows": rows,
        "skipped": [],
    }
    doc.update(kw)
    return doc


def test_render_md_fused_against_sonicmoe():
    rows = [
        _cat_row("qwen3-30b-a3b", 16384, "fused", gemm=5.8, rows=1.2, routing=0.1, other=0.4),
        _cat_row("qwen3-30b-a3b", 16384, "sonicmoe", gemm=5.5, rows=0.5, elementwise=0.56),
        _cat_row("qwen3-30b-a3b", 16384, "groupmm", gemm=6.0, rows=2.0),
        _cat_row("olmoe", 4096, "fused", gemm=2.0, rows=0.25, elementwise=0.25),
    ]
    skipped = [{"config": "olmoe", "tokens": 4096, "impl": "sonicmoe", "why": "OOM"}]
    md = prof_report.render_md(_doc(rows, skipped=skipped))
    lines = md.splitlines()
    assert "Device: NVIDIA H200; torch 2.11.0+cu130; routing router" in md
    assert "`python3 dev/profile_moe.py --configs layer --md o.md`" in md
    # fused 7.5 = 5.8 + 1.2 + 0.5 rest; SonicMoE 6.56 = 5.5 + 0.5 + 0.56; gap 0.94 = 0.3 + 0.64
    assert (
        "| qwen3-30b-a3b | 16384 | 7.500 | 6.560 | 5.800 | 1.200 | 0.500 | 5.500 | 0.500 | "
        "0.560 | +0.940 (+0.300, +0.640) |"
    ) in lines
    assert "| olmoe | 4096 | 2.500 | - | 2.000 | 0.250 | 0.250 | - | - | - | - |" in lines
    assert "GiB" not in md and "byte" not in md.lower()
    assert (
        "| qwen3-30b-a3b | 16384 | groupmm | 8.000 | 6.000 | 2.000 | 0.000 | 0.000 | 0.000 |"
        in (lines)
    )
    assert "| olmoe | 4096 | fused | 2.500 | 2.000 | 0.250 | 0.000 | 0.250 | 0.000 |" in lines
    assert "- skipped olmoe T=4096 sonicmoe: OOM" in lines
    # the pair table has one line per (config, tokens), in the order they ran
    pair_lines = [ln for ln in lines if ln.startswith("| qwen3") or ln.startswith("| olmoe")]
    assert pair_lines[0].startswith("| qwen3-30b-a3b | 16384 | 7.500")
    assert pair_lines[1].startswith("| olmoe | 4096 | 2.500")
    assert "SonicMoE not profiled" not in md
    md = prof_report.render_md(
        _doc(rows[3:], sonicmoe_why="ModuleNotFoundError: No module named 'x'")
    )
    assert "SonicMoE not profiled: ModuleNotFoundError: No module named 'x'" in md


def test_gap_and_summary_lines():
    f = _cat_row("olmoe", 16384, "fused", gemm=7.0, rows=1.5, other=0.5)
    s = _cat_row("olmoe", 16384, "sonicmoe", gemm=7.5, rows=0.5)
    total, g, ng = prof_report.gap(f, s)
    assert (total, g) == (pytest.approx(1.0), pytest.approx(-0.5)) and ng == pytest.approx(1.5)
    assert prof_report.gap(f, None) is None and prof_report.gap(None, s) is None
    lines = prof_report.summary_lines(_doc([f, s]))
    assert lines[0].startswith("olmoe T=16384 fused: 9.000 ms = 7.000 gemm + 1.500 rows")
    assert lines[1].startswith("olmoe T=16384 sonicmoe: 8.000 ms")
    assert (
        lines[2] == "olmoe T=16384 gap fused - SonicMoE: +1.000 ms (gemm -0.500, non-gemm +1.500)"
    )
    assert len(lines) == 3


def test_from_json_of_an_older_file(monkeypatch, tmp_path, capsys):
    # a file of an older run: rows with a "bytes" entry, no "dtype"; both render
    rows = [
        _cat_row("qwen3-30b-a3b", 16384, "fused", gemm=5.8, rows=1.2),
        _cat_row("qwen3-30b-a3b", 16384, "sonicmoe", gemm=5.5, rows=0.5),
        _cat_row("mystery", 4096, "fused", gemm=2.0, rows=0.25),  # a config no longer known
    ]
    rows[0]["bytes"] = {"fused": {"fwd": 1, "bwd": 2, "passes": []}}
    src, md = tmp_path / "old.json", tmp_path / "old.md"
    src.write_text(json.dumps(_doc(rows)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prof.main(["--from-json", str(src), "--md", str(md)]) == 0
    lines = md.read_text().splitlines()
    line = next(ln for ln in lines if ln.startswith("| qwen3-30b-a3b | 16384 | 7.000 | 6.000 |"))
    assert line.endswith("| +1.000 (+0.300, +0.700) |")
    assert "| mystery | 4096 | 2.250 | - |" in md.read_text()
    printed = capsys.readouterr().out
    assert "qwen3-30b-a3b T=16384 gap fused - SonicMoE: +1.000 ms" in printed


# ---------------------------------------------------------------------- arguments


def test_parse_args_defaults_groups_and_old_form():
    a = prof.parse_args([])
    assert a.config_names == ["qwen3"] and a.token_list == [4096]
    assert a.impl_list == ["fused", "sonicmoe"] and a.routing == "router"  # bench_moe's default
    assert (a.steps, a.warmup, a.top, a.json, a.md) == (5, 3, 22, None, None)
    a = prof.parse_args(["--configs", "layer", "--tokens", "4096,16384"])
    assert a.config_names == list(configs.GROUPS["layer"]) and a.token_list == [4096, 16384]
    a = prof.parse_args(["--configs", "olmoe,extra,olmoe", "--impls", "plain,fused,plain"])
    assert a.config_names == ["olmoe", "dsv2-lite"] and a.impl_list == ["plain", "fused"]
    # the README's old single-row form
    a = prof.parse_args(["--config", "qwen3-30b-a3b", "--tokens", "16384", "--routing", "uniform"])
    assert a.config_names == ["qwen3-30b-a3b"] and a.token_list == [16384]
    assert a.routing == "uniform"


@pytest.mark.parametrize(
    "argv",
    [
        ["--configs", "nope"],
        ["--impls", "fused,quack"],
        ["--impls", ","],
        ["--tokens", "4k"],
        ["--tokens", "0"],
        ["--routing", "zipf"],
        ["--steps", "0"],
    ],
)
def test_parse_args_refuses(argv, capsys):
    with pytest.raises(SystemExit) as e:
        prof.parse_args(argv)
    assert e.value.code != 0


def test_dry_run_and_no_gpu(monkeypatch, capsys):
    assert prof.main(["--dry-run", "--configs", "layer", "--tokens", "4096,16384"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 9
    assert lines[0].startswith("qwen3-30b-a3b   T=4096   d=2048  d_ff=768   E=128 k=8 router")
    assert lines[0].endswith("fused, sonicmoe")
    assert lines[-1] == "8 shapes x 2 implementations, 3 warm-up + 5 profiled steps each"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prof.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out


# ---------------------------------------------------------------------- main's flow


def _fake_gpu(monkeypatch, profiled):
    """CUDA's device queries on the CPU, and a profiler that runs the steps and reports a
    fixed kernel list per step (a different one for SonicMoE's steps)."""
    for name, value in (
        ("synchronize", lambda *a, **k: None),
        ("is_available", lambda: True),
        ("get_device_name", lambda *a: "Fake GPU"),
        ("empty_cache", lambda: None),
        ("current_stream", lambda *a: types.SimpleNamespace(cuda_stream=1234)),
    ):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(prof, "DEV", "cpu")

    def profile_steps(step, steps):
        profiled.append(steps)
        for _ in range(steps):
            step()
        return [(VARLEN, 1000.0 * steps, 2 * steps), (GATHER_SUM, 250.0 * steps, steps)]

    monkeypatch.setattr(prof, "profile_steps", profile_steps)


def _fake_sonic(monkeypatch, calls):
    """load_sonic -> a SonicMoE layer on the CPU (the identity plus a term in each weight,
    so that backward reaches every leaf) that records its calls."""

    def layer(x, router_w, w1, b1, w2, b2, K, stream_id, act, inference, **kw):
        calls.append({"K": K, "stream": stream_id, "act": act, **kw})
        o = x + 0 * (router_w.sum() + w1.sum() + w2.sum())
        return o, None, None

    S = {"layer": layer, "ActivationType": types.SimpleNamespace(SWIGLU="swiglu")}
    monkeypatch.setattr(sonic, "load_sonic", lambda: (S, None))


def test_main_profiles_fused_and_sonicmoe(monkeypatch, tmp_path, capsys):
    profiled, calls = [], []
    _fake_gpu(monkeypatch, profiled)
    _fake_sonic(monkeypatch, calls)
    monkeypatch.setitem(configs.CONFIGS, "tiny", (64, 32, 8, 2))
    out = tmp_path / "p"
    argv = ["--configs", "tiny", "--tokens", "32,48", "--steps", "2", "--warmup", "1"]
    argv += ["--json", f"{out}.json", "--md", f"{out}.md"]
    assert prof.main(argv) == 0
    assert profiled == [2, 2, 2, 2]
    # SonicMoE: one warm-up + 2 profiled steps per shape, called as bench_moe does
    assert len(calls) == 6 and all(c["K"] == 2 and c["stream"] == 1234 for c in calls)
    assert all(c["concat_layout"] and c["norm_topk_probs"] for c in calls)
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["complete"] and doc["device"] == "Fake GPU" and doc["torch"] == torch.__version__
    assert doc["command"] == argv and doc["routing"] == "router" and doc["skipped"] == []
    assert [(r["config"], r["tokens"], r["impl"]) for r in doc["rows"]] == [
        ("tiny", 32, "fused"),
        ("tiny", 32, "sonicmoe"),
        ("tiny", 48, "fused"),
        ("tiny", 48, "sonicmoe"),
    ]
    r = doc["rows"][0]
    assert r["total_ms"] == pytest.approx(1.25) and r["by_category"]["gemm"] == pytest.approx(1.0)
    assert r["by_category"]["rows"] == pytest.approx(0.25)
    assert r["kernels"][0] == {"name": VARLEN, "ms": 1.0, "count": 2, "category": "gemm"}
    assert r["warmup_s"] >= 0
    assert "bytes" not in r and "bytes_switches" not in doc
    md = (tmp_path / "p.md").read_text()
    assert "| tiny | 32 | 1.250 | 1.250 | 1.000 | 0.250 | 0.000 |" in md
    printed = capsys.readouterr().out
    assert "sonicmoe warm-up: 1 steps took" in printed and "JIT compile" in printed
    assert "tiny T=48 sonicmoe: 1.250 ms = 1.000 gemm + 0.250 rows" in printed
    assert "tiny T=32 gap fused - SonicMoE: +0.000 ms" in printed
    assert f"   1.000 ms    2x  gemm        {VARLEN[:110]}" in printed

    # --from-json renders the file without a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    md2 = tmp_path / "q.md"
    assert prof.main(["--from-json", f"{out}.json", "--md", str(md2)]) == 0
    assert md2.read_text() == md


def test_main_without_sonicmoe_and_with_fixed_routing(monkeypatch, tmp_path, capsys):
    profiled = []
    _fake_gpu(monkeypatch, profiled)
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # its import fails
    monkeypatch.setitem(configs.CONFIGS, "tiny", (64, 32, 8, 2))
    out = tmp_path / "p.json"
    argv = ["--configs", "tiny", "--tokens", "32", "--steps", "1", "--warmup", "1"]
    assert prof.main(argv + ["--impls", "fused,sonicmoe,plain", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    why = doc["sonicmoe_why"]
    assert why.startswith(("ModuleNotFoundError", "ImportError")) and "sonicmoe" in why
    assert f"SonicMoE skipped: {why}" in printed
    assert [r["impl"] for r in doc["rows"]] == ["fused", "plain"]
    assert doc["skipped"] == [{"config": "tiny", "tokens": 32, "impl": "sonicmoe", "why": why}]
    # fixed routing: every groupmm/torch layer profiled; SonicMoE routes itself, so not
    calls = []
    _fake_sonic(monkeypatch, calls)
    argv += ["--routing", "uniform", "--impls", "sonicmoe,fused,groupmm,torch-gmm"]
    assert prof.main(argv + ["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["impl"] for r in doc["rows"]] == ["fused", "groupmm", "torch-gmm"]
    assert all(r["routing"] == "uniform" for r in doc["rows"])
    assert calls == [] and "own router" in doc["skipped"][0]["why"]
