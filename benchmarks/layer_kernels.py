"""Where the layer's time goes: the GPU kernels of one `moe_ffn` call against those of its expert
compute alone, from a jax.profiler trace (benchmarks/kernel_times.py reads it).

For each R in --ranks and each variant (moe_ffn fused=False / fused=True, the expert compute
alone), forward and forward + backward: a jit-compiled scan of --calls calls after warm-up,
traced once; per kernel name the count and microseconds per call on the first GPU, longest
first, and the sum. Shapes as benchmarks/bench_layer.py; routing uniform (softmax top-k of random
logits) or, with --routing balanced, every expert exactly T * K / L pairs (bench_layer's
balanced routing: the expert compute's equal groups). With --timeline, also the events of one
call's period on the first GPU (from one start of the kernel that runs once a call to the next)
in start order, each with the time the GPU had no kernel before it (the drain of a host read, a
chain of short kernels launched one by one). Writes layer_kernels.json.

  python benchmarks/layer_kernels.py --ranks 1,2 --out DIR
  python benchmarks/layer_kernels.py --ranks 2 --only "moe_ffn(fused=True)" --timeline
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/layer_kernels.py \
      --backend reference --ranks 2 --tokens 16 --hidden 64 --inter 32 --experts 2 --topk 2
      (checks the script on a CPU: no kernels to list)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

import numpy as np

import jax
from jax.sharding import Mesh

import jax_ep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_times  # noqa: E402
from bench_layer import (add_shape_args, draw_routing, expert_compute,  # noqa: E402
                         layer_inputs, with_backward)
from harness import scan_fn  # noqa: E402


def print_timeline(t, trace):
    """The lines of one call's timeline (kernel_times.call_timeline, one GPU), then what the
    host did in its longest gap."""
    if t is None:
        print("  timeline: no kernel occurs once per call; not split")
        return
    print(f"  timeline, from one start of {t['anchor'][:60]} to the next: {t['period_us']:.1f} "
          f"us, kernels busy {t['busy_us']:.1f}, no kernel {t['idle_us']:.1f}\n"
          "      start      dur      gap  event")
    for start, dur, gap, name in t["events"]:
        print(f"  {start:9.1f} {dur:8.1f} {gap:8.1f}  {name[:90]}")
    start, _, gap, name = max(t["events"], key=lambda e: e[2])
    if gap > 0:
        t1 = t["t0"] + start
        print(f"  the host's events of at least 5 us in the longest gap ({gap:.1f} us, before "
              f"{name[:40]}), start from the gap's start:")
        for hs, hd, thread, hname in kernel_times.host_events(trace, t1 - gap, t1):
            print(f"  {hs:9.1f} {hd:8.1f}  [{thread[:20]}] {hname[:80]}")


def layer_variants(E, lay, ec_args, backend):
    """{name: (fn, its arguments, the argnums of its gradient)} of the layer's variants: `lay` =
    (x, idx, w, w_gate_up, w_down) for moe_ffn, `ec_args` = (rows, w, w_gate_up, w_down) for the
    expert compute alone, E experts in all."""
    return {
        "moe_ffn(fused=False)": (lambda *a: jax_ep.moe_ffn(*a, num_experts=E, fused=False,
                                                           backend=backend), lay, (0, 2, 3, 4)),
        "moe_ffn(fused=True)": (lambda *a: jax_ep.moe_ffn(*a, num_experts=E, fused=True,
                                                          backend=backend), lay, (0, 2, 3, 4)),
        "expert compute alone": (functools.partial(expert_compute, backend=backend), ec_args,
                                 (0, 1, 2, 3)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", default="1,2")
    add_shape_args(ap)
    ap.add_argument("--calls", type=int, default=3, help="calls in the traced scan")
    ap.add_argument("--top", type=int, default=30, help="kernels printed per variant")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--routing", default="uniform", choices=("uniform", "balanced"))
    ap.add_argument("--only", default="",
                    help="comma-separated variants to trace (default every one)")
    ap.add_argument("--timeline", action="store_true",
                    help="also print one call's period of events on the first GPU in start "
                         "order, with the time the GPU had no kernel before each")
    args = ap.parse_args()
    T, H, I, L, K = args.tokens, args.hidden, args.inter, args.experts, args.topk
    be = args.backend
    devs = jax.devices()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    print(f"device: {devs[0].device_kind} x {len(devs)}, jax {jax.__version__}, "
          f"{args.routing} routing")
    out = []
    for R in (int(r) for r in args.ranks.split(",")):
        if R > len(devs):
            continue
        mesh = Mesh(np.array(devs[:R]), ("ep",))
        E = R * L
        wgu, wd, x, xr = layer_inputs(R, mesh, R, T, H, I, L, K)
        w, idx = draw_routing(rng, args.routing, R * T, E, K)
        variants = layer_variants(E, (x, idx, w, wgu, wd), (xr, w, wgu, wd), be)
        only = [v for v in args.only.split(",") if v]
        unknown = sorted(set(only) - set(variants))
        if unknown:
            raise SystemExit(f"--only: unknown variants {unknown}; expected some of "
                             f"{sorted(variants)}")
        for name, (fn, fargs, diff) in variants.items():
            if only and name not in only:
                continue
            for op, f in (("fwd", fn), ("fwd+bwd", with_backward(fn, diff))):
                try:
                    c = scan_fn(mesh, f, args.calls).lower(*fargs).compile()
                    for _ in range(2):
                        jax.block_until_ready(c(*fargs))
                    with tempfile.TemporaryDirectory() as d:
                        trace = kernel_times.trace_run(functools.partial(c, *fargs), d)
                    res = kernel_times.kernel_durations(trace, ".", args.calls)
                    timeline = (kernel_times.call_timeline(trace, args.calls)
                                if args.timeline else {})
                except Exception as e:  # reported, the others still run
                    print(f"\n== R={R} {name} {op}: FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}")
                    continue
                if not res["devices"]:
                    print(f"\n== R={R} {name} {op}: no GPU kernels in the trace (a CPU run)")
                    out.append(dict(ranks=R, name=name, op=op, device=None, total_us=None,
                                    kernels={}))
                    continue
                dev, d = sorted(res["devices"].items())[0]
                ks = sorted(d["kernels"].items(), key=lambda kv: -kv[1]["us_per_call"])
                total = sum(v["us_per_call"] for _, v in ks)
                print(f"\n== R={R} {name} {op}: {total:.0f} us of kernels per call on {dev} "
                      f"({len(ks)} kernel names)")
                for kname, v in ks[:args.top]:
                    print(f"  {v['us_per_call']:9.1f} us  {v['count'] / args.calls:5.1f} x  "
                          f"{kname[:110]}")
                row = dict(ranks=R, name=name, op=op, device=dev, total_us=total,
                           kernels={k: v for k, v in ks})
                if args.timeline:
                    print_timeline(timeline.get(dev), trace)
                    row["timeline"] = timeline.get(dev)
                out.append(row)
                jax.clear_caches()
    with open(os.path.join(args.out, "layer_kernels.json"), "w") as f:
        json.dump(dict(device=devs[0].device_kind, routing=args.routing, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
