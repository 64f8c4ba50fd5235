"""MoE layer benchmark on one GPU (R = 1): jax_ep.moe_ffn against what JAX users run today.

Shapes (per rank): T tokens, hidden H, intermediate I, L experts, top-K, bf16. In one run,
after warm-up, median over repetitions:
- moe_ffn forward and forward + backward (the gradients of x, topk_weights, w_gate_up and
  w_down), unfused and fused (fused=True), also in --rounds paired rounds (each timed in turn:
  the median of the per-round fused / unfused ratios), the fused layer with only its first
  half fused, the time split of both halves, and optionally sweeps of fused_copy_blocks and
  fused_combine_blocks;
- its own grouped GEMMs alone, at the layer's group sizes: forward (gate/up and down) and
  backward (d lhs and d rhs of each);
- its forward's other parts, each alone: dispatch, the expert-major order and rows, the
  activation, the weighted sum per row, dispatch + combine;
- baselines: sort by expert + lax.ragged_dot (MaxText's GPU path), and a fixed capacity per
  expert (1.25) + padded batched einsum; forward and forward + backward.
Each figure is the slope between a jit-compiled scan of n_short calls and one of n_long calls.
Prints a table and the same-run ratios, writes bench_moe.json and bench_moe.png.

  python benchmarks/bench_moe.py --out DIR [--quick] [--copy-blocks 8,32] [--combine-blocks 1,8]
  python benchmarks/bench_moe.py --backend reference --tokens 32 --hidden 256 --inter 128 \
      --experts 4 --topk 2 --quick --rounds 1 --out DIR   (checks it on a CPU)
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

import jax_ep
from jax_ep import expert_layout as _el, moe as _moe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines  # noqa: E402
import moe_parts  # noqa: E402
from harness import barh_plot, op_timer, paired, rank_map, ratio_median, time_op  # noqa: E402


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def keep(*trees):
    """A scalar that depends on all of every leaf: XLA drops the work of an unused result, and
    may shrink the work behind a slice of one (a sum reads each leaf once)."""
    leaves = jax.tree_util.tree_leaves(trees)
    return sum(jnp.sum(leaf, dtype=jnp.float32) for leaf in leaves)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--backend", default="cuda", choices=["cuda", "reference"],
                    help="'reference' checks the script on a CPU")
    ap.add_argument("--skip-ragged-dot", action="store_true")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of the paired fused / unfused ratios")
    ap.add_argument("--copy-blocks", default="",
                    help="comma-separated fused_copy_blocks values to time the fused layer with")
    ap.add_argument("--combine-blocks", default="",
                    help="comma-separated fused_combine_blocks values to time the fused layer "
                         "with, beside the automatic one")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, backend {args.backend}")
    reps = 3 if args.quick else 5
    T, H, I, L, K = args.tokens, args.hidden, args.inter, args.experts, args.topk
    be = args.backend
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((T, L)), jnp.float32)
    w, idx = jax.jit(functools.partial(jax_ep.routing.softmax_topk, k=K))(logits)
    w = w.astype(jnp.bfloat16)
    wgu = jnp.asarray(rng.standard_normal((L, H, 2 * I)) / np.sqrt(H), jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((L, I, H)) / np.sqrt(I), jnp.bfloat16)
    M = T * K
    flops_fwd = 2.0 * M * H * 2 * I + 2.0 * M * I * H
    tag = f"T={T} H={H} I={I} L={L} K={K}"
    print(f"== {tag}, R = 1, {flops_fwd / 1e12:.2f} TFLOP forward")
    results = []

    def record(name, secs, flops=None, **extra):
        med, lo, hi = secs
        r = dict(name=name, shape=tag, ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3,
                 tflops=(flops / med / 1e12) if flops else None, **extra)
        results.append(r)
        tf = f"{r['tflops']:8.1f} TFLOP/s" if r["tflops"] else ""
        print(f"  {name:<52} {r['ms']:9.3f} ms  [{r['ms_min']:.3f}, {r['ms_max']:.3f}] {tf}",
              flush=True)
        return r

    mesh = jax.sharding.Mesh(np.array([dev]), ("ep",))

    def layer(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=L, backend=be)

    def layer_fb(x, idx, w, wgu, wd, fn=layer):
        def loss(x, w, wgu, wd):
            return jnp.sum(fn(x, idx, w, wgu, wd).astype(jnp.float32))
        v, g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w, wgu, wd)
        return v + keep(g)

    lay_args = (x, idx, w, wgu, wd)

    # correctness before timing: ours against the ragged_dot layer
    ours = rank_map(mesh, layer)(*lay_args)
    base = rank_map(mesh, baselines.ragged_dot_moe)(*lay_args)
    err = rel_err(ours, base)
    print(f"  check: moe_ffn vs sort + ragged_dot rel err {err:.2e}")
    assert err < 2e-2, err

    # fused dispatch + first grouped GEMM: the layer, and its first half against the same half
    # unfused (dispatch to the expert-major layout at the fused path's alignment, then the GEMM)
    def layer_fused(x, idx, w, wgu, wd):
        return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=L, fused=True, backend=be)

    # one timer each, compiled at its first call: timed alone, then again in the paired rounds
    timers = {"fwd": op_timer(layer, lay_args, reps=reps),
              "fwd_fused": op_timer(layer_fused, lay_args, reps=reps),
              "fb": op_timer(layer_fb, lay_args, reps=reps),
              "fb_fused": op_timer(functools.partial(layer_fb, fn=layer_fused), lay_args,
                                   reps=reps)}
    fwd = record("moe_ffn forward", timers["fwd"](), flops_fwd, impl="ours", op="fwd",
                 rel_err=err)
    fb = record("moe_ffn forward + backward", timers["fb"](), 3 * flops_fwd, impl="ours",
                op="fwd+bwd")

    err_f = rel_err(rank_map(mesh, layer_fused)(*lay_args), ours)
    print(f"  check: moe_ffn fused vs unfused rel err {err_f:.2e}")
    assert err_f < 1e-2, err_f
    fwd_f = record("moe_ffn(fused=True) forward", timers["fwd_fused"](), flops_fwd,
                   impl="ours-fused", op="fwd", rel_err=err_f)
    fb_f = record("moe_ffn(fused=True) forward + backward", timers["fb_fused"](),
                  3 * flops_fwd, impl="ours-fused", op="fwd+bwd")

    # fused / unfused in paired rounds (each side timed in turn, each compiled once): the clock
    # drifts during a run by more than the two differ
    pr = paired(timers, args.rounds)
    rounds = {k: [t * 1e3 for t in v] for k, v in pr.items()}
    per_round = {k: [f / u for f, u in zip(rounds[k + "_fused"], rounds[k])] for k in ("fwd", "fb")}
    for k, what in (("fwd", "forward"), ("fb", "forward + backward")):
        print(f"  paired rounds, fused / unfused {what}: median "
              f"{ratio_median(pr[k + '_fused'], pr[k]):.3f}, rounds "
              + " ".join(f"{r:.3f}" for r in per_round[k]), flush=True)

    # the fused layer with its second half unfused: the fused GEMM + combine's own effect
    fwd_f1 = record("moe_ffn, fused dispatch + GEMM only, forward",
                    time_op(moe_parts.fused_first_half_only(L, be), lay_args, reps=reps),
                    flops_fwd,
                    impl="ours-fused-first", op="fwd")

    def block_sweep(setting, values):
        """{value: fused forward ms} for each value of one fused_* setting."""
        out = {}
        for c in [int(v) for v in values.split(",") if v.strip()]:
            def layer_c(x, idx, w, wgu, wd, c=c):
                return jax_ep.moe_ffn(x, idx, w, wgu, wd, num_experts=L, fused=True,
                                      backend=be, **{setting: c})
            out[c] = record(f"moe_ffn(fused=True, {setting}={c}) forward",
                            time_op(layer_c, lay_args, reps=reps), flops_fwd,
                            impl="ours-fused", op="fwd-sweep")["ms"]
        return out

    if be != "cuda" and (args.copy_blocks or args.combine_blocks):
        print(f"  (--copy-blocks / --combine-blocks skipped: the {be} backend has no fused "
              "kernels whose blocks they set)")
        args.copy_blocks = args.combine_blocks = ""
    copy_sweep = block_sweep("fused_copy_blocks", args.copy_blocks)
    sweep = block_sweep("fused_combine_blocks", args.combine_blocks)
    half_unfused = moe_parts.first_half(False, L, be)
    half_fused = moe_parts.first_half(True, L, be)
    half_args = (x, idx, w, wgu)
    flops_g1 = 2.0 * M * H * 2 * I
    hu = record("  dispatch + grouped GEMM gate/up, unfused",
                time_op(half_unfused, half_args, reps=reps), flops_g1, impl="ours", op="half")
    hf = record("  dispatch + grouped GEMM gate/up, fused",
                time_op(half_fused, half_args, reps=reps), flops_g1, impl="ours-fused",
                op="half")

    # the layer's own grouped GEMMs alone, at its group sizes (uniform routing: as drawn)
    flat = jnp.where(idx >= 0, idx, L).reshape(-1)
    sizes = jnp.zeros((L + 1,), jnp.int32).at[flat].add(1)[:L]
    xr = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    ar = jnp.asarray(rng.standard_normal((M, I)), jnp.bfloat16)
    gm = functools.partial(jax_ep.grouped_matmul, backend=be)
    g1 = record("  grouped GEMM gate/up forward", time_op(gm, (xr, wgu, sizes), reps=reps),
                2.0 * M * H * 2 * I, impl="ours", op="gemm-fwd")
    g2 = record("  grouped GEMM down forward", time_op(gm, (ar, wd, sizes), reps=reps),
                2.0 * M * I * H, impl="ours", op="gemm-fwd")

    def gemm_bwd(a, b, s, ct):
        _, vjp = jax.vjp(lambda a, b: gm(a, b, s), a, b)
        return keep(vjp(ct))
    ct1 = jnp.asarray(rng.standard_normal((M, 2 * I)), jnp.bfloat16)
    ct2 = jnp.asarray(rng.standard_normal((M, H)), jnp.bfloat16)
    b1 = record("  grouped GEMM gate/up backward (d lhs + d rhs)",
                time_op(gemm_bwd, (xr, wgu, sizes, ct1), reps=reps), 2 * 2.0 * M * H * 2 * I,
                impl="ours", op="gemm-bwd")
    b2 = record("  grouped GEMM down backward (d lhs + d rhs)",
                time_op(gemm_bwd, (ar, wd, sizes, ct2), reps=reps), 2 * 2.0 * M * I * H,
                impl="ours", op="gemm-bwd")
    gemm_fwd_ms = g1["ms"] + g2["ms"]
    gemm_fb_ms = gemm_fwd_ms + b1["ms"] + b2["ms"]

    # the forward's parts
    # (each timed function returns one whole array: the harness keeps its smallest output)
    def p_dispatch(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=L, backend=be).recv_x
    record("  part: dispatch", time_op(p_dispatch, (x, idx, w), reps=reps), impl="ours",
           op="part")
    res = rank_map(mesh, lambda x, idx, w: (lambda r: (r.recv_x, r.recv_topk_idx))(
        jax_ep.dispatch(x, idx, w, num_experts=L, backend=be)))(x, idx, w)

    def p_reorder(recv_x, recv_idx):
        lay = _el.plan(recv_idx, num_local_experts=L, capacity=M, alignment=1, backend=be)
        return _el.expand_rows(recv_x, lay["src"], lay["row_of"], K)
    record("  part: expert-major order and rows (sort + gather)",
           time_op(p_reorder, res, reps=reps), impl="ours", op="part")
    h = jnp.asarray(rng.standard_normal((M, 2 * I)), jnp.bfloat16)
    record("  part: silu(gate) * up", time_op(lambda h: _moe.swiglu(h).astype(jnp.bfloat16),
                                                (h,), reps=reps), impl="ours", op="part")

    def p_wsum(y, wk, src, row_of):
        return _el.reduce_rows(y, wk, src, row_of, K)
    src = jnp.asarray(rng.permutation(M), jnp.int32)
    row_of = jnp.zeros((M,), jnp.int32).at[src].set(jnp.arange(M, dtype=jnp.int32))
    wk = jnp.asarray(rng.random((T, K)), jnp.float32)
    record("  part: weighted sum per row",
           time_op(p_wsum, (ct2, wk, src, row_of.reshape(T, K)), reps=reps),
           impl="ours", op="part")

    def p_combine(x, idx, w):
        r = jax_ep.dispatch(x, idx, w, num_experts=L, backend=be)
        return jax_ep.combine(r.recv_x, r.handle, backend=be)
    dc = record("  part: dispatch + combine", time_op(p_combine, (x, idx, w), reps=reps),
                impl="ours", op="part")

    # baselines
    cap = record("capacity 1.25 + padded einsum forward",
                 time_op(baselines.capacity_einsum_moe, lay_args, reps=reps), flops_fwd,
                 impl="capacity-einsum", op="fwd")
    capb = record("capacity 1.25 + padded einsum forward + backward",
                  time_op(functools.partial(layer_fb, fn=baselines.capacity_einsum_moe),
                          lay_args, reps=reps), 3 * flops_fwd, impl="capacity-einsum",
                  op="fwd+bwd")
    rd = rdb = None
    if not args.skip_ragged_dot:
        rd = record("sort + lax.ragged_dot forward",
                    time_op(baselines.ragged_dot_moe, lay_args, 1, 3, reps=3), flops_fwd,
                    impl="ragged_dot", op="fwd")
        rdb = record("sort + lax.ragged_dot forward + backward",
                     time_op(functools.partial(layer_fb, fn=baselines.ragged_dot_moe),
                             lay_args, 1, 2, reps=3), 3 * flops_fwd, impl="ragged_dot",
                     op="fwd+bwd")

    # the time split: each half of the layer, fused and unfused (the second half as the layer
    # minus its first half, both measured in this run)
    split = dict(first_half_unfused_ms=hu["ms"], first_half_fused_ms=hf["ms"],
                 second_half_unfused_ms=fwd_f1["ms"] - hf["ms"],
                 second_half_fused_ms=fwd_f["ms"] - hf["ms"])
    print("  time split (ms): " + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in split.items()))
    ratios = dict(fused_fwd_vs_unfused=fwd_f["ms"] / fwd["ms"],
                  fused_fwd_vs_fused_first_half_only=fwd_f["ms"] / fwd_f1["ms"],
                  fused_fwd_bwd_vs_unfused=fb_f["ms"] / fb["ms"],
                  fused_half_vs_unfused_half=hf["ms"] / hu["ms"],
                  fused_fwd_vs_unfused_paired=ratio_median(pr["fwd_fused"], pr["fwd"]),
                  fused_fwd_bwd_vs_unfused_paired=ratio_median(pr["fb_fused"], pr["fb"]),
                  fwd_vs_own_gemms=fwd["ms"] / gemm_fwd_ms,
                  fwd_bwd_vs_own_gemms=fb["ms"] / gemm_fb_ms,
                  dispatch_combine_share_of_fwd=dc["ms"] / fwd["ms"],
                  capacity_einsum_fwd_vs_ours=cap["ms"] / fwd["ms"],
                  capacity_einsum_fwd_bwd_vs_ours=capb["ms"] / fb["ms"])
    if rd:
        ratios.update(ragged_dot_fwd_vs_ours=rd["ms"] / fwd["ms"],
                      ragged_dot_fwd_bwd_vs_ours=rdb["ms"] / fb["ms"])
    print(f"\n  own grouped GEMMs alone: forward {gemm_fwd_ms:.3f} ms, forward + backward "
          f"{gemm_fb_ms:.3f} ms")
    print("  same-run ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))

    with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, shape=tag, ranks=1,
                       gemm_fwd_ms=gemm_fwd_ms, gemm_fwd_bwd_ms=gemm_fb_ms, ratios=ratios,
                       fused_split=split, fused_paired_rounds_ms=rounds,
                       fused_paired_rounds_ratio=per_round, fused_copy_blocks_sweep=copy_sweep,
                       fused_combine_blocks_sweep=sweep,
                       results=results), f, indent=1)
    rs = [r for r in results if r["op"] in ("fwd", "fwd+bwd")]
    barh_plot(os.path.join(args.out, "bench_moe.png"), [r["name"] for r in rs],
              [r["ms"] for r in rs], f"ms per layer, {tag}, one {dev.device_kind} (log scale)",
              log=True, figsize=(10, 4))
    print("\nwrote", os.path.join(args.out, "bench_moe.json"))


if __name__ == "__main__":
    sys.exit(main())
