"""The activation in the first GEMM's epilogue against an XLA pass after it, in one run.

For each R in --ranks (skipped when there are fewer devices), on an ("ep",) mesh over the
first R devices, with bench_layer.py's shapes and uniform routing at moe_ffn's default
capacity, times (slope of jit-compiled scans of 1 and 3 calls, median of --reps) the layer's
first half (`fused.dispatch_matmul` then swiglu as an XLA pass, against
`fused.dispatch_matmul_swiglu`, swiglu in the epilogue) and the whole fused layer both ways,
and prints the relative difference of the two layers' outputs. Writes fused_activation.json.

  python benchmarks/fused_activation.py --ranks 2,1 --out DIR
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/fused_activation.py \
      --backend reference --ranks 2 --tokens 8 --hidden 128 --inter 128 --experts 2 --topk 2 \
      --reps 1 --out DIR   (checks the script on a CPU: no epilogue there)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import jax
from jax.sharding import Mesh, PartitionSpec as P

import jax_ep
from jax_ep import _common, fused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer as bl  # noqa: E402
from harness import scan_fn, time_slope  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    bl.add_shape_args(ap)
    ap.add_argument("--backend", default="cuda", help="'reference' checks the script on a CPU")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    T, H, I, L, K, be = (args.tokens, args.hidden, args.inter, args.experts, args.topk,
                         args.backend)
    devs = jax.devices()
    os.makedirs(args.out, exist_ok=True)
    print("device:", devs[0].device_kind, "backend", be)
    if be != "cuda":
        print("(reference backend: no epilogue, both variants run the activation as XLA ops)")
    rows = []
    for R in (int(r) for r in args.ranks.split(",")):
        if R > len(devs):
            print(f"R={R}: skipped, {len(devs)} devices")
            continue
        mesh = Mesh(np.array(devs[:R]), ("ep",))
        E = R * L
        wgu, wd, x, _ = bl.layer_inputs(R, mesh, R, T, H, I, L, K)
        w, idx = bl.topk_routing(np.random.default_rng(0).standard_normal((R * T, E)), K)
        cap = jax_ep.moe_capacity(T, num_experts=E, num_topk=K, num_ranks=R, backend=be)
        run = dict(num_experts=E, capacity=cap, backend=be)

        def first_xla(x, idx, w, wgu, wd):
            _, h = fused.dispatch_matmul(x, idx, w, wgu, **run)
            return _common.swiglu(h).astype(x.dtype)

        def first_epilogue(x, idx, w, wgu, wd):
            return fused.dispatch_matmul_swiglu(x, idx, w, wgu, **run)[1]

        def layer_xla(x, idx, w, wgu, wd):
            res, h = fused.dispatch_matmul(x, idx, w, wgu, **run)
            return fused.matmul_combine(_common.swiglu(h).astype(x.dtype), wd, res, backend=be)

        def layer_epilogue(x, idx, w, wgu, wd):
            res, a = fused.dispatch_matmul_swiglu(x, idx, w, wgu, **run)
            return fused.matmul_combine(a, wd, res, backend=be)
        fargs = (x, idx, w, wgu, wd)
        for name, f in (("first half, XLA swiglu", first_xla),
                        ("first half, epilogue swiglu", first_epilogue),
                        ("layer, XLA swiglu", layer_xla),
                        ("layer, epilogue swiglu", layer_epilogue)):
            fs = scan_fn(mesh, f, 1).lower(*fargs).compile()
            fl = scan_fn(mesh, f, 3).lower(*fargs).compile()
            med, lo, hi, _ = time_slope(fs, fl, 1, 3, fargs, args.reps)
            rows.append(dict(ranks=R, name=name, ms=med * 1e3, ms_range=[lo * 1e3, hi * 1e3]))
            print(f"R={R} {name:30s} {med * 1e3:7.3f} ms  [{lo * 1e3:.3f}, {hi * 1e3:.3f}]",
                  flush=True)
            del fs, fl
        outs = [np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("ep"),
                                                 out_specs=P("ep")))(*fargs), np.float32)
                for f in (layer_xla, layer_epilogue)]
        diff = float(np.linalg.norm(outs[0] - outs[1]) / max(np.linalg.norm(outs[0]), 1e-30))
        rows.append(dict(ranks=R, name="layer outputs, relative difference", value=diff))
        print(f"R={R} layer outputs: rel diff {diff:.2e}")
    with open(os.path.join(args.out, "fused_activation.json"), "w") as f:
        json.dump(dict(device=devs[0].device_kind, backend=be, rows=rows), f, indent=1)
    print("wrote", os.path.join(args.out, "fused_activation.json"))


if __name__ == "__main__":
    main()
