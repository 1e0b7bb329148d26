"""Issue 28, per short row: where the fused layer's step trails SonicMoE's, from the
layer table (bench_moe.py JSON) and the same-process kernel profile (profile_moe.py JSON).

    python3 benches/results/issue28_short_rows.py LAYER.json PROFILE.json[,PROFILE2.json] > OUT.md

Per config x T row whose fused/SonicMoE speed is below 1.0: the gap of kernel time split
into the DGated GEMM (groupmm's DgatedEpi kernel against quack's GemmDGated), the other
GEMMs, row kernels, routing and elementwise kernels. No GPU.
"""

import json
import sys

CATS = ("rows", "routing", "elementwise")


def kernel_ms(row, needle):
    kernels = row["kernels"]
    return sum(k["ms"] for k in kernels if k.get("category") == "gemm" and needle in k["name"])


def main() -> None:
    layer = json.load(open(sys.argv[1]))
    prof = {}
    for path in sys.argv[2].split(","):
        for r in json.load(open(path))["rows"]:
            prof[(r["config"], r["tokens"], r["impl"])] = r
    print(
        "| config | T | fused / SonicMoE | kernel gap ms | DGated (ours vs quack) | other GEMMs "
        "| rows | routing | elementwise |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for row in layer["rows"]:
        ratio = row["speed"]["sonicmoe"]
        if ratio >= 1.0:
            continue
        f = prof.get((row["config"], row["T"], "fused"))
        s = prof.get((row["config"], row["T"], "sonicmoe"))
        if f is None or s is None:
            print(f"| {row['config']} | {row['T']} | {ratio:.2f} | not profiled | | | | | |")
            continue
        dg_f, dg_s = kernel_ms(f, "DgatedEpi"), kernel_ms(s, "GemmDGated")
        bf, bs = f["by_category"], s["by_category"]
        gemm_rest = (bf["gemm"] - dg_f) - (bs["gemm"] - dg_s)
        cells = [f"{bf[c] - bs[c]:+.3f}" for c in CATS]
        gap = f["total_ms"] - s["total_ms"]
        dg = f"{dg_f:.3f} vs {dg_s:.3f} ({dg_f - dg_s:+.3f})"
        print(
            f"| {row['config']} | {row['T']} | {ratio:.2f} | {gap:+.3f} | {dg} "
            + f"| {gemm_rest:+.3f} | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    main()
