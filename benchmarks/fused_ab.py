"""An A/B of the fused halves' Python between two checkouts, in one process: `moe_ffn` with the
installed `jax_ep.fused` against the same layer with another checkout's `jax_ep/fused.py`
(e.g. the last commit's: `git show HEAD:jax_ep/fused.py > /tmp/fused_base.py`) swapped in
for the layer's two fused halves (their forward and custom-VJP rules; the kernels are the
installed ones). Forward and forward + backward, timed in paired rounds (each variant in turn,
so that clock drift weighs alike), and the memory XLA plans for the step.

  python benchmarks/fused_ab.py --baseline /tmp/fused_base.py --ranks 2,1 --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

import numpy as np

import jax
from jax.sharding import Mesh

import jax_ep
from jax_ep import moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import (add_shape_args, layer_inputs, step_bytes, topk_routing,  # noqa: E402
                         with_backward)
from harness import op_timer, paired, rank_map, scan_fn  # noqa: E402


def load_baseline(path):
    """The module of another checkout's fused.py (importing the installed jax_ep)."""
    spec = importlib.util.spec_from_file_location("jax_ep._fused_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def halves(mod):
    """moe_ffn traced with mod's fused halves (None: the installed ones)."""
    saved = moe.dispatch_matmul_swiglu, moe.matmul_combine
    if mod is not None:
        moe.dispatch_matmul_swiglu, moe.matmul_combine = (mod.dispatch_matmul_swiglu,
                                                          mod.matmul_combine)
    try:
        yield
    finally:
        moe.dispatch_matmul_swiglu, moe.matmul_combine = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="another checkout's jax_ep/fused.py")
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="2,1")
    add_shape_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scan", default="2,6", help="n_short,n_long calls of the timed scans")
    args = ap.parse_args()
    T, H, I, L, K = args.tokens, args.hidden, args.inter, args.experts, args.topk
    n_short, n_long = (int(v) for v in args.scan.split(","))
    variants = {"installed": None, "baseline": load_baseline(args.baseline)}
    devs = jax.devices()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    print(f"device: {devs[0].device_kind} x {len(devs)}, jax {jax.__version__}, "
          f"baseline {args.baseline}")
    rows = []
    for R in (int(r) for r in args.ranks.split(",")):
        if R > len(devs):
            continue
        mesh = Mesh(np.array(devs[:R]), ("ep",))
        E = R * L
        wgu, wd, x, _ = layer_inputs(R, mesh, R, T, H, I, L, K)
        w, idx = topk_routing(rng.standard_normal((R * T, E)), K)
        lay = (x, idx, w, wgu, wd)

        def layer(*a):
            return jax_ep.moe_ffn(*a, num_experts=E)
        timers, outs, mem = {}, {}, {}
        for name, mod in variants.items():
            with halves(mod):
                outs[name] = np.asarray(rank_map(mesh, layer)(*lay), np.float32)
                for op, f in (("fwd", layer), ("fwd+bwd", with_backward(layer, (0, 2, 3, 4)))):
                    timers[name, op] = op_timer(f, lay, n_short, n_long, reps=1, mesh=mesh)
                # (one call in the harness's scan: bench_layer.py's step figure)
                mem[name] = step_bytes(scan_fn(mesh, with_backward(layer, (0, 2, 3, 4)), 1)
                                       .lower(*lay).compile())[0]
        times = {key: [t * 1e3 for t in ts] for key, ts in paired(timers, args.rounds).items()}
        print(f"\n== R={R} T={T} H={H} I={I} L={L} K={K} uniform, default arguments: ms per call, "
              f"median of {args.rounds} paired rounds; step memory XLA plans")
        for name in variants:
            row = dict(ranks=R, name=name, step_bytes=mem[name],
                       rel_diff_vs_installed=float(
                           np.linalg.norm(outs[name] - outs["installed"])
                           / max(np.linalg.norm(outs["installed"]), 1e-30)))
            for op in ("fwd", "fwd+bwd"):
                row[op + "_ms"] = float(np.median(times[name, op]))
                row[op + "_rounds"] = times[name, op]
            rows.append(row)
            print(f"  {name:<10} fwd {row['fwd_ms']:7.3f}  fwd+bwd {row['fwd+bwd_ms']:7.3f}  "
                  f"step {mem[name] / 1e9:.2f} GB  diff {row['rel_diff_vs_installed']:.1e}")
    with open(os.path.join(args.out, "fused_ab.json"), "w") as f:
        json.dump(dict(device=devs[0].device_kind, baseline=args.baseline, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
