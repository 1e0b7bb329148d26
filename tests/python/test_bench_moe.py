"""benches/bench_moe.py on the CPU: its config table, the conversion of groupmm's weights to
SonicMoE's layout (against a float64 computation of the layer from the converted tensors),
row building, the summary of the measured ratios, markdown, --dry-run and --from-json,
and main() end to end with stand-ins for CUDA's events and for SonicMoE.

``benches/bench_moe.py`` and the modules it shares code through (``harness.configs``,
``peers.sonicmoe``, ``harness.report.moe``, ``harness.report``, ``harness.timing``) are
loaded from benches/. The
SonicMoE stand-in (:func:`fake_sonic_layer`) is written here from SonicMoE's documented
semantics (weights ``(2I, H, E)`` / ``(H, I, E)`` with stride order (2, 0, 1), interleaved
or concatenated gate/up rows, both routing modes), independently of the bench, so a bench
that hands it the wrong layout or flags computes a different layer and fails the
comparison with fused.
"""

from __future__ import annotations

import enum
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import WallClockEvent, load_bench
from groupmm.moe import MoELayer

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ROOT / "benches"
F64 = torch.float64


timing = load_bench("harness.timing")
report = load_bench("harness.report")
configs = load_bench("harness.configs")
sonic = load_bench("peers.sonicmoe")
moe_report = load_bench("harness.report.moe")
bench = load_bench("bench_moe")


# ---------------------------------------------------------------------- configs


def test_config_table_and_selection():
    c = configs.CONFIGS
    # the layer table, (d, d_ff, E, k)
    assert [c[n] for n in configs.GROUPS["layer"]] == [
        (2048, 768, 128, 8),
        (2048, 1024, 64, 8),
        (4096, 1536, 128, 8),
        (2880, 2880, 32, 4),
    ]
    assert configs.GROUPS["layer"] == ("qwen3-30b-a3b", "olmoe", "qwen3-235b-a22b", "gpt-oss-20b")
    # today's configs keep their names and sizes (README's table, dev/profile_moe.py's default)
    assert {n: c[n] for n in configs.GROUPS["legacy"]} == {
        "qwen3": (2048, 768, 128, 8),
        "olmoe": (2048, 1024, 64, 8),
        "dsv3-local": (7168, 2048, 32, 8),
        "mixtral": (4096, 14336, 8, 2),
    }
    for name, v in c.items():  # dev/profile_moe.py unpacks four ints
        d, f, E, k = v
        assert all(isinstance(t, int) and t > 0 for t in v) and k <= E, name
        assert name in configs.MODELS
    assert configs.select_configs("layer") == list(configs.GROUPS["layer"])
    # CONFIGS order, each once; names and groups mix
    assert configs.select_configs("mixtral,olmoe,layer,olmoe") == [
        "qwen3-30b-a3b",
        "olmoe",
        "qwen3-235b-a22b",
        "gpt-oss-20b",
        "mixtral",
    ]
    assert "qwen3" not in configs.select_configs("all")  # same sizes as qwen3-30b-a3b
    assert len(configs.select_configs("all")) == len(set(c.values()))
    with pytest.raises(SystemExit, match="unknown config 'nope'"):
        configs.select_configs("olmoe,nope")


def test_plan_rows_order_and_fields():
    cfg = {"a": (8, 4, 4, 2), "b": (16, 8, 8, 4)}
    plan = bench.plan_rows(cfg, [64, 128], ["router", "uniform"], ["fwd+bwd", "fwd"])
    assert len(plan) == 2 * 2 * 2 * 2
    assert [(r["config"], r["T"], r["routing"], r["pass"]) for r in plan[:5]] == [
        ("a", 64, "router", "fwd+bwd"),
        ("a", 64, "router", "fwd"),
        ("a", 64, "uniform", "fwd+bwd"),
        ("a", 64, "uniform", "fwd"),
        ("a", 128, "router", "fwd+bwd"),
    ]
    r = plan[-1]
    assert (r["d_model"], r["d_ff"], r["experts"], r["top_k"]) == (16, 8, 8, 4)
    assert bench.step_flops(plan[0]) == 3 * 2 * 64 * 2 * 8 * 3 * 4
    assert bench.step_flops(plan[1]) == 2 * 64 * 2 * 8 * 3 * 4


