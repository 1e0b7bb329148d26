"""benches/bench_ep.py on the CPU: its pure parts (routing, the split's arithmetic, the row
from every rank's numbers, markdown and merging), the phase marks through a real backward,
and whole runs under torchrun on gloo (2 ranks in float64, 1 rank in float32, tiny sizes,
``--check``): exit 0, the JSON's structure, and every implementation that ran giving the
same outputs and gradients as a plain-torch reference and as groupmm's fused layer.

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
ep_split = load_bench("ep_split")
ep_report = load_bench("ep_report")
bench = load_bench("bench_ep")

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

    ph = ep_split.phases_of(ms, st)
    assert ph == {"step": 13.0, "dispatch": 3.0, "experts": 7.5, "combine": 2.5}
    assert sum(ph[p] for p in ep_split.PHASES) == ph["step"]
    partial = {k: v for k, v in st.items() if k != "b2"}  # a boundary the step missed
    assert ep_split.phases_of(ms, partial) == {"step": 13.0}
    assert ep_split.phases_of(ms, {"t0": 1.0, "f3": 2.0, "t1": 4.0}, ep=False) == {
        "step": 3.0,
        "experts": 3.0,
    }


def test_marks_stamp_forward_and_backward_in_order():
    """The identity marks record their boundaries when the forward passes them and again
    when the gradient does, and change nothing in between."""
    clock = ep_split.Clock(cuda=False)
    split = ep_split.Split(clock)
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
    ph = ep_split.phases_of(clock.ms, st)
    assert set(ph) == {"step", *ep_split.PHASES}


def _rank(samples, phases, recv):
    return {"rank": 0, "recv_rows": recv, "samples": samples, "phases": phases}


def test_row_takes_the_slowest_rank_and_the_ratios():
    names = ["fused", "torchtitan", "single"]
    ph = {"dispatch": 1.0, "experts": 2.0, "combine": 1.0, "step": 4.0}
    r0 = _rank(
        {"fused": [4.0, 5.0, 4.0], "torchtitan": [8.0, 8.0, 9.0], "single": [2.0, 2.0, 2.0]},
        {"fused": ph, "torchtitan": dict(ph, experts=3.0), "single": {"step": 2, "experts": 2}},
        300,
    )
    r1 = _rank(
        {"fused": [6.0, 4.0, 6.0], "torchtitan": [7.0, 9.0, 9.0], "single": [1.0, 1.0, 1.0]},
        {
            "fused": dict(ph, dispatch=3.0),
            "torchtitan": ph,
            "single": {"step": 1, "experts": 1},
        },
        100,
    )
    spec = {"config": "c", "routing": "uniform", "T": 1000, "d_model": 8, "d_ff": 8}
    spec.update(experts=4, top_k=2)
    row = ep_report.make_row(spec, 2, [r0, r1], names, {"unfused": "why"}, None, "bfloat16")
    f, t = row["impls"]["fused"], row["impls"]["torchtitan"]
    assert f["samples_ms"] == [6.0, 5.0, 6.0]  # the slowest rank of each round
    assert f["step_ms"] == 6.0 and t["step_ms"] == 9.0
    assert f["tokens_per_s_per_gpu"] == pytest.approx(1000 / 6e-3)
    assert f["phases_ms"] == {"dispatch": 3.0, "experts": 2.0, "combine": 1.0}
    assert f["vs_torchtitan"] == pytest.approx(1.5)
    assert f["vs_torchtitan_rounds"]["min"] == pytest.approx(8.0 / 6.0)
    assert t["vs_torchtitan"] == pytest.approx(1.0) and t["vs_torchtitan_rounds"] is None
    assert f["experts_vs_single_per_rank"] == [1.0, 2.0] and f["experts_vs_single"] == 2.0
    assert t["experts_vs_single_per_rank"] == [1.5, 2.0] and t["experts_vs_single"] == 2.0
    single = row["impls"]["single"]
    assert single["vs_torchtitan"] is None and single["phases_ms"]["dispatch"] is None
    assert row["recv_rows"] == [300, 100] and row["recv_imbalance"] == 1.5
    assert row["errors"] == {"unfused": "why"}


def _doc(world, step):
    ph = {"dispatch": 1.0, "experts": 2.0, "combine": 0.5}
    impl = {
        "step_ms": step,
        "samples_ms": [step],
        "tokens_per_s_per_gpu": 64 / (step / 1e3),
        "phases_ms": ph,
        "vs_torchtitan": None,
        "vs_torchtitan_rounds": None,
        "experts_vs_single": 1.05,
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
    assert "| tiny (16, 32, 8, 2) | skewed | 1 | groupmm fused | 3.00 | 21.3k |" in md
    assert "| tiny (16, 32, 8, 2) | skewed | 2 | groupmm fused | 4.00 | 16.0k |" in md
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
    cmd += ["--warmup", "1", "--rounds", "2", "--calls", "1", "--json", str(out), "--md", str(md)]
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
    tt = doc["torchtitan"]
    expected = {"fused", "unfused", "single"} | ({"torchtitan"} if tt["used"] else set())
    assert [r["routing"] for r in doc["rows"]] == routings
    for row in doc["rows"]:
        assert row["world"] == world and len(row["recv_rows"]) == world
        assert set(row["impls"]) == expected, row["errors"]
        if not tt["used"]:
            assert tt["why"] and row["errors"]["torchtitan"] == tt["why"]
        for name, v in row["impls"].items():
            assert v["step_ms"] > 0 and len(v["samples_ms"]) == 2, name
            assert len(v["per_rank"]) == world
            assert v["phases_ms"]["experts"] > 0, name
            if name != "single":  # the split reached every EP implementation
                assert all(v["phases_ms"][p] is not None for p in ep_split.PHASES), name
                assert v["experts_vs_single"] > 0
        # the speed comparison is also a correctness comparison
        c = row["check"]
        assert c["ok"], c["failed"]
        assert set(c["vs_reference"]) == expected - {"single"}
        assert set(c["vs_fused"]) == expected - {"single", "fused"}
        for name, qs in c["vs_reference"].items():
            assert set(qs) == set(ep_run.GRADS)
            assert all(v <= c["tolerance"][name] for v in qs.values()), (name, qs)
        if tt["used"]:
            assert row["impls"]["fused"]["vs_torchtitan"] > 0
    assert "| tiny (16, 32, 8, 2) |" in md and "check: every implementation within" in md
    assert "groupmm fused" in stdout and "tok/s/GPU" in stdout


@needs_gloo
def test_two_ranks_float64(tmp_path):
    doc, md, out = _launch(tmp_path, 2, "fp64", "uniform,skewed")
    _check_doc(doc, md, out, 2, "float64", ["uniform", "skewed"])
    for row in doc["rows"]:
        for name in ("fused", "unfused"):
            assert max(row["check"]["vs_reference"][name].values()) <= 1e-10
    skewed = doc["rows"][1]["recv_rows"]
    assert skewed[0] > skewed[1]  # rank 0 owns the popular experts


@needs_gloo
def test_one_rank_float32(tmp_path):
    doc, md, out = _launch(tmp_path, 1, "fp32", "skewed")
    _check_doc(doc, md, out, 1, "float32", ["skewed"])
    assert doc["rows"][0]["recv_rows"] == [48 * 2]  # every copy stays on the one rank
