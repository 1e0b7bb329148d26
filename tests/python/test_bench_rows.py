"""benches/bench_rows.py on the CPU: the bytes of each op against hand counts and against
the tensors the op reads and writes, the shape list and its --max-gib skips, the routing
indices, the torch equivalents (against a float64 loop written here) and groupmm's ops
against them, rows, the summary and the markdown from synthetic results, --dry-run and
--from-json through main(), and main() end to end with CUDA's events, device queries and
memory counters stood in for (the GPU run itself is the lead's).

``benches/bench_rows.py`` and the harness modules it uses (``harness.report.rows``,
``harness.report``, ``harness.timing``) are loaded from benches/.
"""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from conftest import WallClockEvent, load_bench

timing = load_bench("harness.timing")
report = load_bench("harness.report")
rows_report = load_bench("harness.report.rows")
bench = rows_ops = load_bench("bench_rows")

BF16 = torch.bfloat16


# ---------------------------------------------------------------------- bytes


def test_op_bytes_hand_counts():
    # T = 3 tokens, D = 4, k = 2: R = 6 routed rows; bf16 (2 bytes)
    T, D, k = 3, 4, 2
    # combine: read 6 rows (48 B), write 3 rows (24 B), int32 index 6 x 4, weights 6 x 4
    assert rows_ops.op_bytes("combine", T, D, k, 2) == 48 + 24 + 24 + 24 == 120
    assert rows_ops.op_bytes("sum", T, D, k, 2) == 48 + 24 + 24 == 96
    # gather: read the 3 source rows once (24 B), write 6 rows, int32 src 6 x 4
    assert rows_ops.op_bytes("gather", T, D, k, 2) == 24 + 48 + 24 == 96
    # scatter: read the 3 rows of grad once, write 6 rows, the index
    assert rows_ops.op_bytes("scatter", T, D, k, 2) == 24 + 48 + 24 == 96
    # fp32 rows: the row terms double, the index and weights stay 4 bytes an entry
    assert rows_ops.op_bytes("combine", T, D, k, 4) == 96 + 48 + 24 + 24
    assert rows_ops.op_bytes("gather", 5, 8, 1, 4) == 2 * 5 * 8 * 4 + 5 * 4
    # the minimum: below what a naive count (R rows read for gather) would say
    assert rows_ops.op_bytes("gather", 3, 4, 2, 2) < 2 * 6 * 4 * 2 + 6 * 4
    with pytest.raises(ValueError, match="op: expected one of"):
        rows_ops.op_bytes("copy", T, D, k, 2)


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
@pytest.mark.parametrize("op", rows_ops.OPS)
def test_op_bytes_are_the_tensors_the_op_touches(op, dt):
    """The formula against the nbytes of the op's actual operands and output, each read or
    written once: the minimum any implementation must move."""
    T, D, k = 12, 16, 4
    R, dtype = T * k, rows_ops.DTYPES[dt]
    idx = rows_ops.routing_indices(T, k, seed=3)
    y = torch.randn(R, D, dtype=dtype)
    x = torch.randn(T, D, dtype=dtype)
    w = torch.rand(T, k)
    if op == "combine":
        out = rows_ops.gather_sum(y, idx.inverse, w)
        touched = y.nbytes + idx.inverse.nbytes + w.nbytes + out.nbytes
    elif op == "sum":
        out = rows_ops.gather_sum(y, idx.inverse, None)
        touched = y.nbytes + idx.inverse.nbytes + out.nbytes
    elif op == "gather":
        out = rows_ops.gather_sum(x, idx.src.view(-1, 1), None)
        touched = x.nbytes + idx.src.nbytes + out.nbytes  # each row of x read once
    else:
        out = rows_ops.scatter_rows(x, idx.inverse, None, R)
        touched = x.nbytes + idx.inverse.nbytes + out.nbytes
    assert idx.src.dtype == idx.inverse.dtype == torch.int32
    assert rows_ops.op_bytes(op, T, D, k, rows_ops.ELEMENT_SIZE[dt]) == touched