@pytest.mark.parametrize("kind", ["uniform", "skewed"])
def test_fixed_routing_ids(kind):
    T, E, k = 256, 16, 4
    ids = configs.routing(T, E, k, kind, torch.Generator().manual_seed(1))
    assert ids.shape == (T, k) and ids.min() >= 0 and ids.max() < E
    for row in ids.tolist():
        assert len(set(row)) == k  # a token's k experts distinct
    used = set(ids.flatten().tolist())
    if kind == "skewed":
        assert len(used) <= E - E // 8  # E/8 experts empty
    else:
        assert used == set(range(E))


# ---------------------------------------------------------------------- SonicMoE's layout


def _layer(d, f, E, k, seed=0, dtype=F64):
    torch.manual_seed(seed)
    return MoELayer(d, f, E, k, aux_loss_coef=0.0, dtype=dtype)


def test_sonic_weights_are_copies_in_sonic_layout():
    d, f, E, k = 12, 5, 6, 2
    layer = _layer(d, f, E, k)
    rw, w1, w2 = sonic.sonic_weights(layer)
    w_in, w_out = layer.experts.w_in, layer.experts.w_out
    assert rw.shape == (E, d) and w1.shape == (E, 2 * f, d) and w2.shape == (E, d, f)
    for t in (rw, w1, w2):
        assert t.is_leaf and t.requires_grad and t.is_contiguous() and t.dtype == F64
    for e in range(E):
        assert torch.equal(w1[e, :f], w_in[e, :, :f].T)  # gate rows first
        assert torch.equal(w1[e, f:], w_in[e, :, f:].T)  # then up rows
        assert torch.equal(w2[e], w_out[e].T)
    assert torch.equal(rw, layer.router.gate.weight)
    # the views SonicMoE is handed: (2F, d, E) and (d, F, E), stride order (2, 0, 1)
    w1p, w2p = sonic.sonic_args(w1, w2)
    assert w1p.shape == (2 * f, d, E) and w2p.shape == (d, f, E)
    for w in (w1p, w2p):
        assert w.stride(2) > w.stride(0) > w.stride(1) == 1
    # back to groupmm's layout
    a, b = sonic.to_groupmm_layout(w1, w2)
    assert torch.equal(a, w_in) and torch.equal(b, w_out)
    # copies: the layer's weights stay as they were
    with torch.no_grad():
        w1.zero_()
        w2.zero_()
        rw.zero_()
    assert w_in.abs().sum() > 0 and w_out.abs().sum() > 0
    assert layer.router.gate.weight.abs().sum() > 0


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("E,k", [(8, 2), (6, 4), (16, 8)])
def test_sonic_layout_reference_equals_moelayer_float64(E, k, fused):
    """The layer computed with plain torch ops from the converted weights (the tensors
    handed to SonicMoE, read with SonicMoE's semantics) equals groupmm's MoELayer, forward
    and gradients, in float64."""
    d, f, T = 16, 12, 37
    layer = _layer(d, f, E, k, seed=E + k)
    layer.fused = fused
    torch.manual_seed(3)
    x = torch.randn(T, d, dtype=F64, requires_grad=True)
    gy = torch.randn(T, d, dtype=F64)
    out = layer(x)
    out.backward(gy)
    g_x, g_r = x.grad.clone(), layer.router.gate.weight.grad
    g_in, g_out = layer.experts.w_in.grad, layer.experts.w_out.grad

    rw, w1, w2 = sonic.sonic_weights(layer)
    x.grad = None
    ref = sonic.sonic_layout_reference(x, rw, *sonic.sonic_args(w1, w2), k)
    torch.testing.assert_close(ref, out, rtol=1e-10, atol=1e-12)
    ref.backward(gy)
    torch.testing.assert_close(x.grad, g_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(rw.grad, g_r, rtol=1e-10, atol=1e-12)
    a, b = sonic.to_groupmm_layout(w1.grad, w2.grad)
    torch.testing.assert_close(a, g_in, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(b, g_out, rtol=1e-10, atol=1e-12)


def test_reference_tells_wrong_layouts_apart():
    """The float64 comparison is sensitive: swapped gate/up rows, an interleaved reading of
    concatenated rows, or a reshape in place of a transpose each give another layer."""
    d, f, E, k, T = 16, 12, 8, 2, 29
    layer = _layer(d, f, E, k, seed=5)
    x = torch.randn(T, d, dtype=F64)
    with torch.no_grad():
        want = layer(x)
        rw, w1, w2 = sonic.sonic_weights(layer)

        def rel(w1_, w2_):
            got = sonic.sonic_layout_reference(x, rw, *sonic.sonic_args(w1_, w2_), k)
            return float((got - want).norm() / want.norm())

        assert rel(w1, w2) < 1e-12
        swapped = torch.cat([w1[:, f:], w1[:, :f]], dim=1)
        interleaved = torch.stack([w1[:, :f], w1[:, f:]], dim=2).reshape(E, 2 * f, d)
        reshaped_w1 = layer.experts.w_in.reshape(E, 2 * f, d).contiguous()
        reshaped_w2 = layer.experts.w_out.reshape(E, d, f).contiguous()
        assert rel(swapped, w2) > 1e-2
        assert rel(interleaved, w2) > 1e-2
        assert rel(reshaped_w1, w2) > 1e-2
        assert rel(w1, reshaped_w2) > 1e-2


# ---------------------------------------------------------------------- rows and summary


def _timed(ms, samples):
    s = timing.spread(samples)
    return {
        "ms": ms,
        **{q: s[q] for q in ("min", "q1", "q3", "max")},
        "samples": samples,
        "calls": 3,
        "host_ms": 0.5,
        "mode": "events",
        "warm_s": 0.1,
        "error": None,
    }


def test_make_row_ratios_paired_memory_and_errors():
    base = {"config": "c", "T": 64, "routing": "router", "pass": "fwd+bwd"}
    timed = {
        "fused": _timed(2.0, [2.0, 2.1, 1.9]),
        "sonicmoe": _timed(2.2, [2.2, 2.0, 2.4]),
        "torch-gmm": _timed(3.0, [3.0, 3.0, 3.0]),
        "plain": {"ms": None, "error": "RuntimeError: boom"},
    }
    peaks = {"fused": 100, "sonicmoe": 200, "torch-gmm": 400}
    row = moe_report.make_row(
        base, timed, peaks, {"sonicmoe": 1e-3}, {}, {"groupmm": "not run", "x": None}
    )
    assert row["config"] == "c" and row["ms"]["groupmm"] is None
    assert row["speed"]["sonicmoe"] == pytest.approx(1.1)
    assert row["speed"]["torch-gmm"] == pytest.approx(1.5)
    assert row["speed"]["plain"] is None and row["speed"]["groupmm"] is None
    assert row["mem"]["sonicmoe"] == pytest.approx(0.5)
    assert row["mem"]["torch-gmm"] == pytest.approx(0.25) and row["mem"]["plain"] is None
    p = row["paired"]["sonicmoe"]  # rounds: 2.2/2.0, 2.0/2.1, 2.4/1.9
    assert p["median"] == pytest.approx(1.1)
    assert p["min"] == pytest.approx(2.0 / 2.1) and p["max"] == pytest.approx(2.4 / 1.9)
    assert row["paired"]["plain"] is None
    assert row["spread_ms"]["fused"]["min"] == 1.9 and row["spread_ms"]["fused"]["max"] == 2.1
    assert set(row["spread_ms"]) == {"fused", "sonicmoe", "torch-gmm"}
    assert row["errors"] == {"groupmm": "not run", "plain": "RuntimeError: boom"}
    assert row["rel_diff"] == {"sonicmoe": 1e-3}
    json.dumps(row)
    line = moe_report.format_row(row)
    assert "sonicmoe 2.200±9.1%" in line and "sonicmoe 1.10" in line and "plain -" in line


def _row(config, speed_sonic, mem_sonic, p="fwd+bwd", T=4096):
    ms = {k: None for k in moe_report.IMPLS}
    ms["fused"] = 1.0
    ms["torch-gmm"] = 1.4
    peaks = {k: None for k in moe_report.IMPLS}
    peaks["fused"] = 100 * 2**20
    if speed_sonic is not None:
        ms["sonicmoe"] = speed_sonic
        peaks["sonicmoe"] = 100 * 2**20 / mem_sonic
    r = {"config": config, "d_model": 8, "d_ff": 4, "experts": 4, "top_k": 2, "T": T}
    r.update(routing="router", pass_=None)
    r.pop("pass_")
    r.update({"pass": p, "ms": ms, "peak_bytes": peaks})
    r.update(moe_report.ratios(r))
    return r


def test_summary_of_the_measured_ratios():
    rows = [
        _row("a", 1.2, 0.8),
        _row("b", 0.9, 1.1),
        _row("c", 1.5, 0.5),
        _row("d", 0.1, 9.0, p="fwd"),  # fwd rows are not summed up
    ]
    s = moe_report.summarize(rows)
    assert s["rows"] == 3
    st = s["speed"]["sonicmoe"]
    assert st["n"] == 3 and st["min"] == pytest.approx(0.9) and st["max"] == pytest.approx(1.5)
    assert st["geomean"] == pytest.approx((1.2 * 0.9 * 1.5) ** (1 / 3))
    assert st["min_row"] == "b T=4096 router fwd+bwd"
    assert s["speed"]["torch-gmm"]["geomean"] == pytest.approx(1.4)
    m = s["mem"]["sonicmoe"]
    assert m["max"] == pytest.approx(1.1) and m["over"] == ["b T=4096 router fwd+bwd"]
    assert "targets" not in s
    none = moe_report.summarize([_row("a", None, None)])
    assert "sonicmoe" not in none["speed"] and "sonicmoe" not in none["mem"]
    text = "\n".join(moe_report.summary_lines(rows))
    assert "geomean 1.17, min 0.90 (b T=4096 router fwd+bwd)" in text
    assert "peak memory fused / SonicMoE: max 1.10; above SonicMoE's: b T=4096" in text
    assert "target" not in text and "met" not in text


def _doc(rows, **kw):
    doc = {
        "schema": "moe-2",
        "complete": True,
        "argv": ["--configs", "layer"],
        "device": "Fake GPU",
        "torch": "2.99.0+cu999",
        "cuda": "99.1",
        "dtype": "bfloat16",
        "groupmm": {"version": "0.1.0", "cuda": True, "cutlass": "4.2.0"},
        "sonicmoe": True,
        "sonicmoe_why": None,
        "versions": {
            "sonic-moe": "0.1.2.post1",
            "quack-kernels": "0.3.11",
            "nvidia-cutlass-dsl": "4.4.2",
        },
        "timer": {"rounds": 10, "sample_ms": 25.0, "calls": None},
        "rows": rows,
        "skipped": [],
    }
    doc.update(kw)
    return doc


def test_render_md_names_the_environment_and_every_row():
    r1 = _row("qwen3-30b-a3b", 1.2, 0.8)
    r2 = _row("olmoe", 0.9, 1.1, T=16384)
    r3 = _row("mixtral", None, None)
    r3["routing"] = "uniform"
    r3["errors"] = {"sonicmoe": "fixed routing: SonicMoE's layer routes with its own router"}
    skipped = [{"row": "gpt-oss-20b T=4096 router fwd+bwd", "why": "--budget-s 1 spent"}]
    md = moe_report.render_md(_doc([r1, r2, r3], complete=False, skipped=skipped))
    assert md.startswith("**device Fake GPU; torch 2.99.0+cu999, CUDA 99.1; bfloat16**")
    assert "sonic-moe 0.1.2.post1, quack-kernels 0.3.11, nvidia-cutlass-dsl 4.4.2" in md
    assert "groupmm build_info: version 0.1.0, cuda True, cutlass 4.2.0" in md
    assert "python3 benches/bench_moe.py --configs layer" in md
    assert "incomplete run" in md and "round-robin over 10 rounds" in md
    lines = md.splitlines()
    body = [ln for ln in lines if ln.startswith("| ") and "(8, 4, 4, 2)" in ln]
    assert len(body) == 3
    # fused 1.00; SonicMoE's time is the speed ratio; ratios, bold where fused is behind
    assert body[0].split(" | ")[4:6] == ["1.00", "-"]
    assert "| 1.20 | 1.40 | - | 100 / 125 |" in body[0]
    assert "| **0.90** | 1.40 | - | **100 / 91** |" in body[1]
    assert body[2].count(" - ") >= 5 and "| uniform |" in body[2]
    assert "- SonicMoE: fixed routing: SonicMoE's layer routes with its own router (mixtral" in md
    assert "skipped: gpt-oss-20b T=4096 router fwd+bwd (--budget-s 1 spent)" in md
    # no SonicMoE in the run: said so, with why
    md2 = moe_report.render_md(
        _doc([r3], sonicmoe=False, sonicmoe_why="ModuleNotFoundError: No module named 'sonicmoe'")
    )
    assert "SonicMoE not measured: ModuleNotFoundError: No module named 'sonicmoe'" in md2


def test_merge_docs_of_two_commands(tmp_path, capsys):
    a = _doc([_row("qwen3-30b-a3b", 1.2, 0.8)], argv=["--configs", "qwen3-30b-a3b"])
    a["skipped"] = [{"row": "olmoe T=4096 router fwd+bwd", "why": "--budget-s 9 spent"}]
    b = _doc([_row("olmoe", 0.9, 1.1)], argv=["--configs", "olmoe"], complete=False)
    m = moe_report.merge_docs([a, b])
    assert [r["config"] for r in m["rows"]] == ["qwen3-30b-a3b", "olmoe"]
    assert m["skipped"] == []  # measured by the second run
    assert m["complete"] is False and m["merged_differ"] == []
    assert m["runs"] == [["--configs", "qwen3-30b-a3b"], ["--configs", "olmoe"]]
    assert m["summary"]["speed"]["sonicmoe"]["n"] == 2
    md = moe_report.render_md(m)
    assert "python3 benches/bench_moe.py --configs qwen3-30b-a3b\n" in md
    assert "python3 benches/bench_moe.py --configs olmoe\n" in md
    c = _doc([_row("gpt-oss-20b", 1.0, 1.0)], device="Other GPU")
    assert moe_report.merge_docs([a, b, c])["merged_differ"] == ["device"]
    assert "merged runs differ in: device" in moe_report.render_md(moe_report.merge_docs([a, c]))
    assert moe_report.merge_docs([a]) is a
    # through the command line: merged JSON and markdown
    for name, d in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    files = f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}"
    out = tmp_path / "m.json"
    assert (
        bench.main(["--from-json", files, "--json", str(out), "--md", str(tmp_path / "m.md")]) == 0
    )
    merged = json.loads(out.read_text())
    assert len(merged["rows"]) == 2 and len(merged["runs"]) == 2
    assert (tmp_path / "m.md").read_text() == moe_report.render_md(merged)
    assert "fused speed / SonicMoE: geomean" in capsys.readouterr().out


def test_rel_diff_in_slices(monkeypatch):
    torch.manual_seed(0)
    a, b = torch.randn(5, 3, 4), torch.randn(5, 3, 4)
    want = float((a - b).norm() / b.norm())
    assert report.rel_diff(a, b) == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(report, "_CHUNK", 7)  # one slice of dim 0 at a time
    assert report.rel_diff(a, b) == pytest.approx(want, rel=1e-6)
    assert report.rel_diff(a[0, 0], b[0, 0]) == pytest.approx(
        float((a[0, 0] - b[0, 0]).norm() / b[0, 0].norm()), rel=1e-6
    )
    assert report.rel_diff(b, b) == 0.0
    assert report.rel_diff(None, b) is None and report.rel_diff(a, None) is None
    assert report.rel_diff(a, torch.zeros_like(a)) == math.inf


# ---------------------------------------------------------------------- --dry-run, --from-json


def test_dry_run_and_help_end_to_end():
    env = dict(os.environ)  # groupmm as the tests import it (the installed package)
    script = str(BENCHES / "bench_moe.py")
    run = subprocess.run(
        [sys.executable, script, "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0 and "--no-sonic" in run.stdout and "--dry-run" in run.stdout
    run = subprocess.run(
        [sys.executable, script, "--dry-run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 9
    for name, T in [(n, t) for n in configs.GROUPS["layer"] for t in (4096, 16384)]:
        assert any(ln.startswith(name) and f"T={T} " in ln for ln in lines[:8]), (name, T)
    assert "router  fwd+bwd d=2880  d_ff=2880  E=32  k=4" in lines[6]
    assert lines[-1] == "8 rows over 4 configs"


def test_defaults_and_dry_run(capsys):
    args = bench.parse_args([])
    assert (args.rounds, args.configs, args.routing, args.passes) == (
        10,
        "layer",
        "router",
        "fwd+bwd",
    )
    assert bench.main(["--dry-run", "--configs", "legacy", "--tokens", "4096", "--no-sonic"]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and "4 rows over 4 configs" in out and "SonicMoE" not in out
    q = bench.parse_args(["--calls", "4"])
    assert q.calls == 4
    with pytest.raises(SystemExit):
        bench.parse_args(["--routing", "zipf"])


def test_md_shows_the_fused_host_time_bold_where_it_reaches_the_gpu_time():
    """The host-time column: the fused step's host ms beside its GPU ms, bold
    where the host is not faster than the GPU (the GPU would wait for it)."""
    row = {
        "config": "qwen3-30b-a3b",
        "d_model": 2048,
        "d_ff": 768,
        "experts": 128,
        "top_k": 8,
        "T": 4096,
        "routing": "router",
        "pass": "fwd+bwd",
        "ms": {"fused": 2.8},
        "host_ms": {"fused": 2.9},
    }
    fast = dict(row, T=16384, ms={"fused": 8.3}, host_ms={"fused": 2.7})
    text = moe_report.render_md({"rows": [row, fast], "device": "X", "torch": "t", "cuda": "c"})
    assert "| fused host ms |" in text
    assert "| fwd+bwd | 2.80 | **2.90** | - |" in text
    assert "| fwd+bwd | 8.30 | 2.70 | - |" in text


# ---------------------------------------------------------------------- main() end to end


class FakeActivationType(enum.Enum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"


def fake_sonic_layer(calls: list):
    """``moe_TC_softmax_topk_layer`` on the CPU, from SonicMoE's documented semantics:
    ``w1`` ``(2I, H, E)`` and ``w2`` ``(H, I, E)`` with stride order (2, 0, 1); gate/up rows
    interleaved (default) or concatenated (``concat_layout``); routing softmax over the
    top-k logits (default) or top-k of the softmax, optionally renormalised. Dense over
    experts (einsum), so nothing is shared with the bench's loop over experts."""

    def layer(
        x,
        router_w,
        w1,
        b1,
        w2,
        b2,
        K,
        stream_id,
        activation_type=FakeActivationType.SWIGLU,
        is_inference_mode_enabled=False,
        *,
        is_softmax_over_topk=True,
        norm_topk_probs=False,
        concat_layout=False,
    ):
        calls.append(
            {
                "K": K,
                "stream_id": stream_id,
                "activation": activation_type,
                "inference": is_inference_mode_enabled,
                "is_softmax_over_topk": is_softmax_over_topk,
                "norm_topk_probs": norm_topk_probs,
                "concat_layout": concat_layout,
                "b": (b1, b2),
            }
        )
        assert activation_type is FakeActivationType.SWIGLU and b1 is None and b2 is None
        E, (two_i, H, E1), (H2, n_ff, E2) = router_w.shape[0], w1.shape, w2.shape
        assert E1 == E2 == E and H == H2 == x.shape[1] and two_i == 2 * n_ff
        for w in (w1, w2):  # the documented stride order (2, 0, 1)
            assert w.stride(2) > w.stride(0) > w.stride(1) == 1, w.stride()
        logits = F.linear(x, router_w)
        if is_softmax_over_topk:
            v, ids = logits.topk(K, dim=-1)
            scores = v.float().softmax(-1)
        else:
            scores, ids = logits.float().softmax(-1).topk(K, dim=-1)
            if norm_topk_probs:
                scores = scores / scores.sum(-1, keepdim=True)
        dense = torch.zeros(x.shape[0], E, dtype=x.dtype).scatter(1, ids, scores.to(x.dtype))
        h = torch.einsum("th,ihe->tei", x, w1)
        gate, up = (h[..., :n_ff], h[..., n_ff:]) if concat_layout else (h[..., 0::2], h[..., 1::2])
        y = torch.einsum("tei,hie->teh", F.silu(gate) * up, w2)
        o = torch.einsum("te,teh->th", dense, y)
        freq = torch.bincount(ids.flatten(), minlength=E).int()
        return o, logits, freq

    return layer


def _fake_cuda(monkeypatch):
    """CUDA's events, spin, device queries and memory counters, on the CPU: events read
    the wall clock; every reset of the peak makes the next step's peak 100 bytes more."""

    Event = WallClockEvent

    resets = []
    for name, value in (
        ("Event", Event),
        ("_sleep", lambda cycles: None),
        ("synchronize", lambda *a, **k: None),
        ("is_available", lambda: True),
        ("get_device_name", lambda *a: "Fake GPU"),
        ("get_device_capability", lambda *a: (9, 0)),
        ("empty_cache", lambda: None),
        ("current_stream", lambda *a: types.SimpleNamespace(cuda_stream=1234)),
        ("memory_allocated", lambda *a: 1000),
        ("reset_peak_memory_stats", lambda *a: resets.append(1)),
        ("max_memory_allocated", lambda *a: 1000 + 100 * len(resets)),
    ):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(timing, "_CYCLES_PER_MS", 1e6)
    monkeypatch.setattr(bench, "DEV", "cpu")


def _fake_sonic(monkeypatch, calls):
    pkg = types.ModuleType("sonicmoe")
    pkg.__path__ = []
    functional = types.ModuleType("sonicmoe.functional")
    functional.moe_TC_softmax_topk_layer = fake_sonic_layer(calls)
    enums = types.ModuleType("sonicmoe.enums")
    enums.ActivationType = FakeActivationType
    pkg.functional, pkg.enums = functional, enums
    for name, mod in (
        ("sonicmoe", pkg),
        ("sonicmoe.functional", functional),
        ("sonicmoe.enums", enums),
    ):
        monkeypatch.setitem(sys.modules, name, mod)


def test_main_end_to_end_with_a_fake_sonicmoe(monkeypatch, tmp_path, capsys):
    _fake_cuda(monkeypatch)
    calls = []
    _fake_sonic(monkeypatch, calls)
    written = []
    real_write = bench.write_outputs

    def write(doc, args):
        written.append(len(doc["rows"]))
        real_write(doc, args)

    monkeypatch.setattr(bench, "write_outputs", write)
    out = tmp_path / "r"
    argv = ["--tiny", "--routing", "router,uniform", "--passes", "fwd+bwd,fwd"]
    argv += ["--rounds", "3", "--max-calls", "2", "--min-calls", "1", "--warmup", "1"]
    argv += ["--json", f"{out}.json", "--md", f"{out}.md"]
    assert bench.main(argv) == 0
    assert written == [1, 2, 3, 4, 4]  # after every row, then once more at the end
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["complete"] and doc["device"] == "Fake GPU" and doc["torch"] == torch.__version__
    assert doc["sonicmoe"] is True and doc["sonicmoe_why"] is None
    assert set(doc["versions"]) == {"sonic-moe", "quack-kernels", "nvidia-cutlass-dsl"}
    assert doc["versions"]["sonic-moe"] == "unknown (no package metadata)"  # a bare module
    assert doc["groupmm"]["version"] and doc["timer"]["rounds"] == 3
    rows = {(r["routing"], r["pass"]): r for r in doc["rows"]}
    assert set(rows) == {(a, b) for a in ("router", "uniform") for b in ("fwd+bwd", "fwd")}

    r = rows[("router", "fwd+bwd")]
    assert set(k for k, v in r["ms"].items() if v) == set(moe_report.IMPLS), r["errors"]
    assert all(len(r["samples_ms"][k]) == 3 for k in moe_report.IMPLS)
    # SonicMoE, handed the converted weights, computes fused's layer: outputs and gradients
    assert r["rel_diff"]["sonicmoe"] < 1e-5
    assert set(r["grad_rel_diff"]["sonicmoe"]) == {"x", "router", "w_in", "w_out"}
    assert max(r["grad_rel_diff"]["sonicmoe"].values()) < 1e-5
    for k in ("groupmm", "torch-gmm", "plain"):
        assert r["rel_diff"][k] < 1e-5 and max(r["grad_rel_diff"][k].values()) < 1e-5
    # peak memory: one step per implementation, fused first, in IMPLS order
    assert r["peak_bytes"] == {k: 100 * (i + 1) for i, k in enumerate(moe_report.IMPLS)}
    assert r["mem"]["sonicmoe"] == pytest.approx(0.2)
    assert r["speed"]["sonicmoe"] == pytest.approx(r["ms"]["sonicmoe"] / r["ms"]["fused"])
    assert r["sonic_warm_s"] is not None and r["sonic_warm_s"] >= 0
    # called exactly as PEERS.md shows: Qwen3 routing, concatenated gate/up, the stream
    assert calls and all(
        (c["is_softmax_over_topk"], c["norm_topk_probs"], c["concat_layout"]) == (False, True, True)
        and c["K"] == 2
        and c["stream_id"] == 1234
        and c["inference"] is False
        for c in calls
    )
    assert rows[("router", "fwd")]["rel_diff"]["sonicmoe"] < 1e-5
    # fixed routing: no SonicMoE, and why
    u = rows[("uniform", "fwd+bwd")]
    assert u["ms"]["sonicmoe"] is None and "own router" in u["errors"]["sonicmoe"]
    assert u["ms"]["fused"] and u["rel_diff"]["groupmm"] < 1e-5
    md = (tmp_path / "r.md").read_text()
    assert "Fake GPU" in md and "| tiny (64, 32, 8, 2) | 64 | router | fwd+bwd |" in md
    printed = capsys.readouterr().out
    assert "SonicMoE warm-up took" in printed and "[  4/4" in printed
    # a spent budget: no row starts, each listed as skipped, the files still written
    written.clear()
    assert bench.main(argv + ["--budget-s", "1e-9"]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rows"] == [] and len(doc["skipped"]) == 4
    assert doc["skipped"][0] == {"row": "tiny T=64 router fwd+bwd", "why": "--budget-s 1e-09 spent"}


def test_main_without_sonicmoe_says_why(monkeypatch, tmp_path):
    _fake_cuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import fails
    S, why = sonic.load_sonic()
    assert (
        S is None and why.startswith(("ModuleNotFoundError", "ImportError")) and "sonicmoe" in why
    )
    out = tmp_path / "r.json"
    argv = ["--tiny", "--rounds", "1", "--max-calls", "1", "--min-calls", "1", "--warmup", "1"]
    assert bench.main(argv + ["--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["sonicmoe"] is False and doc["sonicmoe_why"] == why
    assert doc["versions"]["sonic-moe"] is None
    (r,) = doc["rows"]
    assert r["ms"]["sonicmoe"] is None and r["errors"]["sonicmoe"] == why
    assert r["ms"]["fused"] and r["speed"]["sonicmoe"] is None
    assert f"SonicMoE not measured: {why}" in moe_report.render_md(doc)
    assert bench.main(argv + ["--json", str(out), "--no-sonic"]) == 0
    assert json.loads(out.read_text())["sonicmoe_why"] == "--no-sonic"


def test_main_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--tiny"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
