"""One layer variant's calls with nothing else on the GPU: the program to run under Nsight Compute.

Compiles a variant of benchmarks/layer_kernels.py (its shapes, inputs and kind of routing, drawn
from a generator of its own) as a scan of --calls calls, forward or forward + backward, and runs
it --runs times, no profiler of its own (a jax.profiler trace and Nsight Compute would both want
the GPU's counters); writes each run's wall time to ncu_layer.json in --out (not a benchmark: a
profiler slows the runs). Nsight Compute picks the launches to profile. At R = 1 each forward
call of `moe_ffn(fused=True)` launches the gather + GEMM, then the GEMM + combine, so skipping
2 * calls launches of those two skips the first run; the expert compute launches its two
CUTLASS GEMMs (`device_kernel`) a call. The backward launches both fused kernels again, and
over R GPUs each GPU launches its own: count those launches too, or profile one GPU
(`--devices 0`).

  ncu --clock-control none -k 'regex:gather_gemm_kernel|gemm_combine_kernel' \\
      --launch-skip 6 --launch-count 2 --set full --import-source no -o prof \\
      python benchmarks/ncu_layer.py --ranks 1 --only "moe_ffn(fused=True)"
  ncu --clock-control none -k 'regex:device_kernel' --launch-skip 6 --launch-count 2 \\
      --set full --import-source no -o prof_ec \\
      python benchmarks/ncu_layer.py --ranks 1 --only "expert compute alone"
  ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import jax
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import add_shape_args, draw_routing, layer_inputs, with_backward  # noqa: E402
from harness import scan_fn  # noqa: E402
from layer_kernels import layer_variants  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", type=int, default=1)
    add_shape_args(ap)
    ap.add_argument("--calls", type=int, default=3, help="calls in the scan")
    ap.add_argument("--runs", type=int, default=3, help="runs of the compiled scan")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--routing", default="uniform", choices=("uniform", "balanced"))
    ap.add_argument("--op", default="fwd", choices=("fwd", "fwd+bwd"))
    ap.add_argument("--only", default="moe_ffn(fused=True)",
                    choices=("moe_ffn(fused=True)", "moe_ffn(fused=False)",
                             "expert compute alone"))
    args = ap.parse_args()
    T, H, I, L, K, R = args.tokens, args.hidden, args.inter, args.experts, args.topk, args.ranks
    devs = jax.devices()
    if R > len(devs):
        raise SystemExit(f"--ranks: {R} ranks need {R} GPUs; this machine has {len(devs)}")
    mesh = Mesh(np.array(devs[:R]), ("ep",))
    E = R * L
    wgu, wd, x, xr = layer_inputs(R, mesh, R, T, H, I, L, K)
    w, idx = draw_routing(np.random.default_rng(0), args.routing, R * T, E, K)
    fn, fargs, diff = layer_variants(E, (x, idx, w, wgu, wd), (xr, w, wgu, wd),
                                     args.backend)[args.only]
    f = fn if args.op == "fwd" else with_backward(fn, diff)
    c = scan_fn(mesh, f, args.calls).lower(*fargs).compile()
    run_s = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        jax.block_until_ready(c(*fargs))
        run_s.append(time.perf_counter() - t0)
    print(f"{args.only} {args.op}, R = {R}: {args.runs} runs of {args.calls} calls")
    os.makedirs(args.out, exist_ok=True)
    row = dict(variant=args.only, op=args.op, ranks=R, calls=args.calls, routing=args.routing,
               device=devs[0].device_kind, run_s=run_s)
    with open(os.path.join(args.out, "ncu_layer.json"), "w") as f:
        json.dump({"rows": [row]}, f, indent=1)


if __name__ == "__main__":
    main()
