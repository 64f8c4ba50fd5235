"""The memory XLA plans for moe_ffn's step and training step (as benchmarks/bench_layer.py's
"step" and "training step") with the fused forward's extra passes summed between the first
pass's two kernels (the layer as it is) and after the first pass (benchmarks/pass_loop_cost.py's
"late" variant), each over its expert compute's; compiled for R H200s without a GPU, as
2026-11-30-deviceless-passes-memory.py (XLA's H200 target config):

  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python docs/results/2026-11-30-deviceless-passes-early-memory.py \\
      REPO SPEC R
XLA does not autotune without a device, so the plans may differ slightly from a GPU's."""
import os
import sys

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep import runtime

sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
from bench_layer import expert_compute, step_bytes, training_step, with_backward  # noqa: E402
from harness import scan_fn  # noqa: E402
from pass_loop_cost import passes  # noqa: E402

runtime.cuda_backend_available = lambda: True       # the targets are CUDA's
runtime.ensure_peer_runtime = lambda *a, **k: None  # no device to map peers on
R = int(sys.argv[3])
T, H, I, L, K = 4096, 7168, 2048, 32, 8
E = R * L
topo = topologies.get_topology_desc(platform="cuda", topology_name="",
                                    target_config=open(sys.argv[2]).read(),
                                    topology=f"1x1x{R}")
mesh = Mesh(topo.devices[:R], ("ep",))


def S(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("ep")))


def plan(fn, argnums, args, train, tokens_of_rows=0):
    if train:
        f = jax.jit(jax.shard_map(training_step(fn, argnums, tokens_of_rows), mesh=mesh,
                                  in_specs=P("ep"), out_specs=P("ep"), check_vma=False))
    else:
        f = scan_fn(mesh, with_backward(fn, argnums), 1)
    return step_bytes(f.lower(*args).compile())[0]


x, idx, w = S((R * T, H), jnp.bfloat16), S((R * T, K), jnp.int32), S((R * T, K), jnp.float32)
wgu, wd = S((E, H, 2 * I), jnp.bfloat16), S((E, I, H), jnp.bfloat16)
layer = lambda *a: jax_ep.moe_ffn(*a, num_experts=E, backend="cuda")  # noqa: E731
floor = lambda *a: expert_compute(*a, backend="cuda")  # noqa: E731
rows = S((R * T * K, H), jnp.bfloat16)
for train in (False, True):
    name = "training step" if train else "step"
    want = plan(floor, (0, 2, 3), (rows, w, wgu, wd), train, K)
    for kind in (None, "late"):
        with passes(kind):
            got = plan(layer, (0, 2, 3, 4), (x, idx, w, wgu, wd), train)
        what = "passes after the first" if kind else "passes between the halves"
        print(f"R={R} {name}: moe_ffn, {what}: {got} bytes, expert compute {want}, "
              f"ratio {got / want:.4f}", flush=True)