def test_largest_and_alloc_bytes():
    assert rows_ops.largest_bytes(4096, 2048, 8, 2) == 4096 * 8 * 2048 * 2
    assert rows_ops.largest_bytes(4096, 2048, 1, 4) == 4096 * 2048 * 4
    for op in rows_ops.OPS:
        for T, D, k, es in ((256, 768, 1, 2), (4096, 7168, 8, 2), (4096, 2048, 8, 4)):
            a = rows_ops.alloc_bytes(op, T, D, k, es)
            # at least inputs, groupmm's and torch's outputs and the copy buffers
            assert a >= rows_ops.largest_bytes(T, D, k, es) + rows_ops.op_bytes(op, T, D, k, es)
    # combine's float32 temporaries make it the largest of a shape
    a = {op: rows_ops.alloc_bytes(op, 4096, 2048, 8, 2) for op in rows_ops.OPS}
    assert max(a, key=a.get) == "combine"


# ---------------------------------------------------------------------- the shape list


def _skips_by_hand(max_gib):
    """The (dtype, T, D, k) shapes whose [R, D] exceeds max_gib GiB, by brute force."""
    out = set()
    for dt, ds, ks, ts in (
        ("bf16", rows_ops.DIMS, rows_ops.TOPK, rows_ops.TOKENS),
        ("fp16", (2048, 7168), (1, 8), (4096, 65536)),
        ("fp32", (2048, 7168), (1, 8), (4096, 65536)),
    ):
        es = {"bf16": 2, "fp16": 2, "fp32": 4}[dt]
        for T in ts:
            for D in ds:
                for k in ks:
                    if T * k * D * es > max_gib * 2**30:
                        out.add((dt, T, D, k))
    return out


def test_default_shape_list_and_max_gib_skips():
    assert rows_ops.DIMS == (768, 2048, 4096, 7168)
    assert rows_ops.TOPK == (1, 2, 4, 8, 16)
    assert rows_ops.TOKENS == (256, 4096, 16384, 65536)
    rows, skipped = rows_ops.plan_rows()
    # bf16: 4 x 5 x 4 = 80 shapes; fp16, fp32: 2 x 2 x 2 = 8 each
    # over 3 GiB: bf16 T=65536 (k 16: D 2048, 4096, 7168; k 8: 4096, 7168; k 4: 7168),
    # bf16 T=16384 k=16 D=7168; fp16 T=65536 k=8 D=7168; fp32 T=65536 k=8 D=2048, 7168
    want_skip = {
        ("bf16", 65536, 2048, 16),
        ("bf16", 65536, 4096, 16),
        ("bf16", 65536, 7168, 16),
        ("bf16", 65536, 4096, 8),
        ("bf16", 65536, 7168, 8),
        ("bf16", 65536, 7168, 4),
        ("bf16", 16384, 7168, 16),
        ("fp16", 65536, 7168, 8),
        ("fp32", 65536, 2048, 8),
        ("fp32", 65536, 7168, 8),
    }
    assert want_skip == _skips_by_hand(3.0)
    got_skip = {
        (s["row"].split()[0], *(int(p.split("=")[1]) for p in s["row"].split()[1:]))
        for s in skipped
    }
    assert got_skip == {(dt, T, D, k) for dt, T, D, k in want_skip}
    assert all("> --max-gib 3" in s["why"] for s in skipped)
    assert len(skipped) == 10
    assert len(rows) == 4 * (80 + 8 + 8 - 10) == 344
    shapes = {(r["dtype"], r["T"], r["D"], r["k"]) for r in rows}
    assert len(shapes) == 86 and not shapes & want_skip
    by_dt = {dt: sum(1 for s in shapes if s[0] == dt) for dt in rows_ops.DTYPES}
    assert by_dt == {"bf16": 73, "fp16": 7, "fp32": 6}
    # every op on every shape, gather for k = 1 too
    for s in shapes:
        ops = [r["op"] for r in rows if (r["dtype"], r["T"], r["D"], r["k"]) == s]
        assert ops == list(rows_ops.OPS)
    assert any(r["op"] == "gather" and r["k"] == 1 for r in rows)
    # fields
    r = next(
        r
        for r in rows
        if (r["op"], r["dtype"], r["T"], r["D"], r["k"]) == ("sum", "bf16", 4096, 2048, 8)
    )
    assert (r["R"], r["E"]) == (32768, 128)
    assert r["bytes"] == rows_ops.op_bytes("sum", 4096, 2048, 8, 2)
    assert r["largest_bytes"] == 32768 * 2048 * 2
    assert r["alloc_bytes"] == rows_ops.alloc_bytes("sum", 4096, 2048, 8, 2)
    # order: per dtype, T, k, D, op
    first = [(r["dtype"], r["T"], r["k"], r["D"], r["op"]) for r in rows[:9]]
    assert first[:5] == [("bf16", 256, 1, 768, op) for op in rows_ops.OPS] + [
        ("bf16", 256, 1, 2048, "combine")
    ]


