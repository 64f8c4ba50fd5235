"""Grouped-GEMM benchmark on one GPU: jax_ep.grouped_matmul against what JAX offers.

In one run, same shapes, after warm-up, median over repetitions: ours (bf16 forward,
forward+backward, Zipf-skewed sizes, a quarter-used buffer, FP8), lax.ragged_dot, JAX's Pallas
Mosaic GPU ragged_dot_mgpu (best of a small config sweep), a dense GEMM of the same FLOPs,
CUTLASS's own grouped-GEMM example (example 57, when benchmarks/cutlass_example57.sh has built it
into --cutlass-bin; it times itself: mean of 100 calls, after a warm-up call), DeepGEMM's FP8
grouped GEMMs on the same quantised operands (when benchmarks/deepgemm.sh has prepared
--deepgemm and torch is installed); the masked layout against the time to read the weights once
at the HBM rate measured in the same run (a 2 GiB read).
Each figure is the slope between a jit-compiled scan of n_short calls and one of n_long calls
(fixed per-execution costs cancel). The GPU's clock drifts during a run (power, heat), so the
ratios that compare two kernels (ours against dense, Zipf against uniform, ours against
DeepGEMM) are also measured in --rounds rounds that time each side in turn: the median of the
per-round ratios. Prints a table, writes bench_gemm.json and bench_gemm.png.

  python benchmarks/bench_gemm.py --out DIR [--quick] [--deepgemm .deepgemm]
  python benchmarks/bench_gemm.py --backend reference --quick --shapes 256x256 --rows 256 \
      --groups 4 --masked 4,32,256,256 --rounds 1 --out DIR   (checks the script on a CPU)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys

import numpy as np

import jax
import jax.numpy as jnp

import jax_ep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepgemm_baseline as dgb  # noqa: E402
from harness import barh_plot, op_timer, paired, ratio_median, time_op  # noqa: E402

G_DEFAULT = 32


def zipf_sizes(rng, M, G):
    """Sizes summing to M with group k ~ 1/k (the largest about a quarter of the rows at G = 32),
    an eighth of the groups empty, in random order."""
    w = 1.0 / np.arange(1, G + 1)
    w[rng.permutation(np.arange(1, G))[: max(1, G // 8)]] = 0
    s = np.floor(w / w.sum() * M).astype(np.int64)
    s[0] += M - s.sum()
    return rng.permutation(s).astype(np.int32)


def uniform_sizes(M, G, used=None):
    used = M if used is None else used
    s = np.full(G, used // G, np.int64)
    s[-1] += used - s.sum()
    return s.astype(np.int32)


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def pallas_ragged_dot(sweep):
    """Best config of JAX's Pallas Mosaic GPU ragged_dot (None if not importable)."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except Exception as e:  # noqa: BLE001
        print(f"  pallas ragged_dot_mgpu not available: {e}")
        return None
    return [functools.partial(ragged_dot_mgpu.ragged_dot, block_m=bm, block_n=bn, block_k=bk,
                              max_concurrent_steps=st, grid_block_n=gbn)
            for bm, bn, bk, st, gbn in sweep]


