"""Summary of Nsight Compute profiles of the layer's kernels at R = 1 (one H200).

Reads, from DIR, what these commands wrote (ncu_layer.py's docstring has the profile's command):
  details.csv / sass.csv: `ncu -i prof.ncu-rep --page details --csv` and `--page source --csv
      --print-source sass` of `moe_ffn(fused=True)` forward (gather + GEMM, GEMM + combine)
  details_ec.csv / sass_ec.csv: the same of `--only "expert compute alone"` (its two CUTLASS
      grouped GEMMs, `-k regex:device_kernel`)
and prints per kernel its headline metrics, its warps' stall reasons (PC samples), its
mainloop's k-block iterations (the most executed HGMMA), and for the GEMM + combine the
combine's instructions per task in each of its two code copies (combine-only blocks, tile
blocks' consumer warps), at the address ranges given by --ranges (this build's, low 20 bits).

  python docs/results/2026-12-02-ncu-summary.py DIR [--ranges 0xe000-0x15000,0x28000-0x2e800]
"""
import argparse
import csv
import io
import os
from collections import Counter

METRICS = ("Duration", "SM Frequency", "Compute (SM) Throughput", "L2 Cache Throughput",
           "DRAM Throughput", "L2 Hit Rate", "L1/TEX Hit Rate")


def kernels(path):
    """[(name, rows)] of a --page source --csv --print-source sass export."""
    lines = open(path).read().split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')]
    out = []
    for k, s in enumerate(starts):
        e = starts[k + 1] if k + 1 < len(starts) else len(lines)
        name = next(csv.reader([lines[s]]))[1]
        out.append((name, list(csv.DictReader(io.StringIO("\n".join(lines[s + 1:e]))))))
    return out


def n(r, col):
    v = r.get(col) or "0"
    return int(v) if v.strip("-") else 0


def op(r):
    words = [w for w in r["Source"].split() if not w.startswith("@")]
    return words[0] if words else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--ranges", default="0xe000-0x15000,0x28000-0x2e800",
                    help="address ranges (low 20 bits) of the combine's two code copies: "
                         "combine-only blocks, tile blocks' consumer warps")
    args = ap.parse_args()
    ranges = [tuple(int(x, 16) for x in r.split("-")) for r in args.ranges.split(",")]
    for tag in ("", "_ec"):
        det = list(csv.DictReader(open(os.path.join(args.dir, f"details{tag}.csv"))))
        by_id = {}
        for r in det:
            if r["Metric Name"] in METRICS:
                by_id.setdefault(r["ID"], {})[r["Metric Name"]] = (r["Metric Value"],
                                                                   r["Metric Unit"])
        for (kid, m), (name, rows) in zip(sorted(by_id.items()),
                                          kernels(os.path.join(args.dir, f"sass{tag}.csv"))):
            short = name.split("(")[0].split("::")[-1][:40]
            print(f"\n== {short}")
            print("  " + ", ".join(f"{k} {v} {u}".strip() for k, (v, u) in m.items()))
            stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
            total = sum(n(r, "Warp Stall Sampling (All Samples)") for r in rows)
            agg = Counter({s[6:]: sum(n(r, s) for r in rows) for s in stalls})
            print(f"  PC samples {total}: " + ", ".join(
                f"{s} {100 * v / total:.1f} %" for s, v in agg.most_common(8)))
            hg = [r for r in rows if op(r).startswith("HGMMA")]
            if hg:
                print(f"  mainloop k-block iterations (warp-level, the most executed HGMMA): "
                      f"{max(n(r, 'Instructions Executed') for r in hg)}")
            if "gemm_combine" not in name:
                continue
            # the combine: a task per execution of its first traced mark (ATOMG.E.MAX.64)
            for (lo, hi), who in zip(ranges, ("combine-only blocks",
                                             "tile blocks' consumer warps")):
                sel = [r for r in rows if lo <= (int(r["Address"], 16) & 0xFFFFF) < hi]
                marks = [r for r in sel if op(r).startswith("ATOMG.E.MAX.64")
                         and n(r, "Instructions Executed") > 0]
                if not marks:
                    continue
                tasks = n(marks[0], "Instructions Executed")
                inst = sum(n(r, "Instructions Executed") for r in sel)
                cctl = sum(n(r, "Instructions Executed") for r in sel if op(r) == "CCTL.IVALL")
                mix = Counter()
                for r in sel:
                    mix[op(r).split(".")[0]] += n(r, "Instructions Executed")
                print(f"  combine, {who}: {tasks} tasks, {inst / max(tasks, 1):.0f} warp "
                      f"instructions a task, {cctl} L1 invalidations (CCTL.IVALL), mix: " +
                      ", ".join(f"{k} {v / max(tasks, 1):.0f}" for k, v in mix.most_common(10)))


if __name__ == "__main__":
    main()
