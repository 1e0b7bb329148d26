"""The performance table (README, docs/performance.md) (markdown) from a `bench_gpu.py --json` file.

    python3 benches/md_table.py benches/results/h200_bf16_gemm_vs_torch_quack.json \\
        [--vs other_dtype.json]

--vs adds a column with this file's groupmm TFLOP/s over the other file's (e.g. fp16
over bf16 measured on the same machine).
"""

import argparse
import json

from harness.report import fmt
from harness.report.gpu import summary


def main():
    p = argparse.ArgumentParser()
    p.add_argument("json")
    p.add_argument("--vs")
    args = p.parse_args()
    data = json.load(open(args.json))
    other = None
    if args.vs:
        o = json.load(open(args.vs))
        other = {(r["shape"], r["routing"], r["pass"]): r["tflops"]["groupmm"] for r in o["rows"]}
    head = "| shape (E, K, N, T) | routing | pass | groupmm | F.grouped_mm | quack | loop of mm "
    head += "| dense mm | vs torch | vs quack | of roofline |" + (" vs other |" if other else "")
    print(head)
    print("| --- | --- | --- |" + " ---: |" * (9 if other else 8))
    for r in data["rows"]:
        t = r["tflops"]
        vt = t["groupmm"] / t["torch"] if t["groupmm"] and t["torch"] else None
        vq = t["groupmm"] / t["quack"] if t["groupmm"] and t.get("quack") else None
        shape = f"{r['shape']} ({r['E']}, {r['K']}, {r['N']}, {r['T']})"
        cells = [shape, r["routing"], r["pass"], fmt(t["groupmm"], ".0f"), fmt(t["torch"], ".0f")]
        cells += [fmt(t.get("quack"), ".0f"), fmt(t["loop"], ".0f"), fmt(t["dense"], ".0f")]
        cells += [fmt(vt, ".2f"), fmt(vq, ".2f"), fmt(r.get("roofline"), ".2f")]
        if other:
            key = (r["shape"], r["routing"], r["pass"])
            vo = t["groupmm"] / other[key] if t["groupmm"] and other.get(key) else None
            cells.append(fmt(vo, ".2f"))
        print("| " + " | ".join(cells) + " |")

    print("\n" + summary(data["rows"]))
    host = data.get("host_us", {})
    print("host µs per small packed call: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))


if __name__ == "__main__":
    main()