@pytest.mark.parametrize("max_gib", [0.25, 1.0, 3.0, 100.0])
def test_max_gib_skips_match_brute_force(max_gib):
    rows, skipped = rows_ops.plan_rows(max_gib=max_gib)
    want = _skips_by_hand(max_gib)
    assert len(skipped) == len(want)
    assert len(rows) == 4 * (96 - len(want))
    assert all(r["largest_bytes"] <= max_gib * 2**30 for r in rows)
    if max_gib == 100.0:
        assert skipped == [] and len(rows) == 384


def test_plan_options():
    # explicit lists apply to every dtype; op and dtype selection
    rows, skipped = rows_ops.plan_rows(
        ops=("gather",), dtypes=("fp32", "bf16"), dims=[768], topk=[2], tokens=[256, 4096]
    )
    assert [(r["dtype"], r["T"]) for r in rows] == [
        ("fp32", 256),
        ("fp32", 4096),
        ("bf16", 256),
        ("bf16", 4096),
    ]
    assert skipped == [] and {r["op"] for r in rows} == {"gather"}
    # fp16 alone by default: the subset
    rows, _ = rows_ops.plan_rows(dtypes=("fp16",))
    assert {r["D"] for r in rows} == {2048, 7168} and {r["k"] for r in rows} == {1, 8}
    assert {r["T"] for r in rows} == {4096, 65536}
    # --quick: the QUICK shapes of the chosen dtypes, each under 3 GiB
    rows, skipped = rows_ops.plan_rows(quick=True)
    assert skipped == [] and 5 <= len(rows) // 4 <= 15
    assert len(rows) == 4 * len(rows_ops.QUICK)
    rows, _ = rows_ops.plan_rows(dtypes=("fp32",), quick=True)
    assert {r["dtype"] for r in rows} == {"fp32"} and rows
    assert rows_ops.num_experts(8) == 128 and rows_ops.num_experts(200) == 200


# ---------------------------------------------------------------------- routing


@pytest.mark.parametrize("T,k", [(64, 1), (50, 4), (33, 16), (300, 8), (10, 130)])
def test_routing_indices(T, k):
    idx = rows_ops.routing_indices(T, k, seed=5)
    R, E = T * k, max(k, 128)
    assert idx.num_experts == E
    assert idx.src.dtype == torch.int32 and idx.src.shape == (R,)
    assert idx.inverse.dtype == torch.int32 and idx.inverse.shape == (T, k)
    ids = idx.expert_ids
    assert ids.shape == (T, k) and int(ids.min()) >= 0 and int(ids.max()) < E
    for row in ids.tolist():
        assert len(set(row)) == k  # k distinct experts per token
    # src[inverse[t, j]] == t for every (t, j)
    src, inv = idx.src.long(), idx.inverse.long()
    assert torch.equal(src[inv], torch.arange(T).view(T, 1).expand(T, k))
    # each routed row named once
    assert torch.equal(inv.flatten().sort().values, torch.arange(R))
    # rows in expert order, stably (within an expert by token, then slot)
    expert_of_row = torch.empty(R, dtype=torch.long)
    expert_of_row[inv.flatten()] = ids.flatten()
    assert bool((expert_of_row[1:] >= expert_of_row[:-1]).all())
    same = expert_of_row[1:] == expert_of_row[:-1]
    assert bool((src[1:][same] >= src[:-1][same]).all())


def test_routing_is_seeded_and_uniform():
    a = rows_ops.routing_indices(4096, 8, seed=1)
    b = rows_ops.routing_indices(4096, 8, seed=1)
    c = rows_ops.routing_indices(4096, 8, seed=2)
    assert all(torch.equal(u, v) for u, v in zip(a[:3], b[:3]))
    assert not torch.equal(a.expert_ids, c.expert_ids)
    # uniform over 128 experts: 256 copies each on average (binomial sd ~16)
    counts = torch.bincount(a.expert_ids.flatten(), minlength=128)
    assert int(counts.sum()) == 4096 * 8 and 150 < int(counts.min()) <= int(counts.max()) < 370


