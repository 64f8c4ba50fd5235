"""The memory XLA plans for moe_ffn's step and training step (as benchmarks/bench_layer.py's
"step" and "training step") with the fused forward's extra passes summed between the first
pass's two halves (the layer as it is) and after the first pass
(benchmarks/pass_loop_cost.py's "late" variant), compiled on the machine's first R GPUs
(nothing run), R = 2, the standard shapes:

  python docs/results/2026-11-30-passes-early-memory.py REPO [R]
"""
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from bench_layer import step_bytes, training_step, with_backward  # noqa: E402
from harness import scan_fn  # noqa: E402
from pass_loop_cost import passes  # noqa: E402

R = int(sys.argv[2]) if len(sys.argv) > 2 else 2
T, H, I, L, K = 4096, 7168, 2048, 32, 8
E = R * L
mesh = Mesh(np.array(jax.devices()[:R]), ("ep",))


def S(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("ep")))


args = (S((R * T, H), jnp.bfloat16), S((R * T, K), jnp.int32), S((R * T, K), jnp.bfloat16),
        S((E, H, 2 * I), jnp.bfloat16), S((E, I, H), jnp.bfloat16))


def layer(*a):
    return jax_ep.moe_ffn(*a, num_experts=E)


print(f"device: {jax.devices()[0].device_kind} x {R}, jax {jax.__version__}")
for name, kind in (("moe_ffn (passes between the halves)", None), ("passes after the first", "late")):
    with passes(kind):
        step = scan_fn(mesh, with_backward(layer, (0, 2, 3, 4)), 1)
        train = jax.jit(jax.shard_map(training_step(layer, (0, 2, 3, 4)), mesh=mesh,
                                      in_specs=P("ep"), out_specs=P("ep"), check_vma=False))
        s = step_bytes(step.lower(*args).compile())[0]
        t = step_bytes(train.lower(*args).compile())[0]
    print(f"  {name:<38} step {s:>14,} B   training step {t:>14,} B")
