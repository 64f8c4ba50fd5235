"""Run as `python docs/results/2026-11-27-combine-blocks-sweep.py 4 0,1,8,24,32` (R, the
settings; 0: automatic). moe_ffn(fused=True) forward at R ranks against fused_combine_blocks, with the unfused layer
and the expert compute in the same run (slope of scans of 1 and 3 calls, median of 3)."""
import functools, os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import jax_ep
from jax.sharding import Mesh
from harness import scan_fn, time_slope
import bench_layer as bl
R = int(sys.argv[1]); cbs = [int(v) for v in sys.argv[2].split(",")]
T, H, I, L, K = 4096, 7168, 2048, 32, 8
devs = jax.devices(); mesh = Mesh(np.array(devs[:R]), ("ep",)); E = R * L
wgu, wd, x, xr = bl.layer_inputs(R, mesh, R, T, H, I, L, K)
rng = np.random.default_rng(0)
w, idx = jax.jit(functools.partial(jax_ep.routing.softmax_topk, k=K))(jnp.asarray(rng.standard_normal((R * T, E)), jnp.float32))
w = w.astype(jnp.bfloat16)
lay = (x, idx, w, wgu, wd)
def t(fn, args):
    fs = scan_fn(mesh, fn, 1).lower(*args).compile(); fl = scan_fn(mesh, fn, 3).lower(*args).compile()
    return time_slope(fs, fl, 1, 3, args, 3)[0] * 1e3
print(f"R={R} expert compute fwd {t(functools.partial(bl.expert_compute, backend='cuda'), (xr, w, wgu, wd)):.3f} ms", flush=True)
print(f"R={R} unfused fwd {t(lambda *a: jax_ep.moe_ffn(*a, num_experts=E, fused=False), lay):.3f} ms", flush=True)
for cb in cbs:
    print(f"R={R} fused combine_blocks={cb} fwd {t(lambda *a: jax_ep.moe_ffn(*a, num_experts=E, fused=True, fused_combine_blocks=cb), lay):.3f} ms", flush=True)
