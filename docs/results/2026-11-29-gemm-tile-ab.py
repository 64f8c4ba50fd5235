"""python docs/results/2026-11-29-gemm-tile-ab.py TAG (SMALL=1: a CPU check of the script).
grouped_matmul bf16 on one GPU, for a tile A/B across builds (one build per process):
forward on equal groups, routed groups (a multinomial draw: uniform routing), Zipf-skewed groups
and a quarter-used buffer; forward + backward on routed groups (the lhs gradient is the [G, N, K]
kernel); the dense GEMM of the same FLOPs in every round. Medians of 3 paired rounds."""
import os, sys
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import jax_ep
from harness import op_timer, paired
from bench_gemm import zipf_sizes, uniform_sizes
tag = sys.argv[1]
rng = np.random.default_rng(0)
G, M = (4, 256) if os.environ.get("SMALL") else (32, 32768)
for K, N in ((256, 128),) if os.environ.get("SMALL") else ((7168, 4096), (2048, 7168)):
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.bfloat16)
    sz = {"equal": uniform_sizes(M, G),
          "routed": np.bincount(rng.integers(0, G, M), minlength=G).astype(np.int32),
          "zipf": zipf_sizes(rng, M, G),
          "quarter": uniform_sizes(M, G, M // 4)}
    sz = {k: jnp.asarray(v) for k, v in sz.items()}
    gm = jax_ep.grouped_matmul
    # correctness on routed groups: the first group's rows and the last's, against dense GEMMs
    s0, sl = int(sz["routed"][0]), int(sz["routed"][-1])
    got = jax.jit(gm)(x, w, sz["routed"]).astype(jnp.float32)
    got = jnp.concatenate([got[:s0], got[M - sl:]])
    ref = jnp.concatenate([x[:s0].astype(jnp.float32) @ w[0].astype(jnp.float32),
                           x[M - sl:].astype(jnp.float32) @ w[-1].astype(jnp.float32)])
    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))

    def fb(a, b, s):
        v, g = jax.value_and_grad(lambda a, b: jnp.sum(gm(a, b, s).astype(jnp.float32)),
                                  argnums=(0, 1))(a, b)
        return v + jnp.sum(g[0], dtype=jnp.float32) + jnp.sum(g[1], dtype=jnp.float32)
    timers = {k: op_timer(gm, (x, w, s)) for k, s in sz.items()}
    timers["fwd+bwd routed"] = op_timer(fb, (x, w, sz["routed"]))
    timers["fwd+bwd equal"] = op_timer(fb, (x, w, sz["equal"]))
    timers["dense"] = op_timer(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16),
                               (x, w[0]))
    pr = paired(timers, 3)
    med = {k: float(np.median(v)) * 1e3 for k, v in pr.items()}
    rel = {k: float(np.median([a / d for a, d in zip(v, pr["dense"])])) for k, v in pr.items()}
    print(f"{tag} K={K} N={N} err {err:.1e} | " + "  ".join(
        f"{k} {med[k]:.3f} ms ({rel[k]:.3f} dense)" for k in pr), flush=True)
