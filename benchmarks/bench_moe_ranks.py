"""MoE layer benchmark over R GPUs: fused and unfused moe_ffn against communication and GEMMs.

The fused layer hides its token traffic behind the expert GEMMs when its forward stays close to
the larger of the two alone. Per rank: T tokens, hidden H, intermediate I, L experts (E = R * L),
top-K, bf16, uniform routing. In one run, after warm-up, median over repetitions, each figure the
slope between a jit-compiled scan of 2 calls and one of 8 (benchmarks/harness.py):
- moe_ffn forward, fused=False and fused=True (and with each --copy-blocks and
  --combine-blocks value);
- the time split: the first half (dispatch + gate/up GEMM) alone, unfused and fused, and the
  layer with only its first half fused, so that each half's fused / unfused shows;
- communication alone: dispatch and the combine of its rows (the token traffic, no GEMMs);
- GEMMs alone: the two grouped GEMMs on the rows a rank receives.
Prints a table and fused / max(communication, GEMMs), writes bench_moe_ranks.json and a plot.

  python benchmarks/bench_moe_ranks.py --ranks 4 --out DIR
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python benchmarks/bench_moe_ranks.py --ranks 4 --backend reference --tokens 16 \
      --hidden 256 --inter 128 --experts 2 --topk 2 --reps 1 --out DIR
      (checks the script on a CPU)
  python benchmarks/bench_moe_ranks.py --ranks 2 --virtual --out DIR   (R ranks on one GPU)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import jax_ep
import jax_ep.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_parts  # noqa: E402
from bench_layer import add_shape_args, layer_inputs  # noqa: E402
from harness import barh_plot, rank_map, scan_fn, time_slope  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--ranks", type=int, default=4, help="GPUs of the EP group (the first R)")
    add_shape_args(ap)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-blocks", default="",
                    help="comma-separated fused_copy_blocks values to also time the fused "
                         "layer with, beside the automatic one")
    ap.add_argument("--combine-blocks", default="",
                    help="comma-separated fused_combine_blocks values, likewise")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "reference"],
                    help="'reference' checks the script on a CPU")
    ap.add_argument("--capacity", type=int, default=0,
                    help="expert-major rows per rank (0: moe_ffn's default, moe_capacity's "
                         "expected load times 1.25); a larger one pads more rows")
    ap.add_argument("--virtual", action="store_true",
                    help="the R ranks as virtual ranks on the first device (the one-GPU "
                         "multi-rank mode: each rank's kernels on its share of the SMs, peers "
                         "in the same memory, no links)")
    args = ap.parse_args()
    R, T, H, I, L, K = args.ranks, args.tokens, args.hidden, args.inter, args.experts, args.topk
    E, be = R * L, args.backend
    devs = jax.devices()
    if args.virtual:
        # per-rank bodies under vmap; every argument stacked over the ranks
        mesh = functools.partial(jax_ep.testing.virtual_ranks, num_ranks=R)
        where = f"{devs[0].device_kind}, {R} virtual ranks"
    elif len(devs) < R:
        raise SystemExit(f"--ranks {R}: only {len(devs)} devices (--virtual runs them on one)")
    else:
        mesh = Mesh(np.array(devs[:R]), ("ep",))
        where = f"{devs[0].device_kind} x {R}"
    os.makedirs(args.out, exist_ok=True)
    cap = args.capacity or None
    tag = (f"R={R} T={T} H={H} I={I} L={L} K={K}" + (f" capacity={cap}" if cap else "")
           + (" virtual" if args.virtual else ""))
    print(f"device: {where}, jax {jax.__version__}, backend {be}\n== {tag}")

    def ranked(a):
        # [R * n, ...] -> [R, n, ...] for virtual ranks; shard_map splits the leading axis
        return a.reshape(R, -1, *a.shape[1:]) if args.virtual else a

    rng = np.random.default_rng(0)
    # drawn on the GPUs (each rank's share on its own over several GPUs): bench_layer.py
    wgu, wd, x, xr = layer_inputs(0, mesh, R, T, H, I, L, K)
    logits = jnp.asarray(rng.standard_normal((R * T, E)), jnp.float32)
    w, idx = jax.jit(functools.partial(jax_ep.routing.softmax_topk, k=K))(logits)
    w = w.astype(jnp.bfloat16)
    rows = T * K  # (token, expert) rows a rank receives on average (uniform routing)
    sizes = jnp.tile(jnp.full((L,), rows // L, jnp.int32), R)
    results = []

    def record(name, fn, args_, **extra):
        f_short, f_long = scan_fn(mesh, fn, 2), scan_fn(mesh, fn, 8)
        med, lo, hi, _ = time_slope(f_short, f_long, 2, 8, args_, args.reps)
        r = dict(name=name, shape=tag, ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3, **extra)
        results.append(r)
        print(f"  {name:<44} {r['ms']:9.3f} ms  [{r['ms_min']:.3f}, {r['ms_max']:.3f}]",
              flush=True)
        return r["ms"]

    def layer(fused, **settings):
        def f(x, idx, w, wgu, wd):
            return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=E, fused=fused, backend=be,
                                  capacity=cap, **settings)
        return f

    def comm(x, idx, w):
        # the token traffic: each token to its ranks once, and back
        res = jax_ep.dispatch(x, idx, w, num_experts=E, backend=be)
        return jax_ep.combine(res.recv_x, res.handle, backend=be)

    def gemms(xr, sizes, wgu, wd):
        # chained into one output (the harness keeps only a call's smallest output, so XLA
        # would drop an unchained GEMM)
        gm = functools.partial(jax_ep.grouped_matmul, backend=be)
        return gm(gm(xr, wgu, sizes)[:, :I], wd, sizes)

    x, idx, w, wgu, wd, xr, sizes = map(ranked, (x, idx, w, wgu, wd, xr, sizes))
    lay = (x, idx, w, wgu, wd)
    check = rank_map(mesh, lambda *a: (layer(False)(*a), layer(True)(*a)))
    unf, fus = (np.asarray(a, np.float64) for a in check(*lay))
    err = float(np.linalg.norm(fus - unf) / max(np.linalg.norm(unf), 1e-30))
    print(f"  check: fused vs unfused rel err {err:.2e}")
    assert err < 1e-2, err
    t_unf = record("moe_ffn forward", layer(False), lay, impl="ours", op="fwd")
    t_fus = record("moe_ffn(fused=True) forward", layer(True), lay, impl="ours-fused",
                   op="fwd", rel_err=err)
    t_fus1 = record("moe_ffn, fused dispatch + GEMM only, forward",
                    moe_parts.fused_first_half_only(E, be, cap), lay, impl="ours-fused-first",
                    op="fwd")
    t_hu = record("  dispatch + gate/up GEMM, unfused", moe_parts.first_half(False, E, be, cap),
                  lay[:4], impl="ours", op="half")
    t_hf = record("  dispatch + gate/up GEMM, fused", moe_parts.first_half(True, E, be, cap),
                  lay[:4], impl="ours-fused", op="half")
    split = dict(first_half_unfused_ms=t_hu, first_half_fused_ms=t_hf,
                 second_half_unfused_ms=t_fus1 - t_hf, second_half_fused_ms=t_fus - t_hf)
    print("  time split (ms): " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in split.items()))
    sweep = {}
    if be != "cuda" and (args.copy_blocks or args.combine_blocks):
        print(f"  (--copy-blocks / --combine-blocks skipped: the {be} backend has no fused "
              "kernels whose blocks they set)")
        args.copy_blocks = args.combine_blocks = ""
    for setting, values in (("fused_copy_blocks", args.copy_blocks),
                            ("fused_combine_blocks", args.combine_blocks)):
        sweep[setting] = {int(c): record(f"moe_ffn(fused=True, {setting}={c}) forward",
                                         layer(True, **{setting: int(c)}), lay,
                                         impl="ours-fused", op="fwd-sweep")
                          for c in filter(None, values.split(","))}
    t_comm = record("communication alone (dispatch + combine)", comm, (x, idx, w),
                    impl="ours", op="comm")
    t_gemm = record("GEMMs alone (gate/up, then down)", gemms, (xr, sizes, wgu, wd),
                    impl="ours", op="gemm")
    ratios = dict(fused_vs_unfused=t_fus / t_unf,
                  fused_vs_max_comm_gemm=t_fus / max(t_comm, t_gemm),
                  unfused_vs_max_comm_gemm=t_unf / max(t_comm, t_gemm),
                  hidden_share_fused=(t_comm + t_gemm - t_fus) / min(t_comm, t_gemm),
                  fused_half_vs_unfused_half=t_hf / t_hu)
    print("  same-run ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    with open(os.path.join(args.out, "bench_moe_ranks.json"), "w") as f:
        json.dump(dict(device=devs[0].device_kind, jax=jax.__version__, shape=tag, ranks=R,
                       virtual=args.virtual,
                       ratios=ratios, fused_split=split, fused_sweeps=sweep, results=results),
                  f, indent=1)
    rs = [r for r in results if r["op"] in ("fwd", "comm", "gemm")]
    barh_plot(os.path.join(args.out, "bench_moe_ranks.png"), [r["name"] for r in rs],
              [r["ms"] for r in rs], f"ms per layer, {tag}, {devs[0].device_kind}",
              figsize=(10, 3))
    print("\nwrote", os.path.join(args.out, "bench_moe_ranks.json"))


if __name__ == "__main__":
    sys.exit(main())