def cutlass_example(bin_dir, M, G, K, N):
    """CUTLASS example 57's binaries in bin_dir at G groups of M / G rows: {binary: [(kernel,
    ms, TFLOP/s)]}, its own timing (alpha 1, beta 0: no C read, as in ours)."""
    out = {}
    for exe in sorted(os.listdir(bin_dir)) if os.path.isdir(bin_dir) else []:
        if not exe.startswith("ex57_"):
            continue
        cmd = [os.path.join(bin_dir, exe), f"--m={M // G}", f"--n={N}", f"--k={K}",
               f"--groups={G}", "--alpha=1", "--beta=0", "--iterations=100"]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except Exception as e:  # noqa: BLE001
            print(f"  {exe}: did not run ({type(e).__name__}: {e})")
            continue
        runs, kernel = [], None
        for line in p.stdout.splitlines():
            if line.startswith("***"):
                kernel = line.strip("* ")
            m = re.match(r"\s*Avg runtime\s*:\s*([\d.eE+-]+)", line)
            if m:
                ms = float(m.group(1))
                runs.append((kernel, ms, 2.0 * M * K * N / (ms * 1e-3) / 1e12))
            if "Disposition: Failed" in line:
                print(f"  {exe}: its own check failed ({kernel})")
        if p.returncode or not runs:
            print(f"  {exe}: exit {p.returncode}: {(p.stdout + p.stderr)[-300:]}")
        out[exe] = runs
        for kernel, ms, tf in runs:
            print(f"  {exe} {kernel}: {ms:.3f} ms = {tf:.1f} TFLOP/s")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sweep")
    ap.add_argument("--shapes", default="7168x4096,2048x7168", help="K x N list")
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--groups", type=int, default=G_DEFAULT)
    ap.add_argument("--masked", default="32,1024,7168,4096", help="G,C,K,N of the masked layout")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "reference"],
                    help="'reference' checks the script on a CPU (CUDA-only rows skipped)")
    ap.add_argument("--skip-ragged-dot", action="store_true")
    ap.add_argument("--cutlass-bin", default=".cutlass/bin",
                    help="folder of CUTLASS example 57 binaries (benchmarks/cutlass_example57.sh)")
    ap.add_argument("--deepgemm", default="",
                    help="DeepGEMM checkout (benchmarks/deepgemm.sh) for an FP8 baseline")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the paired ratios")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}, jax_ep {jax_ep.__version__}")
    reps = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    M, G = args.rows, args.groups
    rows, results = [], []

    def record(name, shape, secs, flops=None, nbytes=None, **extra):
        med, lo, hi = secs
        r = dict(name=name, shape=shape, ms=med * 1e3, ms_min=lo * 1e3, ms_max=hi * 1e3,
                 tflops=(flops / med / 1e12) if flops else None,
                 gbps=(nbytes / med / 1e9) if nbytes else None, **extra)
        results.append(r)
        rows.append(r)
        tf = f"{r['tflops']:8.1f}" if r["tflops"] else " " * 8
        gb = f"{r['gbps']:8.0f}" if r["gbps"] else " " * 8
        print(f"  {name:<44} {shape:<22} {r['ms']:9.3f} ms {tf} TFLOP/s {gb} GB/s", flush=True)
        return r

    def record_rounds(pr, names, tag, flops, gbytes=None, **extra):
        """One record per side of paired rounds pr: the median and range of its rounds."""
        out = {}
        for who, name in names.items():
            v = pr[who]
            out[who] = record(name, tag, (float(np.median(v)), min(v), max(v)), flops, gbytes,
                              impl="ours" if who == "ours" else "deepgemm",
                              rounds_ms=[t * 1e3 for t in v], **extra)
        return out

    def deepgemm_pair(data, aq, wq, sizes, ours_out, tag, flops, K, N):
        """DeepGEMM's contiguous FP8 GEMM on our quantised operands: checked against our
        output, then both timed in paired rounds."""
        if not dgm:
            return
        got = dgb.contiguous(dgm, aq, wq, sizes)
        if got is None:
            print("  DeepGEMM: group sizes not multiples of 128, skipped")
            return
        run, out = got
        err = rel_err(out.float().cpu().numpy(), ours_out)
        print(f"  check: DeepGEMM vs ours on the same FP8 operands ({data}) rel err {err:.2e}"
              + ("  MISMATCH" if err > 1e-2 else ""))
        pr = paired({"ours": op_timer(gm, (aq, wq, sizes), reps=reps),
                     "deepgemm": lambda: dgb.time_slope(dgm, run, reps=reps)}, rounds)
        recs = record_rounds(pr, {"ours": f"ours FP8 fwd, {data}, paired rounds",
                                  "deepgemm": f"DeepGEMM FP8 fwd, {data}, paired rounds"},
                             tag, flops, dist="uniform", K=K, N=N,
                             op="fp8-paired" if data == "normal data" else "fp8-int-paired")
        recs["deepgemm"]["rel_err_vs_ours"] = err
        print(f"  ours / DeepGEMM speed ({data}): {ratio_median(pr['deepgemm'], pr['ours']):.3f}"
              " (median of the per-round ratios)", flush=True)
        del out

    # HBM rate: a 2 GiB device-to-device copy (bytes read + written) and a 2 GiB read-only
    # reduction; the higher rate is the floor's rate.
    n = 1 << (30 if args.backend == "cuda" else 20)
    big = jnp.zeros(n, jnp.bfloat16) + 1
    copy = record("HBM copy (read + write)", f"{big.nbytes >> 20} MiB",
                  time_op(lambda x: x + 1, (big,), reps=reps), nbytes=2 * big.nbytes)
    read = record("HBM read (sum)", f"{big.nbytes >> 20} MiB",
                  time_op(lambda x: jnp.sum(x, dtype=jnp.float32), (big,), reps=reps),
                  nbytes=big.nbytes)
    hbm_rate = max(copy["gbps"], read["gbps"]) * 1e9
    del big

    sweep = [(128, 128, 64, 5, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4)]
    if args.quick:
        sweep = sweep[:1]
    cuda = args.backend == "cuda"
    if not cuda:
        print(f"  ({args.backend} backend: skipped the CUDA-only rows: our 64-row tiles and "
              "rhs [G, N, K] kernels, Pallas Mosaic GPU, CUTLASS example 57, DeepGEMM)")
    pallas = pallas_ragged_dot(sweep) if cuda else None
    dgm = dgb.load(args.deepgemm) if cuda else None
    rounds = args.rounds

    for shp in args.shapes.split(","):
        K, N = map(int, shp.split("x"))
        tag = f"G={G} M={M} K={K} N={N}"
        print(f"\n== {tag}")
        a = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16)
        s_uni = jnp.asarray(uniform_sizes(M, G))
        s_zipf = jnp.asarray(zipf_sizes(rng, M, G))
        s_quarter = jnp.asarray(uniform_sizes(M, G, M // 4))
        flops = 2.0 * M * K * N
        gm = functools.partial(jax_ep.grouped_matmul, backend=args.backend)

        # correctness of this shape (one call each) before timing it
        ours = jax.jit(gm)(a, w, s_uni)
        dense_ref = jnp.einsum("gmk,gkn->gmn", a.reshape(G, M // G, K), w,
                               preferred_element_type=jnp.float32).reshape(M, N)
        err = rel_err(ours, dense_ref)
        print(f"  check: ours vs per-group einsum rel err {err:.2e}")
        assert err < 1e-2, err

        fwd = record("ours bf16 fwd (uniform)", tag, time_op(gm, (a, w, s_uni), reps=reps),
                     flops, impl="ours", op="fwd", dist="uniform", K=K, N=N, rel_err=err)
        z = record("ours bf16 fwd (Zipf)", tag, time_op(gm, (a, w, s_zipf), reps=reps), flops,
                   impl="ours", op="fwd", dist="zipf", K=K, N=N,
                   largest_group=int(np.max(np.asarray(s_zipf))),
                   empty_groups=int(np.sum(np.asarray(s_zipf) == 0)))
        q = record("ours bf16 fwd (quarter of rows used)", tag,
                   time_op(gm, (a, w, s_quarter), reps=reps), flops / 4, impl="ours",
                   op="fwd", dist="quarter", K=K, N=N)

        def fwd_bwd(a, w, s, gm=gm):
            """Forward, d lhs and d rhs, each kept alive (XLA drops unused pure calls)."""
            def loss(a, w):
                return jnp.sum(gm(a, w, s).astype(jnp.float32))
            v, (da, dw) = jax.value_and_grad(loss, argnums=(0, 1))(a, w)
            return v + jnp.sum(da[:8, :8].astype(jnp.float32)) + jnp.sum(
                dw[:, :8, :8].astype(jnp.float32))
        fb = record("ours bf16 fwd+bwd (dlhs + drhs)", tag,
                    time_op(fwd_bwd, (a, w, s_uni), reps=reps), 3 * flops, impl="ours",
                    op="fwd+bwd", dist="uniform", K=K, N=N)

        # the other tile shape at the same sizes (64-row tiles, ping-pong warp groups)
        from jax_ep import grouped_gemm as _gg

        def small(a, w, s, M=M, N=N):
            return _gg.gemm_call(a, w, s, None, None, mode="contiguous", rhs_kn=True,
                                  small_m=True, out_shape=(M, N), out_dtype=jnp.bfloat16)
        if cuda:
            for dist, sz in (("uniform", s_uni), ("Zipf", s_zipf)):
                record(f"ours bf16 fwd, 64-row tiles ({dist})", tag,
                       time_op(small, (a, w, sz), reps=reps), flops, impl="ours-64",
                       op="fwd-64", dist=dist.lower(), K=K, N=N)

            # rhs as [G, N, K] (K-major, the example's B layout): the kernel of d lhs
            wt = jnp.swapaxes(w, 1, 2)

            def nk(a, wt, s, M=M, N=N):
                return _gg.gemm_call(a, wt, s, None, None, mode="contiguous", rhs_kn=False,
                                      small_m=False, out_shape=(M, N), out_dtype=jnp.bfloat16)
            try:
                record("ours bf16 fwd, rhs [G, N, K] (uniform)", tag,
                       time_op(nk, (a, wt, s_uni), reps=reps), flops, impl="ours-nk",
                       op="fwd-nk", dist="uniform", K=K, N=N)
            except Exception as e:  # noqa: BLE001
                print(f"  rhs [G, N, K]: failed ({type(e).__name__}: {str(e)[:200]})")
            del wt

        # The data changes the clock: tensor cores draw less power on integer-valued inputs
        # (few mantissa bits set), the fill of CUTLASS's example (bf16: integers in [-8, 8]).
        ai = jnp.asarray(rng.integers(-8, 9, (M, K)), jnp.bfloat16)
        wi = jnp.asarray(rng.integers(-8, 9, (G, K, N)), jnp.bfloat16)
        fi = record("ours bf16 fwd, integer data (uniform)", tag,
                    time_op(gm, (ai, wi, s_uni), reps=reps), flops, impl="ours", op="fwd-int",
                    dist="uniform", K=K, N=N, data="integers -8..8")
        di = record("dense GEMM, integer data", f"{M}x{K} @ {K}x{N}",
                    time_op(lambda x, y: x @ y, (ai, wi[0]), reps=reps), flops, impl="dense",
                    op="fwd-int", K=K, N=N, data="integers -8..8")
        del ai, wi

        dense_b = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.bfloat16)
        dense = record("dense GEMM, same FLOPs (XLA / cuBLAS)", f"{M}x{K} @ {K}x{N}",
                       time_op(lambda x, y: x @ y, (a, dense_b), reps=reps), flops,
                       impl="dense", op="fwd", K=K, N=N)
        pr = paired({"uniform": op_timer(gm, (a, w, s_uni), reps=reps),
                     "zipf": op_timer(gm, (a, w, s_zipf), reps=reps),
                     "dense": op_timer(lambda x, y: x @ y, (a, dense_b), reps=reps)}, rounds)
        pair = dict(name="paired rounds: ours bf16 fwd / dense, Zipf / uniform", shape=tag,
                    op="paired", K=K, N=N, rounds={k: [t * 1e3 for t in v] for k, v in pr.items()},
                    vs_dense=ratio_median(pr["dense"], pr["uniform"]),
                    zipf_vs_uniform=ratio_median(pr["uniform"], pr["zipf"]))
        results.append(pair)
        print("  paired rounds (ms, each round: uniform / Zipf / dense): " + "; ".join(
            f"{u * 1e3:.3f} / {z * 1e3:.3f} / {d * 1e3:.3f}"
            for u, z, d in zip(pr["uniform"], pr["zipf"], pr["dense"]))
            + f" -> ours {pair['vs_dense']:.3f} of dense, Zipf {pair['zipf_vs_uniform']:.3f} of "
            "uniform (medians of the per-round ratios)", flush=True)

        # FP8: block-scaled e4m3 activations and weights, bf16 out
        aq = jax.jit(jax_ep.quantize_fp8)(a)
        wq = jax.jit(jax_ep.quantize_fp8_weights)(w)
        f8 = jax.jit(gm)(aq, wq, s_uni)
        err8 = rel_err(f8, dense_ref)
        print(f"  check: FP8 vs the bf16 einsum (quantization error) rel err {err8:.2e}")
        f8r = record("ours FP8 fwd (1x128 / 128x128 scales)", tag,
                     time_op(gm, (aq, wq, s_uni), reps=reps), flops, impl="ours", op="fp8",
                     dist="uniform", K=K, N=N, rel_err=err8)
        deepgemm_pair("normal data", aq, wq, s_uni, f8, tag, flops, K, N)
        del aq, wq, f8
        # FP8 on integer data in [-2, 2] (the example's FP8 fill), quantised as above
        aq = jax.jit(jax_ep.quantize_fp8)(jnp.asarray(rng.integers(-2, 3, (M, K)), jnp.bfloat16))
        wq = jax.jit(jax_ep.quantize_fp8_weights)(
            jnp.asarray(rng.integers(-2, 3, (G, K, N)), jnp.bfloat16))
        f8i = record("ours FP8 fwd, integer data", tag, time_op(gm, (aq, wq, s_uni), reps=reps),
                     flops, impl="ours", op="fp8-int", dist="uniform", K=K, N=N,
                     data="integers -2..2")
        deepgemm_pair("integer data", aq, wq, s_uni, jax.jit(gm)(aq, wq, s_uni), tag, flops, K, N)
        del aq, wq

        # CUTLASS example 57, best kernel of each of its builds (bf16 builds: best of the two)
        ex = {}
        if cuda:
            for exe, runs in cutlass_example(args.cutlass_bin, M, G, K, N).items():
                if runs:
                    kind = "fp8" if "fp8" in exe else "bf16"
                    kernel, ms, tf = max(runs, key=lambda r: r[2])
                    if kind not in ex or tf > ex[kind]["tflops"]:
                        ex[kind] = dict(build=exe, kernel=kernel, ms=ms, tflops=tf)
            for kind, e in ex.items():
                record(f"CUTLASS example 57 {kind} ({e['build']}, {e['kernel']})", tag,
                       (e["ms"] * 1e-3,) * 3, flops, impl="cutlass-example", op=f"ex57-{kind}",
                       K=K, N=N, build=e["build"], kernel=e["kernel"])

        best = pal = None
        if pallas:
            for i, (fn, cfg) in enumerate(zip(pallas, sweep)):
                try:
                    t = time_op(lambda a, w, s, fn=fn: fn(a, w, group_sizes=s), (a, w, s_uni),
                                reps=reps)
                except Exception as e:  # noqa: BLE001
                    print(f"  pallas {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                    continue
                print(f"  pallas ragged_dot_mgpu {cfg}: {t[0] * 1e3:.3f} ms")
                if best is None or t[0] < best[0][0]:
                    best = (t, cfg)
            if best:
                pal = record(f"Pallas ragged_dot_mgpu (best: {best[1]})", tag, best[0], flops,
                             impl="pallas", op="fwd", K=K, N=N, config=list(best[1]))

        if not args.skip_ragged_dot:
            rd = functools.partial(jax.lax.ragged_dot, preferred_element_type=jnp.bfloat16)
            rdf = record("lax.ragged_dot fwd", tag, time_op(rd, (a, w, s_uni), 1, 3, reps=3),
                         flops, impl="ragged_dot", op="fwd", K=K, N=N)

            rdb = record("lax.ragged_dot fwd+bwd", tag, time_op(
                functools.partial(fwd_bwd, gm=rd), (a, w, s_uni), 1, 2,
                         reps=3), 3 * flops, impl="ragged_dot", op="fwd+bwd", K=K, N=N)
            print(f"  same-run ratios: fwd {rdf['ms'] / fwd['ms']:.1f}x faster than ragged_dot, "
                  f"fwd+bwd {rdb['ms'] / fb['ms']:.1f}x")
        print(f"  same-run ratios: fwd {fwd['tflops'] / dense['tflops']:.3f} of dense; Zipf "
              f"{z['tflops'] / fwd['tflops']:.3f} of uniform; quarter-used buffer "
              f"{q['ms'] / fwd['ms']:.3f} of the full time; fwd+bwd {fb['tflops']:.0f} TFLOP/s"
              + (f"; {fwd['tflops'] / pal['tflops']:.2f}x Pallas" if pal else "")
              + (f"; bf16 {fwd['tflops'] / ex['bf16']['tflops']:.3f} of CUTLASS example 57"
                 if "bf16" in ex else "")
              + (f"; FP8 (block-scaled) {f8r['tflops'] / ex['fp8']['tflops']:.3f} of its FP8"
                 " (no scales)" if "fp8" in ex else ""))
        print(f"  same-run ratios, integer data (the example's fill): bf16 {fi['tflops']:.0f} "
              f"TFLOP/s = {fi['tflops'] / di['tflops']:.3f} of dense"
              + (f", {fi['tflops'] / ex['bf16']['tflops']:.3f} of CUTLASS example 57"
                 if "bf16" in ex else "")
              + f"; FP8 {f8i['tflops']:.0f} TFLOP/s"
              + (f" = {f8i['tflops'] / ex['fp8']['tflops']:.3f} of its FP8" if "fp8" in ex
                 else ""))
        del a, w, dense_b, ours, dense_ref

    def masked_deepgemm(lhs, rhs, counts, floor, useful, wbytes, tag):
        """DeepGEMM's masked FP8 GEMM (rows past the counts left as they were) on our operands,
        checked on the valid rows, then timed in paired rounds with ours, zero_padding=False."""
        run, out = dgb.masked(dgm, lhs, rhs, counts)
        ours = np.asarray(jax.jit(functools.partial(gmm, zero_padding=False))(lhs, rhs, counts),
                          np.float32)
        got = out.float().cpu().numpy()
        valid = np.arange(ours.shape[1])[None, :] < np.asarray(counts)[:, None]
        err = rel_err(got[valid], ours[valid])
        print(f"  check: DeepGEMM masked vs ours on the valid rows rel err {err:.2e}"
              + ("  MISMATCH" if err > 1e-2 else ""))
        pr = paired({"ours": op_timer(functools.partial(gmm, zero_padding=False),
                                      (lhs, rhs, counts), reps=reps),
                     "deepgemm": lambda: dgb.time_slope(dgm, run, reps=reps)}, rounds)
        recs = record_rounds(pr, {"ours": "ours masked FP8 (no zero rows), paired rounds",
                                  "deepgemm": "DeepGEMM masked FP8 (no zero rows), paired rounds"},
                             tag, useful, wbytes, op="masked-FP8-paired", zero_padding=False)
        for r in recs.values():
            r["vs_weight_read"] = r["ms"] * 1e-3 / floor
        print(f"  masked FP8 without zero rows, paired rounds: ours "
              f"{np.median(pr['ours']) / floor:.3f}x, DeepGEMM "
              f"{np.median(pr['deepgemm']) / floor:.3f}x the weight read; ours / DeepGEMM speed "
              f"{ratio_median(pr['deepgemm'], pr['ours']):.3f}", flush=True)
        del out

    # Masked layout (decode): G groups of capacity C, counts averaging 32.
    Gm, C, K, N = map(int, args.masked.split(","))
    tag = f"G={Gm} C={C} K={K} N={N}"
    print(f"\n== masked {tag}")
    counts = jnp.asarray(np.minimum(rng.integers(0, 65, Gm), C), jnp.int32)
    x = jnp.asarray(rng.standard_normal((Gm, C, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((Gm, K, N)) / np.sqrt(K), jnp.bfloat16)
    gmm = functools.partial(jax_ep.grouped_matmul_masked, backend=args.backend)
    useful = 2.0 * float(np.asarray(counts).sum()) * K * N
    for label, lhs, rhs, wbytes in (
            ("bf16", x, w, w.nbytes),
            ("FP8", jax.jit(jax_ep.quantize_fp8)(x), jax.jit(jax_ep.quantize_fp8_weights)(w),
             Gm * K * N + Gm * (K // 128) * (N // 128) * 4)):
        for zp in (True, False):
            t = time_op(functools.partial(gmm, zero_padding=zp), (lhs, rhs, counts), reps=reps)
            floor = wbytes / hbm_rate
            r = record(f"ours masked {label}, zero_padding={zp}", tag, t, useful, wbytes,
                       impl="ours", op=f"masked-{label}", zero_padding=zp,
                       counts_mean=float(np.mean(counts)), weight_read_ms=floor * 1e3,
                       vs_weight_read=t[0] / floor)
            print(f"  {label} zero_padding={zp}: {r['ms']:.3f} ms = {t[0] / floor:.3f}x the "
                  f"weight read at the HBM rate ({floor * 1e3:.3f} ms for {wbytes / 1e9:.2f} GB)")
        if label == "FP8" and dgm:
            masked_deepgemm(lhs, rhs, counts, wbytes / hbm_rate, useful, wbytes, tag)

    with open(os.path.join(args.out, "bench_gemm.json"), "w") as f:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, hbm_copy_gbps=hbm_rate / 1e9,
                       results=results), f, indent=1)
    tf = [r for r in results if r.get("tflops") and r.get("op") in (
        "fwd", "fwd+bwd", "fp8", "fwd-int", "fp8-int", "ex57-bf16", "ex57-fp8", "fp8-paired",
        "fp8-int-paired")]
    barh_plot(os.path.join(args.out, "bench_gemm.png"),
              [f"{r['name']} | {r['shape'].split(' K=')[-1]}" for r in tf],
              [r["tflops"] for r in tf], "TFLOP/s (one H200)",
              figsize=(13, 1 + 0.3 * len(tf)))
    print("\nwrote", os.path.join(args.out, "bench_gemm.json"))


if __name__ == "__main__":
    sys.exit(main())
