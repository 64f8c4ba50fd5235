"""R = 2 (the machine's first 2 GPUs): the fused layer's two kernels, forward, under each
(fused_copy_blocks, fused_combine_blocks) setting, from profiler traces; rounds alternate the
settings. Per setting: each kernel's us per call on GPU 0 and GPU 1, and the sum of all kernels.

  python docs/results/2026-11-29-fused-blocks-sweep.py REPO [ROUNDS]   (REPO: the repository root,
  for benchmarks/; on a machine with 2 GPUs and jax_ep installed)"""
import functools, os, sys, tempfile
import numpy as np
import jax
from jax.sharding import Mesh
import jax_ep
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import kernel_times
from bench_layer import draw_routing, layer_inputs
from harness import scan_fn

R, T, H, I, L, K, CALLS = 2, 4096, 7168, 2048, 32, 8, 5
SET = [(0, 0), (32, 0), (48, 0), (0, 20), (0, 24), (32, 20)]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 2
devs = jax.devices()
mesh = Mesh(np.array(devs[:R]), ("ep",))
E = R * L
wgu, wd, x, xr = layer_inputs(R, mesh, R, T, H, I, L, K)
w, idx = draw_routing(np.random.default_rng(0), "uniform", R * T, E, K)
lay = (x, idx, w, wgu, wd)
comp = {}
for c, b in SET:
    f = functools.partial(jax_ep.moe_ffn, num_experts=E, fused=True, fused_copy_blocks=c,
                          fused_combine_blocks=b, backend="cuda")
    comp[(c, b)] = scan_fn(mesh, lambda *a, f=f: f(*a), CALLS).lower(*lay).compile()
    for _ in range(2):
        jax.block_until_ready(comp[(c, b)](*lay))
res = {s: [] for s in SET}
for r in range(ROUNDS):
    for s in SET:
        with tempfile.TemporaryDirectory() as d:
            t = kernel_times.trace_kernels(functools.partial(comp[s], *lay), d, ".", CALLS)
        row = []
        for dev, dd in sorted(t["devices"].items()):
            ks = dd["kernels"]
            gg = sum(v["us_per_call"] for k, v in ks.items() if "gather_gemm" in k)
            gc = sum(v["us_per_call"] for k, v in ks.items() if "gemm_combine" in k)
            tot = sum(v["us_per_call"] for v in ks.values())
            row.append((gg, gc, tot))
        res[s].append(row)
        print(f"round {r} copy {s[0] or 'auto':>4} combine {s[1] or 'auto':>4}: " + "  ".join(
            f"gpu{i} gather_gemm {a:7.1f} gemm_combine {b:7.1f} all {c:7.1f}"
            for i, (a, b, c) in enumerate(row)), flush=True)
print("medians over rounds and GPUs (us per call): setting  gather_gemm  gemm_combine  all")
for s in SET:
    a = np.array(res[s])
    print(f"  copy {s[0] or 'auto':>4} combine {s[1] or 'auto':>4}  "
          f"{np.median(a[:, :, 0]):8.1f} {np.median(a[:, :, 1]):8.1f} {np.median(a[:, :, 2]):8.1f}")
