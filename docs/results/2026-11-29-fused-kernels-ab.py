"""R = 2: the fused layer's kernels, forward and forward + backward, from profiler traces; per
kernel of interest its us per call on each GPU, the median of ROUNDS traces. Run under two builds
by scripts/gpu_check.sh's ab stage:

  scripts/ab_base.sh HEAD .out/ab_base
  AB_BASE=.out/ab_base AB_ROUNDS=2 \
  AB_CMD='python3 "$R/docs/results/2026-11-29-fused-kernels-ab.py" "$R" | grep -E "^fwd"' \
      scripts/gpu_check.sh build ab"""
import functools, os, sys, tempfile
import numpy as np
import jax
from jax.sharding import Mesh
import jax_ep
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import kernel_times
from bench_layer import draw_routing, layer_inputs, with_backward
from harness import scan_fn

R, T, H, I, L, K, CALLS, ROUNDS = 2, 4096, 7168, 2048, 32, 8, 5, 3
devs = jax.devices()
mesh = Mesh(np.array(devs[:R]), ("ep",))
E = R * L
wgu, wd, x, xr = layer_inputs(R, mesh, R, T, H, I, L, K)
w, idx = draw_routing(np.random.default_rng(0), "uniform", R * T, E, K)
lay = (x, idx, w, wgu, wd)
f = functools.partial(jax_ep.moe_ffn, num_experts=E, fused=True, backend="cuda")
KEYS = {"gather_gemm<fwd>": ("gather_gemm_kernel<true, false>",),
        "gemm_combine<fwd>": ("gemm_combine_kernel<false>",),
        "gemm_combine<bwd>": ("gemm_combine_kernel<true>",)}
for op, fn in (("fwd", lambda *a: f(*a)), ("fwd+bwd", with_backward(lambda *a: f(*a), (0, 2, 3, 4)))):
    c = scan_fn(mesh, fn, CALLS).lower(*lay).compile()
    for _ in range(2):
        jax.block_until_ready(c(*lay))
    rows = []
    for r in range(ROUNDS):
        with tempfile.TemporaryDirectory() as d:
            t = kernel_times.trace_kernels(functools.partial(c, *lay), d, ".", CALLS)
        row = {}
        for dev, dd in sorted(t["devices"].items()):
            ks = dd["kernels"]
            for name, pats in KEYS.items():
                row[(dev, name)] = sum(v["us_per_call"] for k, v in ks.items()
                                       if any(p in k for p in pats))
            row[(dev, "all")] = sum(v["us_per_call"] for v in ks.values())
        rows.append(row)
    for key in rows[0]:
        vals = [rw[key] for rw in rows]
        if vals[0] == 0:
            continue
        print(f"{op:8s} {key[0][-5:]} {key[1]:18s} median {np.median(vals):8.1f} us  "
              + " ".join(f"{v:7.1f}" for v in vals))
    del c
    jax.clear_caches()