# ---------------------------------------------------------------------- the implementations


@pytest.mark.parametrize("dt", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("op", rows_ops.OPS)
def test_groupmm_and_torch_equivalents_agree_on_cpu(op, dt):
    T, D, k = 20, 24, 3
    idx = rows_ops.routing_indices(T, k, seed=4)
    gm, tc = rows_ops.build_op(op, T, D, k, rows_ops.DTYPES[dt], idx, "cpu", seed=1)
    got, want = gm(), tc()
    chk = rows_ops.check(op, dt, got, want)
    assert chk["ok"] is True, chk
    if op in rows_ops.EXACT:
        assert chk["how"] == "exact" and torch.equal(got, want)
    shape = (T, D) if op in ("combine", "sum") else (T * k, D)
    assert got.shape == want.shape == shape and want.dtype == rows_ops.DTYPES[dt]


def test_torch_equivalents_against_float64_loops():
    T, D, k = 9, 5, 4
    R = T * k
    idx = rows_ops.routing_indices(T, k, seed=6)
    inv, src = idx.inverse, idx.src
    torch.manual_seed(0)
    y = torch.randn(R, D, dtype=torch.float64)
    x = torch.randn(T, D, dtype=torch.float64)
    w = torch.rand(T, k, dtype=torch.float64)
    comb, sm = torch.zeros(T, D, dtype=torch.float64), torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            comb[t] += w[t, j] * y[int(inv[t, j])]
            sm[t] += y[int(inv[t, j])]
    scat = torch.zeros(R, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            scat[int(inv[t, j])] = x[t]
    gath = torch.stack([x[int(s)] for s in src])
    # torch_combine computes in float32 (.float()), the others keep float64
    assert torch.allclose(rows_ops.torch_combine(y, inv, w.float()), comb, rtol=1e-5, atol=1e-6)
    assert torch.allclose(rows_ops.torch_sum(y, inv), sm)
    assert torch.equal(rows_ops.torch_gather(x, src), gath)
    assert torch.equal(rows_ops.torch_scatter(x, inv, R), scat)


def test_check_flags_mismatches():
    a = torch.randn(16, 8, dtype=BF16)
    assert rows_ops.check("gather", "bf16", a, a.clone())["ok"] is True
    b = a.clone()
    b[3, 2] += 0.05  # one element: exact ops fail, the rel-err check passes
    c = rows_ops.check("scatter", "bf16", b, a)
    assert c["ok"] is False and c["how"] == "exact" and c["err"] > 0
    assert rows_ops.check("sum", "bf16", b, a)["ok"] is True
    bad = rows_ops.check("combine", "bf16", (a.float() * 1.1).to(BF16), a)
    assert bad["ok"] is False and bad["err"] == pytest.approx(0.1, rel=0.05)
    assert rows_ops.check("combine", "fp32", a.float() * (1 + 1e-4), a.float())["ok"] is False
    assert rows_ops.check("gather", "bf16", a[:4], a)["ok"] is False  # shape
    assert rows_ops.check("gather", "bf16", a.float(), a)["ok"] is False  # dtype


def test_rel_diff_in_slices(monkeypatch):
    torch.manual_seed(0)
    a, b = torch.randn(7, 5), torch.randn(7, 5)
    want = float((a - b).norm() / b.norm())
    assert report.rel_diff(a, b) == pytest.approx(want, rel=1e-6)
    monkeypatch.setattr(report, "_CHUNK", 6)  # one row of 5 at a time
    assert report.rel_diff(a, b) == pytest.approx(want, rel=1e-6)
    assert report.rel_diff(b, b) == 0.0
    assert report.rel_diff(a, torch.zeros_like(a)) == math.inf


# ---------------------------------------------------------------------- rows and rendering


def _timed(ms, rounds=3):
    """A round_robin result of a median ``ms`` (samples ms * 0.98, 1, 1.02)."""
    samples = [ms * f for f in (0.98, 1.0, 1.02)][:rounds]
    return {
        "ms": ms,
        "min": min(samples),
        "q1": samples[0],
        "q3": samples[-1],
        "max": max(samples),
        "samples": samples,
        "calls": 10,
        "host_ms": 0.01,
        "mode": "events",
        "warm_s": 0.0,
        "error": None,
    }


def _row(op="combine", dt="bf16", T=4096, D=2048, k=8, g=1.0, c=0.9, t=3.0, ok=True, err=1e-3):
    plan, _ = rows_ops.plan_rows(ops=(op,), dtypes=(dt,), dims=[D], topk=[k], tokens=[T])
    timed = {n: _timed(v) for n, v in (("groupmm", g), ("torch", t), ("copy", c)) if v}
    chk = {"ok": ok, "err": err, "how": "rel err < 0.01"}
    return rows_report.make_row(dict(plan[0], lead_ms=0.1), timed, chk)


def _doc(rows, **kw):
    doc = {
        "schema": "rows-1",
        "complete": True,
        "argv": ["--quick"],
        "started": "2025-01-01T00:00:00+00:00",
        "device": "NVIDIA H100 80GB HBM3",
        "capability": [9, 0],
        "l2_bytes": 50 * 2**20,
        "torch": "2.9.0",
        "cuda": "12.8",
        "groupmm": {"version": "0.1.0", "cuda": True},
        "timer": {"rounds": 3, "sample_ms": 5.0, "calls": None},
        "rows": rows,
        "skipped": [],
    }
    doc.update(kw)
    return doc


def test_make_row_figures():
    r = _row(g=2.0, c=1.8, t=5.0)
    assert r["gbps"]["groupmm"] == pytest.approx(r["bytes"] / 2e-3 / 1e9)
    assert r["gbps"]["copy"] == pytest.approx(r["bytes"] / 1.8e-3 / 1e9)
    assert r["gbps"]["torch"] == pytest.approx(r["bytes"] / 5e-3 / 1e9)
    assert r["frac_copy"] == pytest.approx(0.9)  # copy ms / groupmm ms
    assert r["speed_torch"] == pytest.approx(2.5)  # torch ms / groupmm ms
    # round by round: every round has the same ratio here
    assert r["paired"]["frac_copy"]["min"] == pytest.approx(0.9)
    assert r["paired"]["speed_torch"]["max"] == pytest.approx(2.5)
    assert r["ok"] is True and r["check_err"] == 1e-3 and r["errors"] == {}
    assert set(r["samples_ms"]) == set(rows_report.IMPLS)
    # groupmm failed in round_robin: no figure, the error kept, torch and copy still there
    plan, _ = rows_ops.plan_rows(
        ops=("gather",), dtypes=("bf16",), dims=[768], topk=[1], tokens=[256]
    )
    timed = {"groupmm": {"ms": None, "error": "RuntimeError: boom"}, "copy": _timed(0.5)}
    r = rows_report.make_row(plan[0], timed, None, {"torch": "RuntimeError: no"})
    assert r["frac_copy"] is None and r["speed_torch"] is None and r["ok"] is None
    assert r["errors"] == {"groupmm": "RuntimeError: boom", "torch": "RuntimeError: no"}
    assert r["gbps"]["copy"] and r["gbps"]["groupmm"] is None
    json.dumps(r)  # plain data


def test_summary_and_markdown_flag_rows_below_085():
    rows = [
        _row("combine", g=1.0, c=0.95),
        _row("combine", T=16384, g=1.0, c=0.70),  # below 0.85: flagged
        _row("gather", k=1, g=1.0, c=0.90, t=1.1),
        _row("scatter", g=1.0, c=0.86, ok=False, err=0.5),
    ]
    s = rows_report.summarize(rows)
    comb = s["ops"]["combine"]
    assert comb["n"] == 2 and comb["min"] == pytest.approx(0.70)
    assert comb["geomean"] == pytest.approx(math.sqrt(0.95 * 0.70))
    assert comb["min_row"] == "combine bf16 T=16384 D=2048 k=8"
    assert comb["below"] == ["combine bf16 T=16384 D=2048 k=8"]
    assert s["ops"]["gather"]["below"] == [] and "sum" not in s["ops"]
    assert s["mismatch"] == ["scatter bf16 T=4096 D=2048 k=8"]
    lines = rows_report.summary_lines(rows)
    assert lines[0] == (
        "combine: groupmm / copy min 0.70 (combine bf16 T=16384 D=2048 k=8), geomean 0.82, "
        "1 of 2 rows below 0.85; groupmm speed / torch geomean 3.00"
    )
    assert any(
        ln.startswith("gather: groupmm / copy min 0.90") and "0 of 1 rows" in ln for ln in lines
    )
    assert lines[-1].startswith("MISMATCH: groupmm differs from torch on 1 of 4 checked rows")

    md = rows_report.render_md(_doc(rows))
    assert md.startswith(
        "**device NVIDIA H100 80GB HBM3 (sm_90, L2 50 MiB); torch 2.9.0, CUDA 12.8**"
    )
    assert "groupmm build_info: version 0.1.0, cuda True" in md
    assert "python3 benches/bench_rows.py --quick\n" in md
    assert rows_report.TABLE_HEAD in md
    body = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(body) == 4
    # table order: by op, then dtype, T, D, k
    assert [ln.split(" | ")[0] for ln in body] == [
        "| combine",
        "| combine",
        "| gather",
        "| scatter",
    ]
    flagged_line = body[1]
    assert "| combine | bf16 | 16384 | 2048 | 8 |" in flagged_line
    assert "| **0.70** (0.70–0.70) |" in flagged_line
    assert "**" not in body[0] and "| 0.95 (0.95–0.95) |" in body[0]
    cells = body[0].strip("| ").split(" | ")
    assert len(cells) == 11
    r0 = rows[0]
    assert cells[5] == f"{r0['bytes'] / 1e6:.1f}"  # 151 MB: above the 50 MiB L2, no mark
    assert cells[6] == f"{r0['gbps']['groupmm']:.0f} ±2.0%"
    assert cells[10] == "3.00 (3.00–3.00)"
    assert " †" in body[2]  # gather T=4096 k=1 D=2048: 33.6 MB fit in L2
    assert "MISMATCH (groupmm's output differs from torch's):" in md
    assert "- scatter bf16 T=4096 D=2048 k=8: rel err < 0.01, error 5.00e-01" in md
    assert "1 of 2 rows below 0.85" in md
    # progress line
    line = rows_report.format_row(rows[1], _doc(rows))
    assert "groupmm / copy 0.70 (below 0.85)" in line and line.endswith("| ok")
    assert rows_report.format_row(rows[3]).endswith("| MISMATCH")
    assert "(in L2)" in rows_report.format_row(rows[2], _doc(rows))


def test_markdown_of_errors_skips_and_incomplete_runs():
    plan, _ = rows_ops.plan_rows(ops=("sum",), dtypes=("fp16",), dims=[768], topk=[2], tokens=[256])
    r = rows_report.make_row(plan[0], {"copy": _timed(0.1)}, None, {"groupmm": "RuntimeError: x"})
    doc = _doc([r], complete=False, skipped=[{"row": "bf16 T=65536 D=7168 k=16", "why": "big"}])
    md = rows_report.render_md(doc)
    assert "*(incomplete run: the rows measured so far)*" in md
    assert "- groupmm: RuntimeError: x (sum fp16 T=256 D=768 k=2)" in md
    assert "skipped: bf16 T=65536 D=7168 k=16 (big)" in md
    assert "| sum | fp16 | 256 | 768 | 2 |" in md and "| - | " in md
    # no rows at all renders
    assert rows_report.TABLE_HEAD in rows_report.render_md(_doc([]))


# ---------------------------------------------------------------------- --dry-run, --from-json


def test_dry_run_through_main(capsys):
    assert bench.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 344 + 10 + 1
    assert lines[0].startswith("combine bf16 T=256   D=768  k=1  R=256     E=128")
    assert sum(ln.startswith("skip ") for ln in lines) == 10
    assert "skip bf16 T=65536 D=7168 k=16: [R, D] is 14.00 GiB > --max-gib 3" in lines
    last = lines[-1]
    assert last.startswith("344 rows (10 shapes skipped by --max-gib; rows that do not fit")
    assert bench.main(["--dry-run", "--quick", "--ops", "gather,scatter", "--dtypes", "bf16"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    n = sum(1 for s in rows_ops.QUICK if s[0] == "bf16")
    assert len(out) == 2 * n + 1 and out[-1].startswith(f"{2 * n} rows (0 shapes skipped")
    assert bench.main(["--dry-run", "--max-gib", "100", "--rounds", "9"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("384 rows (0 shapes")
    args = bench.parse_args([])
    assert (args.rounds, args.max_gib, args.ops, args.dtypes) == (
        5,
        3.0,
        list(rows_ops.OPS),
        ["bf16", "fp16", "fp32"],
    )
    for bad in (["--ops", "copy"], ["--dtypes", "fp8"], ["--dims", "x"], ["--topk", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_from_json_merges_two_files(tmp_path, capsys):
    a = _doc(
        [_row("combine", c=0.9), _row("sum", c=0.5)],
        argv=["--ops", "combine,sum"],
        skipped=[
            {"row": "gather bf16 T=4096 D=2048 k=8", "why": "--budget-s 1 spent"},
            {"row": "bf16 T=65536 D=7168 k=16", "why": "[R, D] is 14.00 GiB > --max-gib 3"},
        ],
    )
    # b measures the gather a skipped and measures sum again (b's figure wins)
    b = _doc(
        [_row("gather", c=0.95), _row("sum", c=0.88)],
        argv=["--ops", "gather,sum"],
        complete=False,
        device="NVIDIA H200",
    )
    m = rows_report.merge_docs([a, b])
    assert [(r["op"], r["frac_copy"]) for r in m["rows"]] == [
        ("combine", pytest.approx(0.9)),
        ("sum", pytest.approx(0.88)),
        ("gather", pytest.approx(0.95)),
    ]
    assert m["skipped"] == [a["skipped"][1]]  # the gather was measured by b
    assert m["runs"] == [["--ops", "combine,sum"], ["--ops", "gather,sum"]]
    assert m["complete"] is False and m["merged_differ"] == ["device"]
    assert m["summary"]["ops"]["sum"]["below"] == []
    assert rows_report.merge_docs([a]) is a
    for name, d in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(d))
    files = f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}"
    out, md = tmp_path / "m.json", tmp_path / "m.md"
    assert bench.main(["--from-json", files, "--json", str(out), "--md", str(md)]) == 0
    merged = json.loads(out.read_text())
    assert len(merged["rows"]) == 3 and len(merged["runs"]) == 2
    text = md.read_text()
    assert text == rows_report.render_md(merged)
    assert "python3 benches/bench_rows.py --ops combine,sum\n" in text
    assert "python3 benches/bench_rows.py --ops gather,sum\n" in text
    assert "merged runs differ in: device" in text
    printed = capsys.readouterr().out
    assert rows_report.TABLE_HEAD in printed and "sum: groupmm / copy min 0.88" in printed
    # one file renders as it is
    assert bench.main(["--from-json", str(tmp_path / "a.json"), "--md", str(md)]) == 0
    assert "| **0.50** (0.50–0.50) |" in md.read_text()


# ---------------------------------------------------------------------- main() end to end


def _fake_cuda(monkeypatch, free=64 << 30):
    """CUDA's events, spin, device queries and memory counters, on the CPU: events read
    the wall clock."""

    Event = WallClockEvent

    for name, value in (
        ("Event", Event),
        ("_sleep", lambda cycles: None),
        ("synchronize", lambda *a, **k: None),
        ("is_available", lambda: True),
        ("get_device_name", lambda *a: "Fake GPU"),
        ("get_device_capability", lambda *a: (9, 0)),
        ("current_device", lambda: 0),
        ("get_device_properties", lambda *a: types.SimpleNamespace(L2_cache_size=50 << 20)),
        ("empty_cache", lambda: None),
        ("mem_get_info", lambda *a: (free, 80 << 30)),
    ):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(timing, "_CYCLES_PER_MS", 1e6)
    monkeypatch.setattr(bench, "DEV", "cpu")


TINY = ["--dims", "64,48", "--topk", "1,3", "--tokens", "16", "--dtypes", "bf16,fp32"]
FAST = ["--rounds", "2", "--max-calls", "2", "--min-calls", "1", "--warmup", "1"]


def test_main_end_to_end_on_a_fake_gpu(monkeypatch, tmp_path, capsys):
    _fake_cuda(monkeypatch)
    written = []
    real_write = bench.write_outputs

    def write(doc, args):
        written.append(len(doc["rows"]))
        real_write(doc, args)

    monkeypatch.setattr(bench, "write_outputs", write)
    out = tmp_path / "r"
    argv = TINY + FAST + ["--json", f"{out}.json", "--md", f"{out}.md"]
    assert bench.main(argv) == 0
    n = 2 * 2 * 2 * 4  # dtypes x D x k x ops
    assert written == list(range(1, n + 1)) + [n]  # after every row, then at the end
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["complete"] and doc["device"] == "Fake GPU" and doc["capability"] == [9, 0]
    assert doc["torch"] == torch.__version__ and doc["l2_bytes"] == 50 << 20
    assert doc["groupmm"]["version"] and doc["argv"] == argv and doc["started"]
    assert doc["timer"]["rounds"] == 2 and doc["skipped"] == []
    assert len(doc["rows"]) == n
    for r in doc["rows"]:
        assert r["ok"] is True, (rows_ops.label(r), r["check_how"], r["check_err"])
        assert all(r["ms"][k] for k in rows_report.IMPLS), r["errors"]
        assert len(r["samples_ms"]["groupmm"]) == 2
        assert r["frac_copy"] == pytest.approx(r["ms"]["copy"] / r["ms"]["groupmm"])
        assert r["check_how"] == (
            "exact"
            if r["op"] in rows_ops.EXACT
            else "rel err < " + {"bf16": "0.01", "fp32": "1e-05"}[r["dtype"]]
        )
    md = (tmp_path / "r.md").read_text()
    assert "device Fake GPU (sm_90, L2 50 MiB)" in md and rows_report.TABLE_HEAD in md
    assert f"check: groupmm equals torch's equivalent on all {n} rows" in md
    printed = capsys.readouterr().out
    assert f"[{n:3}/{n}" in printed and "MISMATCH" not in printed
    assert rows_report.TABLE_HEAD in printed and "scatter: groupmm / copy min" in printed

    # a spent budget: no row starts, each listed as skipped, the files still written
    assert bench.main(argv + ["--budget-s", "1e-9"]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rows"] == [] and len(doc["skipped"]) == n
    assert doc["skipped"][0] == {
        "row": "combine bf16 T=16 D=64 k=1",
        "why": "--budget-s 1e-09 spent",
    }


def test_main_reports_a_mismatch_loudly(monkeypatch, tmp_path, capsys):
    _fake_cuda(monkeypatch)

    def wrong_gather(x, src):
        return x.index_select(0, src.flip(0))

    monkeypatch.setattr(rows_ops, "torch_gather", wrong_gather)
    out = tmp_path / "r.json"
    argv = ["--dims", "32", "--topk", "2", "--tokens", "16", "--dtypes", "bf16"] + FAST
    assert bench.main(argv + ["--ops", "gather,sum", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ok = {r["op"]: r["ok"] for r in doc["rows"]}
    assert ok == {"gather": False, "sum": True}
    captured = capsys.readouterr()
    assert "!!! MISMATCH gather bf16 T=16 D=32 k=2" in captured.out
    assert "!!! MISMATCH gather bf16 T=16 D=32 k=2" in captured.err
    assert "MISMATCH: groupmm differs from torch on 1 of 2 checked rows" in captured.out


def test_main_skips_rows_that_do_not_fit_free_memory(monkeypatch, tmp_path, capsys):
    _fake_cuda(monkeypatch, free=300 << 20)  # below the 256 MiB margin plus any row
    out = tmp_path / "r.json"
    argv = ["--dims", "4096", "--topk", "8", "--tokens", "4096", "--dtypes", "bf16"] + FAST
    assert bench.main(argv + ["--ops", "combine,gather", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and [s["row"] for s in doc["skipped"]] == [
        "combine bf16 T=4096 D=4096 k=8",
        "gather bf16 T=4096 D=4096 k=8",
    ]
    assert "GiB free" in doc["skipped"][0]["why"] and "skip combine" in capsys.readouterr().out


def test_main_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--quick"]) == 2
    assert "no CUDA device" in capsys.readouterr().out
