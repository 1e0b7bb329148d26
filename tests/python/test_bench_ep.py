"""benches/bench_ep.py on the CPU: its pure parts (routing, the split's arithmetic, the row
from every rank's numbers with its EP efficiency, exchange sizes and all-to-all bandwidth,
markdown and merging, files without those fields), the phase marks through a real
backward, and whole runs under torchrun on gloo (2 ranks in float64, 1 rank in float32,
tiny sizes, ``--check``): exit 0, the JSON's structure, and every implementation that ran
(fixed-size exchanges and the whole layer on one rank included) giving the same outputs and
gradients as a plain-torch reference and as groupmm's fused layer. benches/profile_ep.py:
its options, its markdown and a 2-rank gloo run of both modes.

torchtitan is not installed in CI: there the bench skips it and says why, which is checked;
where it imports (e.g. PYTHONPATH with torchtitan 0.3.0 and its dependencies), its rows are
checked like the others (to bf16's tolerance: it computes in bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import load_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benches" / "bench_ep.py"

ep_run = load_bench("ep_run")
timing = load_bench("harness.timing")
ep_report = load_bench("harness.report.ep")
bench = load_bench("bench_ep")
profile_ep = load_bench("profile_ep")

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


# ---------------------------------------------------------------------- pure parts


def test_routing_uniform_and_skewed():
    gen = torch.Generator().manual_seed(0)
    for kind in ep_run.ROUTINGS:
        ids, w = ep_run.make_routing(4000, 16, 3, kind, gen)
        assert ids.shape == (4000, 3) and ids.dtype == torch.int64
        assert int(ids.min()) >= 0 and int(ids.max()) < 16
        assert (ids.sort(1).values.diff(dim=1) > 0).all(), "a token's experts are distinct"
        torch.testing.assert_close(w.sum(1), torch.ones(4000, dtype=torch.float64))
        counts = torch.bincount(ids.reshape(-1), minlength=16).double()
        if kind == "uniform":
            assert counts.max() / counts.mean() < 1.2
        else:  # Zipf by expert id: the first rank's experts are the popular ones
            assert counts[0] > counts[1] > counts[8] > counts[15]
            assert counts[:4].sum() > 1.5 * counts[12:].sum()
    with pytest.raises(ValueError, match="routing"):
        ep_run.make_routing(4, 4, 1, "zipf", gen)


def test_phases_add_up_to_the_step():
    st = {"t0": 0.0, "f1": 2.0, "f2": 5.0, "f3": 6.0, "b2": 7.5, "b1": 12.0, "t1": 13.0}

    def ms(a, b):
        return b - a

    ph = ep_report.phases_of(ms, st)
    assert ph == {"step": 13.0, "dispatch": 3.0, "experts": 7.5, "combine": 2.5}
    assert sum(ph[p] for p in ep_report.PHASES) == ph["step"]
    partial = {k: v for k, v in st.items() if k != "b2"}  # a boundary the step missed
    assert ep_report.phases_of(ms, partial) == {"step": 13.0}
    assert ep_report.phases_of(ms, {"t0": 1.0, "f3": 2.0, "t1": 4.0}, ep=False) == {
        "step": 3.0,
        "experts": 3.0,
    }


def test_marks_stamp_forward_and_backward_in_order():
    """The identity marks record their boundaries when the forward passes them and again
    when the gradient does, and change nothing in between."""
    clock = timing.Clock(cuda=False)
    split = bench.Split(clock)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert split.mark(x, "f1", "b1") is x  # outside a timed step: no node at all
    split.begin()
    h = split.mark(x, "f1", "b1")
    y = split.mark(h * 3.0, "f2", "b2")
    split.stamp("f3")
    y.backward(torch.ones_like(y))
    st = split.end()
    order = ["t0", "f1", "f2", "f3", "b2", "b1", "t1"]
    assert sorted(st, key=st.get) == order
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    ph = ep_report.phases_of(clock.ms, st)
    assert set(ph) == {"step", *ep_report.PHASES}


def _rank(samples, phases, recv, **more):
    return {"rank": 0, "recv_rows": recv, "samples": samples, "phases": phases, **more}


def test_row_takes_the_slowest_rank_and_the_ratios():
    names = ["fused", "torchtitan"]
    ph = {"dispatch": 1.0, "experts": 2.0, "combine": 1.0, "step": 4.0}
    r0 = _rank(
        {"fused": [4.0, 5.0, 4.0], "torchtitan": [8.0, 8.0, 9.0]},
        {"fused": ph, "torchtitan": dict(ph, experts=3.0)},
        300,
    )
    r1 = _rank(
        {"fused": [6.0, 4.0, 6.0], "torchtitan": [7.0, 9.0, 9.0]},
        {"fused": dict(ph, dispatch=3.0), "torchtitan": ph},
        100,
    )
    spec = {"config": "c", "routing": "uniform", "T": 1000, "d_model": 8, "d_ff": 8}
    spec.update(experts=4, top_k=2)
    row = ep_report.make_row(spec, 2, [r0, r1], names, {"fixed": "why"}, None, "bfloat16")
    f, t = row["impls"]["fused"], row["impls"]["torchtitan"]
    assert f["samples_ms"] == [6.0, 5.0, 6.0]  # the slowest rank of each round
    assert f["step_ms"] == 6.0 and t["step_ms"] == 9.0
    assert f["tokens_per_s_per_gpu"] == pytest.approx(1000 / 6e-3)
    assert f["phases_ms"] == {"dispatch": 3.0, "experts": 2.0, "combine": 1.0}
    assert f["vs_torchtitan"] == pytest.approx(1.5)
    assert f["vs_torchtitan_rounds"]["min"] == pytest.approx(8.0 / 6.0)
    assert t["vs_torchtitan"] == pytest.approx(1.0) and t["vs_torchtitan_rounds"] is None
    assert row["recv_rows"] == [300, 100] and row["recv_imbalance"] == 1.5
    assert row["errors"] == {"fixed": "why"}
    # no whole layer, no splits, no all-to-all: those figures are left out
    assert f["ep_efficiency"] is None and "exchange" not in f and "alltoall" not in row


def test_row_efficiency_exchanges_and_bandwidth():
    """EP efficiency = whole's step / this one's (the slowest rank's, median over rounds);
    the exchanges' rows and bytes from every rank's splits (fused) or from T (fixed); the
    all-to-all's time from the slowest rank per sample."""
    names = ["fused", "fixed", "pipelined", "whole"]
    ph = {"dispatch": 2.0, "experts": 2.0, "combine": 1.0, "step": 5.0}
    local = {"step": 3.0, "experts": 3.0}
    phases = {"fused": ph, "fixed": ph, "pipelined": ph, "whole": local}
    row_bytes = 16 * 2  # d = 16 in bf16
    ranks = []
    # rank 0 sends [30, 10] rows to ranks 0, 1 and rank 1 [20, 40]: rank 0 receives
    # [30, 20], rank 1 [10, 40]
    for steps, ins, outs, a2a in (
        ([5.0, 4.0], [30, 10], [30, 20], {"fixed": [1.0, 2.0, 3.0], "exact": [1.0, 1.0, 1.0]}),
        ([4.0, 4.0], [20, 40], [10, 40], {"fixed": [2.0, 1.0, 5.0], "exact": [0.5, 2.0, 1.0]}),
    ):
        samples = {n: steps for n in ("fused", "fixed", "pipelined")}
        samples.update(whole=[3.0, 2.0])
        splits = {"in": ins, "out": outs}
        alltoall = {"fixed": {"rows": 2 * 64, "ms": a2a["fixed"]}}
        alltoall["exact"] = {"rows": 50, "ms": a2a["exact"]}
        ranks.append(
            _rank(samples, phases, 100, splits=splits, row_bytes=row_bytes, alltoall=alltoall)
        )
    spec = {"config": "c", "routing": "uniform", "T": 64, "d_model": 16, "d_ff": 8}
    spec.update(experts=4, top_k=2)
    row = ep_report.make_row(spec, 2, ranks, names, {}, None, "bfloat16")
    im = row["impls"]
    assert im["fused"]["step_ms"] == 4.5 and im["whole"]["step_ms"] == 2.5
    for n in ("fused", "fixed", "pipelined"):
        assert im[n]["ep_efficiency"] == pytest.approx(2.5 / 4.5)
        assert im[n]["ep_efficiency_rounds"]["min"] == pytest.approx(2.0 / 4.0)
        assert im[n]["ep_efficiency_rounds"]["max"] == pytest.approx(3.0 / 5.0)
    assert im["whole"]["ep_efficiency"] is None
    assert im["whole"]["vs_torchtitan"] is None and "exchange" not in im["pipelined"]
    # fused: rank 0 sends [30, 10] (10 off-rank), rank 1 [20, 40] (20 off-rank); rank 0
    # receives [30, 20] (20 off-rank back), rank 1 [10, 40] (10 off-rank back)
    x = im["fused"]["exchange"]
    assert x["dispatch_rows"] == [40, 60] and x["return_rows"] == [50, 50]
    assert x["dispatch_bytes_off"] == [10 * row_bytes, 20 * row_bytes]
    assert x["return_bytes_off"] == [20 * row_bytes, 10 * row_bytes]
    assert x["phase_bytes_off"] == [30 * row_bytes] * 2
    assert x["step_bytes_off"] == [60 * row_bytes] * 2
    assert x["achieved_gb_per_s"] == pytest.approx(30 * row_bytes / 2.0 / 1e6)
    x = im["fixed"]["exchange"]
    assert x["dispatch_rows"] == [128, 128] and x["return_rows"] == [128, 128]
    assert x["dispatch_bytes_off"] == [64 * row_bytes] * 2
    a = row["alltoall"]["fixed"]
    assert a["rows"] == 128 and a["bytes_off_rank"] == 64 * row_bytes
    assert a["samples_ms"] == [2.0, 2.0, 5.0] and a["ms"] == 2.0
    assert a["per_rank_ms"] == [2.0, 2.0]
    assert a["gb_per_s"] == pytest.approx(64 * row_bytes / 2.0 / 1e6)
    e = row["alltoall"]["exact"]
    assert e["samples_ms"] == [1.0, 2.0, 1.0] and e["bytes_off_rank"] == 25 * row_bytes
    md = ep_report.render_md({"world": 2, "device": "cpu", "argv": ["x"], "rows": [row]})
    assert "**EP efficiency**" in md and "| c (16, 8, 4, 2) | uniform | 2 | **0.56** |" in md
    assert "| groupmm fused, fixed sizes | 0.56 (0.50–0.60) | 4.50 |" in md
    assert "all_to_all_single, fixed-size rows (W*T) | 128 | - |" in md
    assert "groupmm fused: dispatch phase | 50 | 50 |" in md
    lines = ep_report.bandwidth_lines(row)
    assert len(lines) == 4 and lines[-1].endswith(" (lower bound) |") and lines[-1] in md
    assert ep_report.format_line(row, "fixed") in md
    assert "| groupmm fused | 0.56 " in ep_report.format_line(row, "fused")
    # W = 1: nothing leaves the rank, no bandwidth
    one = ep_report.alltoall_figures(64, 1, row_bytes, [[1.0, 2.0, 3.0]])
    assert one["bytes_off_rank"] == 0 and one["gb_per_s"] is None and one["ms"] == 2.0


def _doc(world, step):
    ph = {"dispatch": 1.0, "experts": 2.0, "combine": 0.5}
    impl = {
        "step_ms": step,
        "samples_ms": [step],
        "tokens_per_s_per_gpu": 64 / (step / 1e3),
        "phases_ms": ph,
        "vs_torchtitan": None,
        "vs_torchtitan_rounds": None,
    }
    row = {"config": "tiny", "routing": "skewed", "world": world, "d_model": 16, "d_ff": 32}
    row.update(experts=8, top_k=2, recv_imbalance=1.4, impls={"fused": impl})
    row.update(errors={"torchtitan": "import torchtitan failed"}, check=None)
    return {"world": world, "device": "cpu", "argv": ["run", str(world)], "rows": [row]}


def test_markdown_and_merge(tmp_path):
    merged = ep_report.merge_docs([_doc(1, 3.0), _doc(2, 4.0)])
    assert [r["world"] for r in merged["rows"]] == [1, 2]
    assert merged["runs"] == [["run", "1"], ["run", "2"]]
    md = ep_report.render_md(merged)
    # files written before the EP efficiency and the bandwidth: no such figures, no tables
    assert "| tiny (16, 32, 8, 2) | skewed | 1 | groupmm fused | - | 3.00 | 21.3k |" in md
    assert "| tiny (16, 32, 8, 2) | skewed | 2 | groupmm fused | - | 4.00 | 16.0k |" in md
    assert "**EP efficiency**" not in md and "all_to_all_single," not in md
    assert "| groupmm fused | - |" in ep_report.format_line(merged["rows"][0], "fused")
    assert "- torchtitan: import torchtitan failed (tiny skewed W=1; tiny skewed W=2)" in md
    # --from-json renders and merges without torchrun
    paths = []
    for w, s in ((1, 3.0), (2, 4.0)):
        p = tmp_path / f"w{w}.json"
        p.write_text(json.dumps(_doc(w, s)))
        paths.append(str(p))
    out_md, out_json = tmp_path / "all.md", tmp_path / "all.json"
    assert bench.main(["--from-json", ",".join(paths), "--md", str(out_md)]) == 0
    assert out_md.read_text().count("groupmm fused") == 2
    assert bench.main(["--from-json", ",".join(paths), "--json", str(out_json)]) == 0
    assert len(json.loads(out_json.read_text())["rows"]) == 2


# ---------------------------------------------------------------------- whole runs


def _launch(tmp_path, world, dtype, routing):
    out = tmp_path / f"ep_w{world}_{dtype}.json"
    md = tmp_path / f"ep_w{world}_{dtype}.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(world), str(SCRIPT), "--device", "cpu", "--dtype", dtype]
    cmd += ["--configs", "tiny", "--routing", routing, "--tokens-per-gpu", "48", "--check"]
    cmd += ["--warmup", "1", "--rounds", "2", "--calls", "1", "--a2a-samples", "3"]
    cmd += ["--json", str(out), "--md", str(md)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), md.read_text(), proc.stdout


def _check_doc(doc, md, stdout, world, dtype, routings):
    assert doc["schema"] == "ep-1" and doc["complete"] is True
    assert doc["world"] == world and doc["device"] == "cpu" and doc["backend"] == "gloo"
    assert doc["torch"] == torch.__version__ and doc["dtype"] == dtype
    assert doc["argv"][0].startswith(f"torchrun --standalone --nproc-per-node {world} ")
    assert "--check" in doc["argv"] and doc["started"] and doc["tokens_per_gpu"] == 48
    assert doc["timer"]["split"] is True and doc["timer"]["clock"] == "perf_counter"
    assert doc["timer"]["a2a_samples"] == 3
    tt = doc["torchtitan"]
    ep = {"fused", "fixed", "pipelined"} | ({"torchtitan"} if tt["used"] else set())
    expected = ep | {"whole"}
    assert [r["routing"] for r in doc["rows"]] == routings
    for row in doc["rows"]:
        assert row["world"] == world and len(row["recv_rows"]) == world
        assert set(row["impls"]) == expected, row["errors"]
        if not tt["used"]:
            assert tt["why"] and row["errors"]["torchtitan"] == tt["why"]
        for name, v in row["impls"].items():
            assert v["step_ms"] > 0 and len(v["samples_ms"]) == 2, name
            assert len(v["per_rank"]) == world
            if name == "pipelined":  # the step alone: its slices pass the marks twice
                assert v["phases_ms"]["experts"] is None, name
                continue
            assert v["phases_ms"]["experts"] > 0, name
            if name in ep:  # the split reached every EP implementation
                assert all(v["phases_ms"][p] is not None for p in ep_report.PHASES), name
                whole = row["impls"]["whole"]["step_ms"]
                assert v["ep_efficiency"] == pytest.approx(whole / v["step_ms"]), name
            else:  # one GPU, no exchange: the whole step is experts
                assert v["phases_ms"]["dispatch"] is None and v["ep_efficiency"] is None
        # the exchanges: every rank's dispatch is some rank's return, T rows per pair with
        # fixed sizes; the bytes are the [rows, d] rows that leave a rank
        row_bytes = 16 * (8 if dtype == "float64" else 4)
        fused, fixed = row["impls"]["fused"]["exchange"], row["impls"]["fixed"]["exchange"]
        assert fused["row_bytes"] == fixed["row_bytes"] == row_bytes
        assert sum(fused["dispatch_rows"]) == sum(fused["return_rows"])
        assert all(48 <= n <= 48 * min(world, 2) for n in fused["dispatch_rows"])
        assert fixed["dispatch_rows"] == fixed["return_rows"] == [world * 48] * world
        assert fixed["dispatch_bytes_off"] == [(world - 1) * 48 * row_bytes] * world
        a2a = row["alltoall"]
        assert a2a["fixed"]["rows"] == world * 48 and a2a["exact"]["rows"] % world == 0
        assert a2a["exact"]["rows"] == world * round(sum(fused["dispatch_rows"]) / world**2)
        for a in a2a.values():
            assert a["ms"] > 0 and len(a["samples_ms"]) == 3 and len(a["per_rank_ms"]) == world
            assert a["bytes_off_rank"] == a["rows"] // world * (world - 1) * row_bytes
            if world > 1:
                assert a["gb_per_s"] > 0
                assert fused["achieved_gb_per_s"] > 0 and fixed["achieved_gb_per_s"] > 0
            else:
                assert a["gb_per_s"] is None and fixed["achieved_gb_per_s"] is None
        # the speed comparison is also a correctness comparison
        c = row["check"]
        assert c["ok"], c["failed"]
        assert set(c["vs_reference"]) == expected
        assert set(c["vs_fused"]) == expected - {"fused"}
        for name, qs in c["vs_reference"].items():
            assert set(qs) == set(ep_run.GRADS)
            assert all(v <= c["tolerance"][name] for v in qs.values()), (name, qs)
        if tt["used"]:
            assert row["impls"]["fused"]["vs_torchtitan"] > 0
    assert "| tiny (16, 32, 8, 2) |" in md and "check: every implementation within" in md
    assert "**EP efficiency**" in md and "groupmm fused, fixed sizes: dispatch phase" in md
    assert "groupmm fused" in stdout and "tokens/s/GPU" in stdout and "EP efficiency" in stdout
    assert "all_to_all_single, fixed-size rows" in stdout


@needs_gloo
def test_two_ranks_float64(tmp_path):
    doc, md, out = _launch(tmp_path, 2, "fp64", "uniform,skewed")
    _check_doc(doc, md, out, 2, "float64", ["uniform", "skewed"])
    for row in doc["rows"]:
        for name in ("fused", "fixed", "pipelined", "whole"):
            assert max(row["check"]["vs_reference"][name].values()) <= 1e-10
        # fixed sizes move the same rows (and padding): fused's results, to rounding
        assert max(row["check"]["vs_fused"]["fixed"].values()) <= 1e-12
    skewed = doc["rows"][1]["recv_rows"]
    assert skewed[0] > skewed[1]  # rank 0 owns the popular experts


@needs_gloo
def test_one_rank_float32(tmp_path):
    doc, md, out = _launch(tmp_path, 1, "fp32", "skewed")
    _check_doc(doc, md, out, 1, "float32", ["skewed"])
    assert doc["rows"][0]["recv_rows"] == [48 * 2]  # every copy stays on the one rank


# ---------------------------------------------------------------------- profile_ep


def test_profile_options_and_markdown():
    assert profile_ep.parse_args([]).modes == ["exact"]
    a = profile_ep.parse_args(["--modes", "exact,fixed", "--tokens-per-gpu", "64"])
    assert a.modes == ["exact", "fixed"] and a.tokens_per_gpu == 64
    for bad in (["--modes", "exact,exact"], ["--modes", "fast"], ["--capacity", "80"]):
        with pytest.raises(SystemExit):
            profile_ep.parse_args(bad)
    assert profile_ep.trace_path("/t/p.json.gz", "fixed", True) == "/t/p-fixed.json.gz"
    assert profile_ep.trace_path("/t/p.json", "exact", False) == "/t/p.json"
    summary = {"span": 3.0, "gemm": 1.0, "nccl": 1.0, "rows": 0.5, "other": 0.25, "idle": 0.25}
    doc = {"argv": "torchrun x", "device": "H200", "world": 2, "torch": "2.x", "backend": "nccl"}
    doc.update(config="mixtral", dims=[4096, 14336, 8, 2], tokens_per_gpu=16384)
    mode = dict(mode="exact", capacity=None, steps_ms=[3.0], summary=summary)
    mode["marks"] = [[["start", 0.0, 0.0]]] * 2
    doc.update(dtype="bfloat16", modes=[mode])
    md = profile_ep.render_md(doc)
    assert "(nccl)" in md and "bfloat16" in md
    assert "| exact (capacity=None: one host sync per call) | 3.00 | 3.00 | 1.00 |" in md


@needs_gloo
def test_profile_both_modes_on_gloo(tmp_path):
    md = tmp_path / "prof.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "benches" / "profile_ep.py"), "--device", "cpu", "--config", "tiny"]
    cmd += ["--tokens-per-gpu", "32", "--modes", "exact,fixed", "--md", str(md)]
    cmd += ["--trace", str(tmp_path / "trace.json.gz")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((tmp_path / "prof.json").read_text())
    assert [m["mode"] for m in doc["modes"]] == ["exact", "fixed"]
    assert [m["capacity"] for m in doc["modes"]] == [None, 32]
    for m in doc["modes"]:
        assert len(m["steps_ms"]) == 5 and len(m["marks"]) == 2
        assert set(m["summary"]) >= {*profile_ep.CATEGORIES, "idle", "span"}
        assert Path(m["trace"]).exists() and m["trace"].endswith(f"-{m['mode']}.json.gz")
    names = [n for n, _, _ in doc["modes"][1]["marks"][0]]
    assert "plan_fixed<" in names and "plan_tokens<" not in names
    text = md.read_text()
    assert "fixed (capacity=32: no host sync)" in text and "(gloo)" in text
