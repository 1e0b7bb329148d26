"""The benches' round-robin timer and bench_gpu.py's pure parts, on the CPU.

``harness.timing``, ``bench_gpu`` and its table (``harness.report.gpu``) and shapes
(``harness.configs``) are loaded from benches/. The timer's CUDA
calls (events, the spin kernel, synchronize) are replaced by a virtual GPU clock, so the
order of the samples, the calls per sample, the spin before each sample and the statistics
are checked against hand-computed values without a GPU.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from conftest import WallClockEvent, load_bench

timing = load_bench("harness.timing")
report = load_bench("harness.report")
shapes = load_bench("harness.configs")
gpu_report = load_bench("harness.report.gpu")
bench = load_bench("bench_gpu")


# ---------------------------------------------------------------------- pure statistics


def test_rr_orders_rotate_the_start_and_balance_positions():
    orders = timing.rr_orders(4, 6)
    assert orders[0] == [0, 1, 2, 3]
    assert orders[1] == [1, 2, 3, 0]
    assert orders[3] == [3, 0, 1, 2]
    assert orders[4] == [0, 1, 2, 3]  # period n
    for o in orders:
        assert sorted(o) == [0, 1, 2, 3]
    # over any n consecutive rounds, every implementation takes every position once
    for start in range(3):
        window = orders[start : start + 4]
        for pos in range(4):
            assert sorted(o[pos] for o in window) == [0, 1, 2, 3]
    assert timing.rr_orders(1, 3) == [[0], [0], [0]]
    assert timing.rr_orders(3, 0) == []


def test_spread_median_and_quartiles():
    s = timing.spread([5, 1, 4, 2, 3])
    assert s == {"median": 3, "min": 1, "q1": 2, "q3": 4, "max": 5}
    s = timing.spread([4.0, 1.0, 3.0, 2.0])
    assert s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    # inclusive quartiles of 1..4: positions 1.75 and 3.25 (linear interpolation)
    assert s["q1"] == pytest.approx(1.75) and s["q3"] == pytest.approx(3.25)
    assert timing.spread([7.0]) == {"median": 7.0, "min": 7.0, "q1": 7.0, "q3": 7.0, "max": 7.0}
    with pytest.raises(ValueError):
        timing.spread([])


def test_paired_ratios_round_by_round():
    ours = [1.0, 2.0, None, 4.0]
    theirs = [1.5, 2.0, 3.0, 2.0]
    p = timing.paired(ours, theirs)  # rounds 0, 1, 3: 1.5, 1.0, 0.5
    assert p["median"] == pytest.approx(1.0)
    assert p["min"] == pytest.approx(0.5) and p["max"] == pytest.approx(1.5)
    assert timing.paired(None, theirs) is None
    assert timing.paired([None], [1.0]) is None


def test_calls_for_and_lead_for():
    assert timing.calls_for(0.1, 3.0, 3, 50) == 30
    assert timing.calls_for(0.07, 3.0, 3, 50) == 43  # ceil(42.86)
    assert timing.calls_for(5.0, 3.0, 3, 50) == 3  # floor of the range
    assert timing.calls_for(0.001, 3.0, 3, 50) == 50  # its ceiling
    assert timing.calls_for(0.0, 3.0, 3, 50) == 50
    # GPU-bound: only the first call's host time needs hiding
    assert timing.lead_for(0.02, 0.5, 10) == pytest.approx(1.25 * 0.02 + 0.02)
    # host-bound: host + (calls - 1) * (host - gpu)
    assert timing.lead_for(0.1, 0.04, 5) == pytest.approx(1.25 * (0.1 + 4 * 0.06) + 0.02)


# ---------------------------------------------------------------------- the timer itself


class FakeGPU:
    """A virtual GPU stream: kernels run back to back in issue order (the host never
    makes it wait), events read the clock at their place in the stream."""

    def __init__(self, monkeypatch):
        self.clock = 0.0  # ms
        self.log = []  # ("spin", ms) and implementation names, in issue order
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = gpu.clock

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t - self.t

        def sleep(cycles):
            ms = cycles / 1e6  # a 1 GHz spin clock: 1e6 cycles per ms
            gpu.clock += ms
            gpu.log.append(("spin", ms))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        monkeypatch.setattr(timing, "_CYCLES_PER_MS", None)

    def impl(self, name, ms, drift=0.0):
        """An implementation taking ``ms`` per call, ``drift`` more per ms of clock."""

        def run():
            self.clock += ms * (1.0 + drift * self.clock)
            self.log.append(name)

        return run


def _samples(log):
    """The timed samples in the log: (implementation, calls) after each spin, from the
    point where the round-robin starts (the first spin followed by a full sample)."""
    out, i = [], 0
    while i < len(log):
        if isinstance(log[i], tuple):
            j = i + 1
            while j < len(log) and not isinstance(log[j], tuple):
                j += 1
            names = log[i + 1 : j]
            if names and len(set(names)) == 1:
                out.append((names[0], len(names)))
            i = j
        else:
            i += 1
    return out


def test_round_robin_interleaves_rotating_and_times_gpu_work(monkeypatch):
    gpu = FakeGPU(monkeypatch)
    impls = {"a": gpu.impl("a", 0.5), "b": gpu.impl("b", 0.25), "c": gpu.impl("c", 1.0)}
    res, meta = timing.round_robin(impls, rounds=5, sample_ms=2.0, min_calls=2, max_calls=50)
    assert meta["rounds"] == 5
    assert meta["orders"][0] == ["a", "b", "c"] and meta["orders"][1] == ["b", "c", "a"]
    # calls per sample from the estimated GPU time: 2 ms / 0.5, / 0.25, / 1.0
    assert res["a"]["calls"] == 4 and res["b"]["calls"] == 8 and res["c"]["calls"] == 2
    for k, ms in (("a", 0.5), ("b", 0.25), ("c", 1.0)):
        assert res[k]["ms"] == pytest.approx(ms)
        assert res[k]["min"] == pytest.approx(ms) and res[k]["max"] == pytest.approx(ms)
        assert len(res[k]["samples"]) == 5 and res[k]["error"] is None
        assert res[k]["mode"] == "events"
    # the last 15 samples are the rounds, in the rotated order, each after the same spin
    timed = _samples(gpu.log)[-15:]
    want = [n for order in meta["orders"] for n in order]
    assert [n for n, _ in timed] == want
    assert all(c == res[n]["calls"] for n, c in timed)
    spins = [e[1] for e in gpu.log if isinstance(e, tuple)][-15:]
    assert meta["lead_ms"] > 0
    assert all(s == pytest.approx(meta["lead_ms"], abs=1e-5) for s in spins)


def test_round_robin_spreads_drift_and_reports_it(monkeypatch):
    """With clocks slowing as the run goes on, every implementation sees the slowdown (the
    medians of two equal implementations agree), and the spread shows it."""
    gpu = FakeGPU(monkeypatch)
    impls = {"x": gpu.impl("x", 1.0, drift=0.002), "y": gpu.impl("y", 1.0, drift=0.002)}
    res, _ = timing.round_robin(impls, rounds=6, calls=3, lead=False)
    assert res["x"]["calls"] == 3 and res["y"]["calls"] == 3
    assert res["x"]["max"] > res["x"]["min"]  # the drift is visible in the spread
    assert res["x"]["ms"] == pytest.approx(res["y"]["ms"], rel=0.02)
    p = timing.paired(res["x"]["samples"], res["y"]["samples"])
    assert p["min"] == pytest.approx(1.0, rel=0.05) and p["max"] == pytest.approx(1.0, rel=0.05)


def test_round_robin_reports_a_failing_implementation(monkeypatch):
    gpu = FakeGPU(monkeypatch)

    def bad():
        raise RuntimeError("cannot run this case\nmore")

    res, meta = timing.round_robin(
        {"ok": gpu.impl("ok", 0.5), "bad": bad, "none": None}, rounds=3, calls=2
    )
    assert res["bad"] == {"ms": None, "error": "RuntimeError: cannot run this case"}
    assert "none" not in res
    assert res["ok"]["ms"] == pytest.approx(0.5)
    assert meta["orders"] == [["ok"]] * 3


def test_round_robin_isolated_is_one_call_per_sample_without_spin(monkeypatch):
    gpu = FakeGPU(monkeypatch)
    res, meta = timing.round_robin({"a": gpu.impl("a", 0.5)}, rounds=4, isolated=True)
    assert res["a"]["calls"] == 1 and meta["lead_ms"] == 0.0
    assert res["a"]["ms"] == pytest.approx(0.5)


# ---------------------------------------------------------------------- bench_gpu.py


def test_shape_table_classes_and_selection():
    specs = shapes.SPECS
    assert len(specs) > 7 and set(shapes.LEGACY) <= set(specs)
    for k, s in specs.items():
        assert shapes.SHAPES[k] == (s.E, s.K, s.N, s.T)
        cls = shapes.row_class(s.E, s.T, s.decode)
        if s.decode:
            assert cls == "decode" and 256 <= s.T <= 512 and 32 <= s.E <= 128
        else:
            assert cls == ("fine" if s.T / s.E <= 256 else "larger")
            assert s.T == s.tokens * s.topk or s.model.startswith("DeepSeek-V3")
    # the real-model sizes (up projections K = d, N = 2·d_ff)
    assert specs["qwen3-30b-up"][:3] == (128, 2048, 1536)
    assert specs["qwen3-235b-up"][:3] == (128, 4096, 3072)
    assert specs["olmoe-up"][:3] == (64, 2048, 2048)
    assert specs["dsv3-local-up"][:3] == (32, 7168, 4096)
    assert specs["gpt-oss-up"][:3] == (32, 2880, 5760)
    assert specs["dsv2-up"][:3] == (160, 5120, 3072)
    assert specs["gpt-oss-up"].T / 32 == 512 and specs["gpt-oss-up-8k"].T / 32 == 1024
    classes = {shapes.row_class(s.E, s.T, s.decode) for s in specs.values()}
    assert classes == {"fine", "larger", "decode"}
    # groups, in table order (fine first), each once
    fine = shapes.select_shapes("fine")
    assert fine[0] == "qwen3-up" and all(not specs[k].decode for k in fine)
    assert shapes.select_shapes("small64,legacy,small64") == [
        k for k in specs if k in shapes.LEGACY
    ]
    assert shapes.select_shapes("all") == list(specs)
    with pytest.raises(SystemExit):
        shapes.select_shapes("no-such-shape")
    # --quick divides all but decode sizes by 8
    assert shapes.effective_T(specs["qwen3-up"], True) == 4096
    assert shapes.effective_T(specs["olmoe-up-dec"], True) == 256


def test_counts_sum_and_empty_experts():
    for routing, empty in (("uniform", 0), ("zipf12", 128 // 8), ("skewed", 128 // 16)):
        c = shapes.counts_for(128, 512, routing)
        assert len(c) == 128 and sum(c) == 512 and all(v >= 0 for v in c)
        if empty:
            assert sum(v == 0 for v in c) >= empty
    assert shapes.counts_for(8, 100, "uniform") == [16] + [12] * 7


def _timed(ms, samples=None):
    samples = samples or [ms] * 3
    sp = timing.spread(samples)
    return {
        "ms": sp["median"],
        **{k: sp[k] for k in ("min", "q1", "q3", "max")},
        "samples": samples,
        "calls": 4,
        "host_ms": 0.02,
        "mode": "events",
        "error": None,
    }


def _row(shape="qwen3-up", cls="fine", g=1.0, q=1.2, t=1.5, routing="uniform", pname="dW"):
    base = {"shape": shape, "E": 128, "K": 2048, "N": 768, "T": 32768, "class": cls}
    base.update({"routing": routing, "pass": pname})
    timed = {
        "groupmm": _timed(g, [g * 0.98, g, g * 1.04]),
        "torch": _timed(t),
        "quack": _timed(q),
        "loop": _timed(10.0),
        "dense": {"ms": None, "error": "RuntimeError: no"},
    }
    quack = {"config": "128x128 pp 1x1", "select": {"128x128 pp 1x1": q}}
    return gpu_report.make_row(base, timed, 0.8, 2e12, quack)


def test_make_row_ratios_roofline_and_errors():
    r = _row(g=1.0, q=1.2, t=1.5)
    assert r["ms"]["bound"] == 0.8 and r["tflops"]["groupmm"] == pytest.approx(2000.0)
    assert r["vs_quack"] == pytest.approx(1.2) and r["vs_torch"] == pytest.approx(1.5)
    assert r["roofline"] == pytest.approx(0.8) and r["vs_dense"] is None
    assert r["roofline_peers"]["quack"] == pytest.approx(0.8 / 1.2)
    assert r["spread_ms"]["groupmm"]["min"] == pytest.approx(0.98)
    assert r["spread_ms"]["groupmm"]["max"] == pytest.approx(1.04)
    # round by round: quack 1.2 over groupmm 0.98, 1.0, 1.04
    assert r["paired"]["vs_quack"]["max"] == pytest.approx(1.2 / 0.98)
    assert r["paired"]["vs_quack"]["min"] == pytest.approx(1.2 / 1.04)
    assert r["errors"] == {"dense": "RuntimeError: no"}
    assert r["quack_config"] == "128x128 pp 1x1" and "dense" not in r["spread_ms"]
    json.dumps(r)  # the JSON file holds it as is


def test_class_summary_per_class():
    rows = [
        _row(g=1.0, q=1.3, t=1.5),  # vs quack 1.3
        _row(g=1.0, q=1.1, t=1.2, pname="fwd"),  # vs quack 1.1
        _row("qwen3-30b-up-16k", "larger", g=1.0, q=0.9, t=0.95),
        _row("olmoe-up-dec", "decode", g=1.0, q=1.0, t=1.3),
    ]
    summ = {e["class"]: e for e in gpu_report.class_summary(rows)}
    fine = summ["fine"]
    assert fine["rows"] == 2
    assert fine["stats"]["vs_quack"]["geomean"] == pytest.approx(math.sqrt(1.3 * 1.1))
    assert fine["stats"]["vs_quack"]["min"] == pytest.approx(1.1)
    assert fine["stats"]["vs_quack"]["min_row"] == "qwen3-up uniform fwd"
    assert fine["stats"]["roofline"]["min"] == pytest.approx(0.8)
    assert summ["larger"]["stats"]["vs_torch"]["min"] == pytest.approx(0.95)
    assert summ["decode"]["stats"]["vs_torch"]["min"] == pytest.approx(1.3)
    assert all("targets" not in e for e in summ.values())
    text = gpu_report.summary(rows)
    assert "fine-grained (2 rows)" in text and "geomean" in text and "met" not in text


def test_render_md_names_the_environment_and_every_row(tmp_path):
    rows = [_row(), _row("olmoe-up-dec", "decode", pname="fwd")]
    doc = {
        "device": "NVIDIA H200",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "quack": True,
        "quack_version": "0.6.5",
        "cutlass_dsl": "4.8.1",
        "groupmm": {"version": "0.1.0", "cuda_archs": ["90a"]},
        "dtype": "bf16",
        "ceilings": {"dense_flops": 790e12, "copy_bytes_per_s": 4.3e12},
        "timer": {"rounds": 7, "select_rounds": 3, "sample_ms": 3.0, "calls": None},
        "argv": ["--shapes", "fine"],
        "complete": False,
        "rows": rows,
        "host_us": {"groupmm fwd": 13.0},
    }
    md = gpu_report.render_md(doc)
    for s in (
        "NVIDIA H200",
        "torch 2.11.0+cu130",
        "CUDA 13.0",
        "quack-kernels 0.6.5",
        "version 0.1.0",
        "790 TFLOP/s",
        "incomplete",
        "7 rounds",
    ):
        assert s in md, s
    table = [
        ln for ln in md.splitlines() if ln.startswith("| qwen3-up") or ln.startswith("| olmoe")
    ]
    assert len(table) == 2
    # groupmm 2000 TFLOP/s with its min-max over the rounds; vs quack with its paired range
    assert "2000 (1923–2041)" in table[0] and "1.20 (1.15–1.22)" in table[0]
    lines = [gpu_report.format_row(r) for r in rows]
    assert all("vs quack 1.20" in ln for ln in lines)
    # the JSON round trip renders the same
    p = tmp_path / "r.json"
    p.write_text(json.dumps(doc))
    assert gpu_report.render_md(json.loads(p.read_text())) == md


def test_defaults_and_dry_run(capsys):
    args = bench.parse_args([])
    assert args.rounds == 7 and args.select_rounds == 3 and args.passes == "fwd,dX,dW"
    plan = bench.plan_rows(
        shapes.select_shapes(args.shapes), ["fwd", "dX", "dW"], ["uniform", "zipf12"], False
    )
    assert len(plan) == len(shapes.SPECS) * 6
    assert bench.main(["--dry-run", "--quick", "--shapes", "decode"]) == 0
    out = capsys.readouterr().out
    assert "olmoe-up-dec" in out and out.rstrip().endswith(" rows over 6 shapes")
    q = bench.parse_args(["--quick", "--calls", "20"])
    assert q.rounds == 3 and q.calls == 20 and q.max_calls == 20


def test_spread_matches_statistics_module():
    data = [3.1, 2.7, 2.9, 3.3, 2.8, 3.0, 3.6]
    s = timing.spread(data)
    assert s["median"] == statistics.median(data)
    q = statistics.quantiles(data, n=4, method="inclusive")
    assert (s["q1"], s["q3"]) == (q[0], q[2])


class FakeQuack:
    """quack's entry points on the CPU, in its conventions (E+1 boundaries, varlen-M and
    varlen-K), with a configuration it cannot express and one that fails to run."""

    class GemmConfig:
        def __init__(self, **kw):
            if kw["tile_n"] == 256:
                raise ValueError("not on this quack")
            self.kw = kw

    @staticmethod
    def ref(a, b, cu_seqlens_m=None, cu_seqlens_k=None):
        cu = (cu_seqlens_m if cu_seqlens_m is not None else cu_seqlens_k).tolist()
        if cu_seqlens_m is not None:
            return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(cu, cu[1:]))])
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(cu, cu[1:])])

    def __init__(self):
        self.calls = {}
        quack = self

        class Tuned:
            @staticmethod
            def fn(a, b, out, config=None, **kw):
                key = (config.kw["tile_m"], config.kw["tile_n"])
                quack.calls[key] = quack.calls.get(key, 0) + 1
                out.copy_(quack.ref(a, b, **kw))

        def gemm(a, b, tuned=True, **kw):
            raise RuntimeError("default config: cannot compile here")

        self.Q = {"GemmConfig": self.GemmConfig, "gemm": gemm, "tuned": Tuned, "version": {}}


def test_run_shape_end_to_end_on_the_cpu(monkeypatch):
    """bench_gpu's row loop with every implementation (groupmm, F.grouped_mm, quack's
    selection and the chosen config, the loop, dense) on the CPU, timed by wall clock."""

    Event = WallClockEvent

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(timing, "_CYCLES_PER_MS", 1e6)
    gmm = getattr(torch.nn.functional, "grouped_mm", None)
    if gmm is not None:
        try:
            x = torch.ones(4, 8, dtype=torch.bfloat16)
            gmm(x, torch.ones(2, 8, 8, dtype=torch.bfloat16), offs=torch.tensor([2, 4]).int())
        except Exception:
            gmm = None
    args = bench.parse_args(["--rounds", "2", "--select-rounds", "1", "--max-calls", "2"])
    args.min_calls = 1
    spec = shapes.Spec(4, 32, 16, 64, "tiny", "up", 16, 4)
    ceil = {"dense_flops": 1e9, "copy_bytes_per_s": 1e9}
    fq = FakeQuack()
    seen = []
    passes = ["fwd", "dX", "dW", "fwd+bwd"]
    rows = bench.run_shape(
        "tiny",
        spec,
        64,
        ["uniform", "zipf12"],
        passes,
        torch.bfloat16,
        args,
        ceil,
        gmm,
        fq.Q,
        seen.append,
        dev="cpu",
    )
    assert seen == rows and len(rows) == 8
    assert [(r["routing"], r["pass"]) for r in rows[:4]] == [("uniform", p) for p in passes]
    for r in rows:
        assert r["class"] == "fine" and r["rows_per_group"] == 16
        assert r["ms"]["groupmm"] > 0 and r["ms"]["dense"] > 0 and r["roofline"] > 0
        assert r["bytes"] == bench.nbytes_for(r["pass"], 4, 32, 16, 64, 2)
        if gmm is not None:
            assert r["vs_torch"] > 0
        if r["pass"] == "fwd+bwd":
            assert r["errors"]["quack"] == "no autograd op" and r["ms"]["loop"] is None
            continue
        assert r["ms"]["loop"] > 0 and r["ms"]["quack"] > 0
        # the default failed, 128x256 could not be expressed: chosen among the other two
        assert r["quack_config"] in ("128x128 pp 1x1", "128x192 pp 1x1")
        assert set(r["quack_select"]) == {
            "default 128x192 pp 2x1",
            "128x128 pp 1x1",
            "128x192 pp 1x1",
        }
        assert r["quack_select"]["default 128x192 pp 2x1"].startswith("RuntimeError")
        assert len(r["samples_ms"]["quack"]) == 2
    assert set(fq.calls) == {(128, 128), (128, 192)}
    json.dumps(rows)


def test_main_writes_json_md_png_and_honours_the_budget(monkeypatch, tmp_path, capsys):
    """main() end to end on the CPU (a stand-in for CUDA's events and device queries; the
    ceilings and the host-cost step stubbed): outputs, environment, summary, --budget-s."""

    Event = WallClockEvent

    for name, value in (
        ("Event", Event),
        ("_sleep", lambda cycles: None),
        ("synchronize", lambda *a, **k: None),
        ("is_available", lambda: True),
        ("get_device_name", lambda *a: "Fake GPU"),
        ("get_device_capability", lambda *a: (9, 0)),
        ("empty_cache", lambda: None),
    ):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(timing, "_CYCLES_PER_MS", 1e6)
    monkeypatch.setattr(bench, "DEV", "cpu")
    monkeypatch.setattr(
        bench, "ceilings", lambda dtype, args: {"dense_flops": 1e9, "copy_bytes_per_s": 1e9}
    )
    monkeypatch.setattr(bench, "host_cost", lambda torch_gmm: {"groupmm fwd": 1.0})
    specs = {
        "tiny-a": shapes.Spec(4, 32, 16, 64, "tiny", "up", 16, 4),
        "tiny-dec": shapes.Spec(4, 32, 16, 16, "tiny", "up", 4, 4, True),
    }
    monkeypatch.setattr(shapes, "SPECS", specs)
    out = tmp_path / "r"
    argv = ["--no-quack", "--rounds", "2", "--max-calls", "2", "--passes", "fwd,dW"]
    argv += ["--json", f"{out}.json", "--md", f"{out}.md", "--png", f"{out}.png"]
    assert bench.main(argv) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["complete"] and doc["device"] == "Fake GPU" and doc["torch"] == torch.__version__
    assert doc["quack"] is False and doc["quack_why"] == "--no-quack"
    assert isinstance(doc["groupmm"], dict) and doc["timer"]["rounds"] == 2
    assert [(r["shape"], r["class"]) for r in doc["rows"]][::4] == [
        ("tiny-a", "fine"),
        ("tiny-dec", "decode"),
    ]
    assert len(doc["rows"]) == 8 and {e["class"] for e in doc["summary"]} == {"fine", "decode"}
    md = (tmp_path / "r.md").read_text()
    assert "Fake GPU" in md and "quack not measured (--no-quack)" in md and "| tiny-dec" in md
    printed = capsys.readouterr().out
    assert "[  1/8" in printed and "[  8/8" in printed and "decode sizes (4 rows)" in printed
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "r.png").stat().st_size > 0
    except ImportError:
        pass
    # a spent budget: no shape starts, each is listed as skipped, the files still written
    assert bench.main(argv + ["--budget-s", "1e-9"]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rows"] == [] and [s["shape"] for s in doc["skipped"]] == ["tiny-a", "tiny-dec"]


def test_load_docs_reads_a_comma_list(tmp_path):
    """--from-json's reader (report.load_docs): every file of the comma list, in order."""
    paths = []
    for i in range(3):
        path = tmp_path / f"r{i}.json"
        path.write_text(json.dumps({"rows": [i]}))
        paths.append(str(path))
    assert report.load_docs(",".join(paths)) == [{"rows": [0]}, {"rows": [1]}, {"rows": [2]}]
    with pytest.raises(FileNotFoundError):
        report.load_docs(str(tmp_path / "missing.json"))


def test_rr_settings_takes_the_round_robin_arguments_a_command_line_has():
    """timing.rr_settings: round_robin's keyword arguments from parsed args, only those
    the bench defines (bench_transformers has none), nothing else."""
    import argparse

    full = argparse.Namespace(
        rounds=5,
        sample_ms=3.0,
        calls=None,
        min_calls=3,
        max_calls=50,
        warmup=2,
        budget_s=10,
    )
    assert timing.rr_settings(full) == {
        "rounds": 5,
        "sample_ms": 3.0,
        "calls": None,
        "min_calls": 3,
        "max_calls": 50,
        "warmup": 2,
    }
    assert timing.rr_settings(argparse.Namespace(rounds=1, reps=10)) == {"rounds": 1}
